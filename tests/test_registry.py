"""The framework names no stage: `pipeline/` imports nothing from `stages/`, and a stage comes in through the
registry (plain data, names to import paths). Adding one is a module and a registry line
(docs/architecture.md, "Adding a stage"): the toy stage below is that worked example."""

from __future__ import annotations

import ast
import textwrap

import pytest

from conftest import ROOT, SMOKE

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 2}


def _imports(path) -> list[tuple[int, str]]:
    """Every module a file imports, `if TYPE_CHECKING:` blocks and function bodies included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def test_the_framework_imports_no_stage():
    offenders = [f"{f.relative_to(ROOT)}:{line} imports {name}" for f in sorted((ROOT / "pipeline").rglob("*.py"))
                 for line, name in _imports(f) if name == "stages" or name.startswith("stages.")]
    assert offenders == [], "\n".join(offenders)


TOY = '''
    """A toy stage: writes its greeting `times` times (the worked example of docs/architecture.md)."""

    from __future__ import annotations

    from pathlib import Path

    from pydantic import Field

    from pipeline.schema import Section


    class GreetConfig(Section):
        """The greet stage."""

        greeting: str = Field("hello", description="What it writes.")
        times: int = Field(1, ge=1, description="How often it writes it.")


    def check(pipeline_cfg) -> None:
        greet = pipeline_cfg.stages.greet
        if greet is not None and greet.times > pipeline_cfg.stages.data.max_len:
            raise ValueError("stages.greet.times: more greetings than stages.data.max_len; write fewer")


    def run(cfg: GreetConfig, ctx) -> dict[str, Path]:
        out = ctx.out_dir / "greeting.txt"
        out.write_text(" ".join([cfg.greeting] * cfg.times))
        return {"greeting": out}
'''


@pytest.fixture
def greet(tmp_path, monkeypatch):
    """The toy stage's module on the path, and its one registry line."""
    import sys

    from pipeline.registry import StageSpec

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "toy_greet.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    yield StageSpec("greet", "toy_greet", "stages.greet", ("seed",), (), ("greeting",), "write a greeting",
                    settings="toy_greet:GreetConfig", doc="The greet stage; empty: none.")
    sys.modules.pop("toy_greet", None)


def test_a_stage_is_one_module_and_one_registry_line(greet, tmp_path, tracking_uri):
    from rich.console import Console

    from pipeline.config import ConfigError, PipelineConfig, compose, load_config, reference
    from pipeline.registry import STAGES, stages_for
    from pipeline.runner import run_pipeline

    schema = compose((*STAGES, greet))
    base = [f"run_dir={tmp_path / 'run'}", f"mlflow.tracking_uri={tracking_uri}"]
    cfg = load_config(SMOKE, [*base, "stages.greet.greeting=hi", "stages.greet.times=2"], schema=schema)
    assert type(cfg.stages.greet).__name__ == "GreetConfig" and cfg.stages.greet.greeting == "hi"  # typed access
    assert [s.name for s in stages_for(cfg)][-1] == "greet"
    # validate's errors name its keys, its own rules included; the config reference documents it
    with pytest.raises(ConfigError, match=r"stages\.greet\.greting: unknown key; did you mean 'greeting'\?"):
        load_config(SMOKE, [*base, "stages.greet.greting=hi"], schema=schema)
    with pytest.raises(ConfigError, match=r"stages\.greet\.times: more greetings than stages\.data\.max_len"):
        load_config(SMOKE, [*base, "stages.greet.times=1000"], schema=schema)
    rows = {key: doc for key, _, doc in reference(schema)}
    assert rows["stages.greet"] == "The greet stage; empty: none." and \
        rows["stages.greet.times"] == "How often it writes it."
    # opt-in: a config without the section has no such stage; the stock config knows nothing of it
    assert "greet" not in [s.name for s in stages_for(load_config(SMOKE, base, schema=schema))]
    assert "greet" not in PipelineConfig.model_fields["stages"].annotation.model_fields
    # and it runs, cached like any stage
    console = Console(quiet=True)
    first = run_pipeline(cfg, SMOKE, console, only=["greet"])
    assert {p.spec.name: p.status for p in first["plan"]}["greet"] == "miss"
    assert [p.read_text() for p in (tmp_path / "run" / "artifacts" / "greet").glob("*/greeting.txt")] == ["hi hi"]
    again = run_pipeline(cfg, SMOKE, console, only=["greet"])
    assert {p.spec.name: p.status for p in again["plan"]}["greet"] == "hit"
