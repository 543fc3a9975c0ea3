"""Cache keys cover what can change a stage's outputs and nothing else (docs/architecture.md, "Cache keys").

An edit is simulated by making one file hash differently; the plan is keyed before and after on the
smoke config (model, data, sft, a sweep over sft, reward, ppo, serve). No Ray, nothing runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT, smoke_config
from pipeline import artifacts as arts
from pipeline.plan import build_plan

SWEEP = ("stages.tune.target=sft", "stages.tune.search_space.lr.grid=[0.001, 0.01]")
AFTER_DATA = ["data", "ppo", "reward", "serve", "sft", "tune"]


def _rekeyed(tmp_path, monkeypatch, edited: str) -> list[str]:
    """The stages whose key changes when `edited` (a path under the project) changes."""
    def keys():
        return {p.spec.name: p.key for p in build_plan(smoke_config(tmp_path / "run", *SWEEP))}

    before = keys()
    assert set(before) == {"model", "data", "sft", "tune", "reward", "ppo", "serve"}
    real = arts.sha256_file
    monkeypatch.setattr(arts, "sha256_file", lambda p: "edited" if str(p).endswith(edited) else real(p))
    after = keys()
    return sorted(name for name in before if after[name] != before[name])


@pytest.mark.parametrize("edited", [
    "pipeline/console.py", "pipeline/progress.py",  # the output router, progress bars
    "pipeline/config.py", "pipeline/registry.py",  # composing the config, naming the stages: values are keyed
    "pipeline/events.py",  # say / advance / metrics to MLflow from the workers
    "pipeline/stage.py",  # the stage interface: stages import it for annotations only
    "pipeline/runner.py", "pipeline/plan.py",  # running and planning
    "pipeline/__main__.py", "pipeline/reports.py", "pipeline/ui.py",  # the CLI, what it prints, the UI
])
def test_editing_reporting_interface_or_runner_code_reruns_no_stage(tmp_path, monkeypatch, edited):
    assert _rekeyed(tmp_path, monkeypatch, edited) == []


@pytest.mark.parametrize("edited, rerun", [
    ("stages/data/formats.py", AFTER_DATA),  # the data stage's reading code: it and everything after it
    ("stages/common/training.py", ["ppo", "reward", "serve", "sft", "tune"]),  # the shared Train helpers
    # the one Train loop (ppo: on sft's model)
    ("stages/common/train_loop.py", ["ppo", "reward", "serve", "sft", "tune"]),
    ("stages/common/deepspeed.py", ["ppo", "reward", "serve", "sft", "tune"]),
    ("stages/ppo/rl.py", ["ppo", "serve"]),  # PPO's math: PPO and what serves its policy
    ("stages/ppo/losses.py", ["ppo", "serve"]),  # what PPO's ranks minimise
    ("stages/reward/losses.py", ["ppo", "reward", "serve"]),  # Bradley-Terry: the reward model and the policy it scores
    ("stages/common/tasks.py", sorted(["model", *AFTER_DATA])),  # the generated task (the model's tokenizer too)
    ("pipeline/files.py", ["ppo", "serve"]),  # ppo writes its checkpoint records with it (serve: downstream)
    ("pipeline/storage.py", []),  # the artifact store is the runner's: in no stage's code
    ("pipeline/swap.py", []),  # the store swaps directories in with it
])
def test_editing_a_stages_code_reruns_it_and_what_is_downstream(tmp_path, monkeypatch, edited, rerun):
    assert _rekeyed(tmp_path, monkeypatch, edited) == rerun


@pytest.mark.parametrize("stage, losses", [("stages.dpo", "stages/dpo/losses.py"),
                                           ("stages.reward", "stages/reward/losses.py"),
                                           ("stages.ppo", "stages/ppo/losses.py")])
def test_a_stages_loss_module_is_in_its_key(stage, losses):
    """The stage package imports its losses by absolute name (`from stages.dpo.losses import pair_losses`), which
    the key's import walk follows (dpo is not in the smoke plan above, so its key is read here directly)."""
    assert losses in arts.code_fingerprint(stage)


def test_no_project_module_imports_relatively():
    """The key's import walk reads absolute imports only: a `from .losses import x` would leave that file's code
    out of every key that should cover it, and editing it would rerun nothing."""
    found = [f"{f.relative_to(ROOT)}:{node.lineno}" for package in arts.PROJECT_PACKAGES
             for f in sorted((ROOT / package).rglob("*.py"))
             for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert found == []


def annotation_only_modules(path: Path) -> set[str]:
    """`pipeline` modules `path` imports at run time (not under `if TYPE_CHECKING:`) whose every imported
    name is used only in function annotations: with `from __future__ import annotations` those never
    run, yet the import would put the module's code into the stage's key. (Only the pipeline's: a
    stage's config class named in an annotation is code that runs, through the object passed in.)"""
    tree = ast.parse(path.read_text())
    in_annotation: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None and a.annotation is not None:
                    in_annotation.update(id(n) for n in ast.walk(a.annotation))
            if node.returns is not None:
                in_annotation.update(id(n) for n in ast.walk(node.returns))
    names: dict[str, str] = {}  # bound name -> module, for top-level `from pipeline... import name`
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pipeline":
            names.update({a.asname or a.name: node.module for a in node.names})
    elsewhere = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n not in tree.body}
    used: dict[str, set[bool]] = {n: set() for n in names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in used:
            used[node.id].add(id(node) in in_annotation)
    modules = {m: [used[n] for n, mm in names.items() if mm == m] for m in set(names.values())}
    return {m for m, uses in modules.items() if all(u == {True} for u in uses) and m not in elsewhere}


def _reached(module: str) -> set[Path]:
    """`artifacts.code_files(module)` without following annotation-only imports."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or name in arts.REPORTING:
            continue
        path = arts._module_file(name)
        if path is None:
            continue
        seen[name] = path
        todo.extend(arts._imported_modules(path) - annotation_only_modules(path))
    return set(seen.values())


@pytest.mark.parametrize("stage", ["stages.model", "stages.data", "stages.sft", "stages.reward", "stages.dpo",
                                   "stages.ppo", "stages.tune", "stages.serve", "stages.batch_infer"])
def test_no_stage_key_covers_pipeline_code_it_imports_only_for_annotations(stage):
    """Such an import goes under `if TYPE_CHECKING:` (the stage interface, the run storage's type),
    so editing that module reruns nothing."""
    extra = set(arts.code_files(stage)) - _reached(stage)
    assert sorted(str(p.relative_to(ROOT)) for p in extra) == []


def test_the_annotation_scan_finds_an_annotation_only_import(tmp_path):
    f = tmp_path / "stage.py"
    f.write_text("from __future__ import annotations\nfrom pipeline.stage import StageContext\n"
                 "from pipeline.errors import UserError\n\n"
                 "def run(cfg, ctx: StageContext) -> None:\n    raise UserError('x')\n")
    assert annotation_only_modules(f) == {"pipeline.stage"}
