"""The tune stage: a real Ray Tune sweep (ASHA) over the SFT learning rate, then sft with `use_tuned`."""

from __future__ import annotations

import csv
import json

import pytest
from rich.console import Console

from conftest import SMOKE, smoke_config
from pipeline import storage
from pipeline.runner import run_pipeline

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 2, "train_groups": 4}

pytestmark = [pytest.mark.slow, pytest.mark.tier("e2e", covers=(
    "stages/tune/", "stages/sft.py", "stages/common/train_loop.py", "stages/common/training.py", "pipeline/upstream/"))]
# The bad learning rate comes last and starts only when a slot frees up: ASHA keeps whichever trial
# reaches a rung first, so the worst one is stopped reliably once better trials have recorded theirs.
# Three trials, two at a time: a trial is CPU-bound start-up on 2 cores, so more only cost time.
GRID = [1e-2, 1e-3, 1e-6]
SWEEP = ["stages.tune.target=sft", f"stages.tune.search_space.lr.grid={GRID}", "stages.tune.num_samples=1",
         "stages.tune.metric=eval_loss", "stages.tune.mode=min", "stages.tune.scheduler.type=asha",
         "stages.tune.scheduler.grace_period=4", "stages.tune.scheduler.reduction_factor=2",
         "stages.tune.max_concurrent_trials=2", "stages.sft.num_workers=1", "stages.sft.accuracy_prompts=4"]


@pytest.fixture(scope="module")
def sweep(smoke_upstream, tmp_path_factory, tracking_uri):
    """The sweep run to the tune stage, then sft with the tuned value: (config, first summary, second summary).

    With an object store (a local S3 server): Tune's experiment state and the trials' Ray Train
    checkpoints go to the bucket, which is how a sweep runs on a cluster without a shared run_dir."""
    from helpers.s3 import S3Server

    run_dir = smoke_upstream(tmp_path_factory.mktemp("tune"))
    with S3Server() as s3:
        store = (f"storage.uri=s3://{s3.bucket}/tune", f"storage.endpoint_url={s3.endpoint}")
        cfg = smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", *SWEEP, *store)
        first = run_pipeline(cfg, SMOKE, Console(quiet=True), to="tune")
        in_bucket = s3.store("tune").files(f"checkpoints/tune/{first['stages']['tune']['key']}")
        tuned = smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", *SWEEP, *store,
                             "stages.sft.use_tuned=true")
        second = run_pipeline(tuned, SMOKE, Console(quiet=True), to="sft")
    assert any(name.startswith("tune/sweep/") for name in in_bucket), sorted(in_bucket)[:20]
    assert not (run_dir / "checkpoints" / "tune" / first["stages"]["tune"]["key"] / "tune").exists()
    return cfg, first, second


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _trial_runs(uri, tune_run_id):
    client = _client(uri)
    exp = client.get_run(tune_run_id).info.experiment_id
    return client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{tune_run_id}'")


def _last(uri, run_id, key):
    history = sorted(_client(uri).get_metric_history(run_id, key), key=lambda m: m.step)
    return history[-1] if history else None


def test_every_trial_is_a_child_run_and_asha_stops_poor_ones(sweep, tracking_uri):
    _, first, _ = sweep
    runs = _trial_runs(tracking_uri, first["run_ids"]["tune"])
    assert sorted(float(r.data.params["lr"]) for r in runs) == sorted(GRID)
    statuses = {r.info.run_id: r.data.tags["trial_status"] for r in runs}
    assert set(statuses.values()) <= {"completed", "stopped_early"}
    assert "stopped_early" in statuses.values() and "completed" in statuses.values()
    for r in runs:
        last = _last(tracking_uri, r.info.run_id, "eval_loss")
        assert last is not None  # every trial evaluated at least at step 0 and its first rung
        if statuses[r.info.run_id] == "stopped_early":
            assert r.info.status == "KILLED" and last.step < 12
        else:
            assert r.info.status == "FINISHED" and last.step == 12
    # The stopped trials include the one that barely learns.
    worst = next(r for r in runs if float(r.data.params["lr"]) == min(GRID))
    assert statuses[worst.info.run_id] == "stopped_early"


def test_the_best_trial_is_the_one_with_the_best_reported_metric(sweep, tracking_uri):
    cfg, first, _ = sweep
    runs = _trial_runs(tracking_uri, first["run_ids"]["tune"])
    final = {r.info.run_id: _last(tracking_uri, r.info.run_id, "eval_loss").value for r in runs}
    best_run = min(final, key=final.get)
    tagged = [r.info.run_id for r in runs if r.data.tags.get("best_trial") == "true"]
    assert tagged == [best_run]
    manifest = first["stages"]["tune"]
    out = storage.artifact_dir(cfg.run_dir, "tune", manifest["key"])
    best = json.loads((out / "best_config.json").read_text())
    assert best["mlflow_run_id"] == best_run
    assert best["value"] == pytest.approx(final[best_run])
    assert best["params"]["lr"] == float(next(r for r in runs if r.info.run_id == best_run).data.params["lr"])
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(GRID) and {r["mlflow_run_id"] for r in rows} == set(final)
    assert manifest["metrics"]["trials_stopped_early"] >= 1


def test_use_tuned_trains_sft_with_the_best_value_and_the_sweep_is_cached(sweep, tracking_uri):
    cfg, first, second = sweep
    plan = {p.spec.name: p for p in second["plan"]}
    assert plan["tune"].status == "hit"  # unchanged sweep: not rerun (use_tuned does not change its key)
    best = json.loads((storage.artifact_dir(cfg.run_dir, "tune", first["stages"]["tune"]["key"])
                       / "best_config.json").read_text())["params"]["lr"]
    run = _client(tracking_uri).get_run(second["run_ids"]["sft"])
    assert float(run.data.params["stages.sft.lr"]) == best != 3e-3  # smoke.yaml's own lr is 3e-3
    peak = max(m.value for m in _client(tracking_uri).get_metric_history(run.info.run_id, "lr"))
    assert 0.9 * best < peak <= best  # the optimizer really ran with it (logged after each step's decay)
