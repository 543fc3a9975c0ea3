"""A run ends every process it started (issue 48, item 8): after the command returns, no process of
its Ray session (daemons, workers, engines) is running, when it succeeded, when a Ray worker's exit
blocks, and when it was interrupted with Ctrl-C during a training stage.

The processes are the command's descendants recorded while it ran (helpers/procs.py), by PID and
start time: an orphaned Ray worker is reparented to init, so it is no descendant any more by the time
the command returns."""

from __future__ import annotations

import os
import re
import sys

import pytest

from conftest import ROOT, SMOKE
from helpers.procs import watched

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 4, "ray": 4, "train_groups": 3}

pytestmark = pytest.mark.slow

ENV = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, not the session's


def _run(*args: str, env: dict | None = None, interrupt_on: str | None = None, timeout: float = 600):
    return watched([sys.executable, "-m", "pipeline", "run", str(SMOKE), *args], ROOT, {**ENV, **(env or {})},
                   timeout, interrupt_on=interrupt_on)


def test_the_shared_cli_run_left_no_process_running(smoke_cli):
    """The whole smoke pipeline (Ray Train, vLLM engines, Serve), as the command line ran it."""
    _, result = smoke_cli
    assert len(result.started) > 10, result.started  # Ray's daemons and workers were seen
    assert result.left_running == {}


@pytest.mark.tier("faults", covers=("pipeline/cluster.py", "stages/common/training.py", "pipeline/upstream/"))
def test_a_worker_whose_exit_blocks_is_ended_with_the_run(tmp_path):
    """The orphan of issue 48: an actor told to exit (as Ray Train's controller is when its handle goes, or
    on abort) whose exit then blocks. Its raylet no longer kills it and it no longer watches its raylet, so
    after `ray.shutdown()` it ran on under init; `cluster.shutdown_ray` now ends it, and says so."""
    run = _run(f"run_dir={tmp_path / 'run'}", "--to", "model", env={"PIPELINE_FAULT_STRAY_WORKER": "model"})
    try:
        assert run.returncode == 0, run.output[-3000:]
        assert "of this run's Ray session" in run.output and "ray::StrayWorker" in run.output, run.output[-3000:]
        assert len(run.seen) > 5  # Ray's daemons and workers were seen
        assert run.left_running() == {}
    finally:
        run.end_left_running()


@pytest.mark.tier("faults", covers=(
    "pipeline/__main__.py", "pipeline/runner.py", "pipeline/cluster.py", "stages/common/training.py",
    "pipeline/files.py", "pipeline/upstream/"))
def test_ctrl_c_during_sft_exits_130_and_ends_every_process(smoke_upstream, tmp_path):
    """Ctrl-C while Ray Train trains: Ray Train's own SIGINT handler used to abort the controller, which the
    driver saw as SystemExit(1) from ray.get (exit 1); now the run is interrupted as any other stage is."""
    run_dir = smoke_upstream(tmp_path / "run")
    # 400 steps (smoke's one epoch is 20, ~10 s: a Ctrl-C the watcher sent late under a loaded suite could land
    # after training, when the stage had finished, and the run exited 0; 2026-11-29's full suite)
    run = _run(f"run_dir={run_dir}", "--to", "sft", "stages.sft.epochs=30", "stages.sft.max_steps=400",
               interrupt_on="sft: step 0/")
    try:
        assert run.returncode == 130, run.output[-3000:]
        assert "interrupted: the running stage wrote no manifest" in run.output
        assert not list((run_dir / "artifacts" / "sft").glob("*/manifest.json"))
        assert any("TrainController" in name for _, name in run.seen.values()), run.seen  # it got that far
        assert run.left_running() == {}
    finally:
        run.end_left_running()


@pytest.mark.tier("faults", covers=("pipeline/cluster.py", "pipeline/own_cluster.py", "stages/common/training.py",
                                    "pipeline/upstream/"))
def test_two_runs_side_by_side_each_address_and_end_only_their_own_ray(smoke_upstream, tmp_path):
    """Issue 59, item 1: two runs at once on one machine (a cron job beside a manual run). Ray Train's
    PlacementGroupCleaner used to find both runs' Rays and print `Found multiple active Ray instances` as a
    traceback on the console; each run now addresses its own cluster, and ends only its own processes. Both
    train sft at the same time (model and data are cache hits): the cleaner asks every second. Each keeps a
    one-worker group (`PIPELINE_TRAIN_GROUP=1`): in the driver, a one-worker sft starts neither the cleaner
    nor, its splits read from their files, any Ray at all."""
    from concurrent.futures import ThreadPoolExecutor

    dirs = {name: smoke_upstream(tmp_path / name) for name in ("a", "b")}
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda name: _run(f"run_dir={dirs[name]}", "--to", "sft", "stages.sft.max_steps=4",
                                               "stages.sft.num_workers=1", "stages.sft.accuracy_prompts=0",
                                               env={"PIPELINE_TRAIN_GROUP": "1"}),
                             ("a", "b")))
    try:
        addresses = []
        for run in runs:
            assert run.returncode == 0, run.output[-3000:]
            found = re.search(r"started this run's own Ray at (\S+)", run.output)
            assert found, run.output[-3000:]
            addresses.append(found.group(1))
        assert addresses[0] != addresses[1]
        for run, (name, other) in zip(runs, (("a", addresses[1]), ("b", addresses[0]))):
            logs = "".join(p.read_text(errors="replace") for p in (dirs[name] / "logs").rglob("*.log"))
            for text in (run.output, logs):
                assert "Traceback" not in text and "multiple active Ray" not in text, text[-3000:]
                assert other not in text
            assert run.left_running() == {}
    finally:
        for run in runs:
            run.end_left_running()
