"""The written stage interface (`pipeline.stage`): both contexts implement it, stages use nothing else."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from conftest import ROOT
from pipeline.registry import load
from pipeline.stage import StageContext


def _members(cls) -> set[str]:
    """Annotated attributes, methods and properties of a Protocol class."""
    return set(cls.__annotations__) | {n for n, v in vars(cls).items() if not n.startswith("_")
                                       and (callable(v) or isinstance(v, property))}


INTERFACE = _members(StageContext)


def test_the_interface_declares_what_stages_need():
    assert {"inputs", "out_dir", "checkpoint_dir", "storage", "log_metrics", "log_artifact", "set_tags",
            "mlflow_client", "progress", "ray", "train_callbacks"} <= INTERFACE


@pytest.mark.parametrize("context", ["pipeline.runner:RunContext", "stages.tune:TrialContext"])
def test_both_contexts_implement_every_member(context):
    module, name = context.split(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    fields = {f.name for f in dataclasses.fields(cls)}
    has = fields | {n for n in dir(cls) if not n.startswith("_")}
    assert INTERFACE - has == set(), f"{name} lacks {sorted(INTERFACE - has)}"
    for method in (n for n, v in vars(StageContext).items() if callable(v) and not n.startswith("_")):
        want = list(inspect.signature(getattr(StageContext, method)).parameters)
        got = list(inspect.signature(getattr(cls, method)).parameters)
        assert got == want, f"{name}.{method}{got} differs from the interface's {want}"


STAGE_FILES = sorted(p for p in (ROOT / "stages").rglob("*.py") if "common" not in p.parts)


@pytest.mark.parametrize("path", STAGE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_stages_use_only_the_interface(path):
    used = set(re.findall(r"\bctx\.([A-Za-z_]\w*)", path.read_text()))
    assert used - INTERFACE == set(), f"{path.name} reaches past the stage interface: ctx.{sorted(used - INTERFACE)}"


def test_every_registered_stage_loads_with_its_hooks():
    from pipeline.registry import STAGES

    assert {"stages.tune", "stages.batch_infer"} <= {s.module for s in STAGES}
    for module in [s.module for s in STAGES]:
        stage = load(module)
        assert callable(stage.run) and callable(stage.raw_inputs) and callable(stage.always_runs)
        assert callable(stage.check) and callable(stage.wire)
        assert stage.run.__annotations__.get("ctx") == "StageContext", \
            f"{module}.run(cfg, ctx) is not typed with StageContext"
    assert load("stages.serve").always_runs is vars(__import__("stages.serve", fromlist=["x"]))["always_runs"]
    assert load("stages.sft").raw_inputs(None) == []  # the documented default hook
    with pytest.raises(TypeError, match="no run"):
        load("pipeline.errors")
