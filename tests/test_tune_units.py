"""The tune stage's config validation, pure helpers and how `use_tuned` keys the target (no Ray)."""

from __future__ import annotations

import json

import pytest

from conftest import smoke_config
from pipeline import storage
from pipeline.errors import ConfigError
from pipeline.runner import build_plan
from stages.tune import best_trial, last_reported, trial_count, trial_status

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 4}

SWEEP = ["stages.tune.target=sft", "stages.tune.search_space.lr.loguniform=[1.0e-4, 1.0e-2]"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["stages.tune.target=sft", "stages.tune.search_space.lrr.choice=[0.1]"],
         "stages.tune.search_space.lrr: not a field of stages.sft; did you mean 'lr'?"),
        (["stages.tune.target=sft", "stages.tune.search_space.deepspeed.zero_stag.choice=[0]"],
         "stages.tune.search_space.deepspeed.zero_stag: not a field of stages.sft.deepspeed; did you mean "
         "'zero_stage'?"),
        (["stages.tune.target=ppo", "stages.tune.metric=reward_mean",
          "stages.tune.search_space.policy.lrr.choice=[0.1]"],
         "stages.tune.search_space.policy.lrr: not a field of stages.ppo.policy; did you mean 'lr'?"),
        (["stages.tune.target=sft", "stages.tune.search_space.lr.choice=[]"],
         "stages.tune.search_space.lr: choice is empty"),
        (["stages.tune.target=sft", "stages.tune.search_space.warmup_steps.grid=[]"],
         "stages.tune.search_space.warmup_steps: grid is empty"),
        (["stages.tune.target=sft", "stages.tune.search_space.deepspeed.choice=[0]"],
         "stages.tune.search_space.deepspeed: is a section, not a value"),
        (["stages.tune.target=sft", "stages.tune.search_space.lr.choice=[0.1, -1]"],
         "stages.tune.search_space.lr: choice value -1 is invalid for stages.sft: stages.sft.lr: input should be "
         "greater than 0"),
        (["stages.tune.target=sft", "stages.tune.search_space.batch_size.choice=[8, 6]"],
         "stages.tune.search_space.batch_size: choice value 6 is invalid for stages.sft"),
        (["stages.tune.target=sft", "stages.tune.search_space.lr.loguniform=[0, 1]"],
         "stages.tune.search_space.lr: loguniform: low must be > 0"),
        (["stages.tune.target=sft", "stages.tune.search_space.lr.uniform=[1, 1]"],
         "stages.tune.search_space.lr: uniform: low must be below high"),
        ([*SWEEP, "stages.tune.metric=reward_mean"], "stages.tune.metric: sft does not report 'reward_mean'"),
        ([*SWEEP, "stages.tune.search_alg=optuna"], "needs the optuna package"),
        ([*SWEEP, "stages.tune.max_concurrent_trials=3"], "stages.tune.max_concurrent_trials: 3 trials of sft need 3"),
        (["stages.reward.use_tuned=true"], "stages.reward.use_tuned: there is no sweep over reward"),
        ([*SWEEP, "stages.ppo.use_tuned=true"], "stages.ppo.use_tuned: there is no sweep over ppo"),
    ],
)
def test_search_space_mistakes_name_the_key(tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as exc:
        smoke_config(tmp_path, *overrides)
    assert expected in str(exc.value)


def test_nested_and_dotted_field_paths_are_the_same_dimension(tmp_path):
    cfg = smoke_config(tmp_path, "stages.tune.target=sft", "stages.tune.search_space.deepspeed.zero_stage.grid=[0, 3]")
    assert list(cfg.stages.tune.search_space) == ["deepspeed.zero_stage"]
    assert cfg.stages.tune.search_space["deepspeed.zero_stage"].kind == "grid"


def test_the_progress_total_counts_every_grid_point(tmp_path):
    """A grid runs every value num_samples times: the progress line's total (it showed "trial 2/1")."""
    grid = smoke_config(tmp_path, "stages.tune.num_samples=2",
                        "stages.tune.search_space={lr: {grid: [0.001, 0.01, 0.1]}, "
                        "epochs: {grid: [1, 2]}, weight_decay: {uniform: [0.0, 0.1]}}").stages.tune
    assert trial_count(grid) == 2 * 3 * 2
    plain = smoke_config(tmp_path, "stages.tune.num_samples=5",
                         "stages.tune.search_space={lr: {loguniform: [1.0e-4, 1.0e-2]}}")
    assert trial_count(plain.stages.tune) == 5


def test_trial_status_and_best_trial():
    assert trial_status({"trial_completed": 1, "eval_loss": 1.0}, None) == "completed"
    assert trial_status({"eval_loss": 1.0}, None) == "stopped_early"
    assert trial_status({"trial_completed": 1}, RuntimeError("x")) == "failed"
    rows = [{"id": "a", "eval_loss": 2.0}, {"id": "b", "eval_loss": 1.5}, {"id": "c", "eval_loss": float("nan")},
            {"id": "d"}]
    assert best_trial(rows, "eval_loss", "min")["id"] == "b"
    assert best_trial(rows, "eval_loss", "max")["id"] == "a"
    assert best_trial([{"id": "d"}], "eval_loss", "min") is None


def test_last_reported_skips_a_final_report_without_the_metric():
    import pandas as pd
    history = pd.DataFrame({"step": [4, 8, 8], "eval_loss": [3.0, 2.5, None]})
    assert last_reported({"step": 8}, history, "eval_loss") == 2.5
    assert last_reported({"eval_loss": 1.0}, history, "eval_loss") == 1.0
    assert last_reported({}, pd.DataFrame({"step": [1]}), "eval_loss") is None
    assert last_reported({}, None, "eval_loss") is None


def _finish_sweep(cfg, params: dict) -> None:
    """Write a finished tune artifact (manifest + best_config.json) for the sweep's current key."""
    key = {p.spec.name: p for p in build_plan(cfg)}["tune"].key
    store = storage.ArtifactStore(cfg.run_dir)
    (store.begin("tune", key) / "best_config.json").write_text(json.dumps({"params": params}))
    store.commit("tune", key, {"outputs": {"best_config": "best_config.json"}})


def test_use_tuned_keys_the_target_on_the_sweeps_values_not_on_the_sweep(tmp_path):
    def plan(*extra):
        cfg = smoke_config(tmp_path, *SWEEP, "stages.sft.use_tuned=true", *extra)
        return cfg, {p.spec.name: p for p in build_plan(cfg)}

    cfg, p = plan()
    order = [s for s in p]
    assert order.index("tune") < order.index("sft")  # the sweep runs first when sft takes its values
    assert p["sft"].pending and "waits for the tune stage" in p["sft"].reason
    # what depends on sft cannot be keyed before it either (keyed once sft has run, not on a placeholder)
    assert p["reward"].pending and p["reward"].key is None and "keyed once sft has run" in p["reward"].reason
    assert not p["data"].pending and p["data"].key

    _finish_sweep(cfg, {"lr": 0.005})
    cfg, p = plan()
    assert not p["sft"].pending and p["sft"].config.lr == 0.005
    assert p["sft"].components["config"]["stages.sft"]["lr"] == 0.005  # what MLflow params show
    key = p["sft"].key

    # Another sweep (more samples) that picks the same value: sft keeps its key, so it stays cached.
    cfg, p = plan("stages.tune.num_samples=8")
    assert p["tune"].status == "miss" and p["sft"].pending
    _finish_sweep(cfg, {"lr": 0.005})
    cfg, p = plan("stages.tune.num_samples=8")
    assert p["sft"].key == key
    # ...and one that picks another value changes it.
    cfg, p = plan("stages.tune.num_samples=8", "stages.tune.mode=max")
    _finish_sweep(cfg, {"lr": 0.001})
    _, p = plan("stages.tune.num_samples=8", "stages.tune.mode=max")
    assert p["sft"].key != key and p["sft"].config.lr == 0.001


def test_without_use_tuned_the_sweep_does_not_touch_the_target(tmp_path):
    plain = {p.spec.name: p for p in build_plan(smoke_config(tmp_path))}
    swept = {p.spec.name: p for p in build_plan(smoke_config(tmp_path, *SWEEP))}
    assert "tune" not in plain and "tune" in swept
    assert swept["sft"].key == plain["sft"].key
    # Turning use_tuned on does not change the sweep's own key (no needless rerun of the sweep).
    tuned = {p.spec.name: p for p in build_plan(smoke_config(tmp_path, *SWEEP, "stages.sft.use_tuned=true"))}
    assert tuned["tune"].key == swept["tune"].key


TOY_TUNE = '''
import json
def run(cfg, ctx):
    with open(ctx.pipeline.run_dir / "executions.log", "a") as f:
        f.write("tune\\n")
    (ctx.out_dir / "best_config.json").write_text(json.dumps({"params": {"lr": 0.007}}))
    return {"best_config": ctx.out_dir / "best_config.json"}
'''
TOY_TARGET = '''
def run(cfg, ctx):
    with open(ctx.pipeline.run_dir / "executions.log", "a") as f:
        f.write("target\\n")
    (ctx.out_dir / "lr.txt").write_text(str(cfg.lr))
    return {"target_out": ctx.out_dir / "lr.txt"}
'''


@pytest.fixture
def toy_sweep(tmp_path, monkeypatch):
    """A registry of a toy sweep (its module's source given) and a toy use_tuned target; their modules
    are forgotten afterwards."""
    import sys

    from pipeline.registry import StageSpec

    code = tmp_path / "code"
    code.mkdir()
    made = []

    def registry(tune_source: str, tune_module: str = "toy_tune"):
        for name, source in ((tune_module, tune_source), ("toy_target", TOY_TARGET)):
            (code / f"{name}.py").write_text(source)
            made.append(name)
        monkeypatch.syspath_prepend(str(code))
        return (StageSpec("tune", tune_module, "stages.data", (), (), ("best_config",), "sweep"),
                StageSpec("toy_target", "toy_target", "stages.sft", (), ("best_config",), ("target_out",), "target"))

    yield registry
    for name in made:
        sys.modules.pop(name, None)


def test_a_sweep_and_its_use_tuned_target_in_one_run(tmp_path, monkeypatch, tracking_uri, toy_sweep):
    """The target's key is unknown until the sweep has run: the runner plans it again, then runs it
    with the sweep's value; a second run finds both cached."""
    from rich.console import Console

    from conftest import SMOKE
    from pipeline.runner import run_pipeline

    registry = toy_sweep(TOY_TUNE)
    cfg = smoke_config(tmp_path / "run", f"mlflow.tracking_uri={tracking_uri}")
    from collections import Counter

    from pipeline import plan as plan_mod

    keyed, components = Counter(), plan_mod.components

    def counted_components(cfg, spec, *args, **kwargs):
        keyed[spec.name] += 1
        return components(cfg, spec, *args, **kwargs)

    monkeypatch.setattr(plan_mod, "components", counted_components)
    first = run_pipeline(cfg, SMOKE, Console(quiet=True), registry=registry)
    # Planned pending (no components), keyed once when reached, its input (the sweep's values) known then.
    assert keyed == {"tune": 1, "toy_target": 1}, keyed
    keyed.clear()
    second = run_pipeline(cfg, SMOKE, Console(quiet=True), registry=registry)
    assert keyed == {"tune": 1, "toy_target": 1}, keyed
    out = storage.output_paths(first["stages"]["toy_target"], storage.artifact_dir(
        cfg.run_dir, "toy_target", first["stages"]["toy_target"]["key"]))["target_out"]
    assert out.read_text() == "0.007"  # smoke.yaml's sft lr is 0.003
    assert (cfg.run_dir / "executions.log").read_text().split() == ["tune", "target"]  # nothing ran twice
    assert {p.spec.name: p.status for p in second["plan"]} == {"tune": "hit", "toy_target": "hit"}
    assert second["stages"]["toy_target"]["key"] == first["stages"]["toy_target"]["key"]


TOY_TUNE_FROM_FILE = '''
import json
def run(cfg, ctx):
    lr = float((ctx.pipeline.run_dir / "NEXT_LR").read_text())  # what this sweep "finds"
    (ctx.out_dir / "best_config.json").write_text(json.dumps({"params": {"lr": lr}}))
    return {"best_config": ctx.out_dir / "best_config.json"}
'''


def test_a_forced_sweep_that_finds_new_values_reruns_its_target_in_the_same_run(tmp_path, tracking_uri, toy_sweep):
    """Planned, the target is a hit on the sweep's old values; the sweep reruns (--force tune) and finds
    another value, so the runner keys the target again when it reaches it and trains on the new value."""
    from rich.console import Console

    from conftest import SMOKE
    from pipeline.runner import run_pipeline

    registry = toy_sweep(TOY_TUNE_FROM_FILE, "toy_tune_file")
    cfg = smoke_config(tmp_path / "run", f"mlflow.tracking_uri={tracking_uri}")
    cfg.run_dir.mkdir(parents=True)

    def lr_used(summary) -> str:
        m = summary["stages"]["toy_target"]
        return storage.output_paths(
            m, storage.artifact_dir(cfg.run_dir, "toy_target", m["key"]))["target_out"].read_text()

    (cfg.run_dir / "NEXT_LR").write_text("0.007")
    assert lr_used(run_pipeline(cfg, SMOKE, Console(quiet=True), registry=registry)) == "0.007"
    (cfg.run_dir / "NEXT_LR").write_text("0.005")
    again = run_pipeline(cfg, SMOKE, Console(quiet=True), registry=registry, force=["tune"])
    assert {p.spec.name: p.status for p in again["plan"]} == {"tune": "miss", "toy_target": "miss"}
    assert lr_used(again) == "0.005"
