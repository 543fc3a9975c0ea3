"""One-worker training in the driver (stages/common/in_process.py; issue 60, item 3): a Train stage with
`num_workers: 1` runs its loop in the calling process through Ray Train's local mode, and trains as a
one-worker group does; its checkpoints resume a rerun and its retries recover in the stage; the driver is
left as it was. The checkpoint bookkeeping is checked on its own (fast)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, TRAINED
from test_sft_stage import history, run_sft, weights

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance"):
# four in-process sft runs and the one-worker group they are compared with; a reward stage run alone.
STARTS = {"pipelines": 6, "ray": 5, "train_groups": 1, "vllm_engines": 5}

ONE = ("stages.sft.num_workers=1",)


def test_checkpoints_are_committed_whole_named_latest_and_pruned(tmp_path, monkeypatch):
    from stages.common import in_process

    monkeypatch.setattr(in_process, "_active", {"dir": tmp_path, "keep": 2})
    assert in_process.latest() is None
    for step in (3, 6, 9):
        final = in_process.commit(lambda d, s=step: (d / "state").write_text(str(s)), step)
        assert final == tmp_path / f"checkpoint_{step:06d}" and in_process.latest() == final
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_000006", "checkpoint_000009", "latest.json"]

    def dies(d):
        (d / "state").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        in_process.commit(dies, 12)
    assert in_process.latest() == tmp_path / "checkpoint_000009"  # a half-written checkpoint is never the latest


def test_only_a_plain_one_worker_stage_trains_in_the_driver(monkeypatch):
    from stages.common.in_process import GROUP_ENV, wanted

    monkeypatch.delenv(GROUP_ENV, raising=False)
    assert wanted(1, [], None)
    assert not wanted(2, [], None)
    assert not wanted(1, ["a Tune trial's reporter"], None)  # its callbacks need Ray Train's controller
    assert not wanted(1, [], object())  # checkpoints in an object store
    monkeypatch.setenv(GROUP_ENV, "1")
    assert not wanted(1, [], None)


def test_the_driver_gets_back_its_random_states_threads_and_environment(monkeypatch):
    import random

    import torch

    from stages.common.in_process import _driver_kept

    monkeypatch.delenv("RANK", raising=False)
    torch.manual_seed(7)
    before = torch.get_rng_state(), torch.get_num_threads()
    state = random.getstate()
    with _driver_kept({"DS_ACCELERATOR": "cpu"}):
        assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"  # what DeepSpeed reads
        torch.manual_seed(0), random.seed(0), torch.set_num_threads(1)
        os.environ["PIPELINE_SET_BY_THE_LOOP"] = "1"
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == state
    assert torch.get_num_threads() == before[1]
    assert "RANK" not in os.environ and "PIPELINE_SET_BY_THE_LOOP" not in os.environ


@pytest.fixture(scope="module")
def one_worker(smoke_trained, tmp_path_factory, tracking_uri):
    """sft on one worker: in this process (a), as a one-worker Ray Train group (b), in this process
    interrupted after step 3 and rerun (c), and interrupted after step 3 with a retry left (d); with what
    the driver looked like before and after (a)."""
    import torch

    from ray.train.v2._internal.util import _in_ray_train_worker

    runs, driver = {}, {}
    threads = torch.get_num_threads()
    runs["a"] = run_sft(smoke_trained(tmp_path_factory.mktemp("a")), tracking_uri, *ONE)
    driver.update(threads=(threads, torch.get_num_threads()), group=torch.distributed.is_initialized(),
                  worker=_in_ray_train_worker(), rank=os.environ.get("RANK"))
    os.environ["PIPELINE_TRAIN_GROUP"] = "1"
    try:
        runs["b"] = run_sft(smoke_trained(tmp_path_factory.mktemp("b")), tracking_uri, *ONE)
    finally:
        del os.environ["PIPELINE_TRAIN_GROUP"]
    c = smoke_trained(tmp_path_factory.mktemp("c"))
    os.environ["PIPELINE_FAULT_AFTER_STEP"] = "3"
    try:
        with pytest.raises(Exception, match="injected fault after step 3"):
            run_sft(c, tracking_uri, *ONE, "stages.sft.max_failures=0")
        left = sorted(p.name for p in (c / "checkpoints").rglob("checkpoint_*"))
        runs["d"] = run_sft(smoke_trained(tmp_path_factory.mktemp("d")), tracking_uri, *ONE,
                            "stages.sft.max_failures=1")
    finally:
        del os.environ["PIPELINE_FAULT_AFTER_STEP"]
    runs["c"] = run_sft(c, tracking_uri, *ONE, "stages.sft.max_failures=0")
    return runs, driver, left


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/common/in_process.py", "stages/common/training.py",
                                 "stages/common/train_loop.py", "stages/sft.py", "pipeline/upstream/"))
def test_one_worker_in_the_driver_trains_as_a_one_worker_group_and_resumes(one_worker, tracking_uri):
    runs, driver, left = one_worker
    losses = {k: history(tracking_uri, run_id, "train_loss") for k, (_, run_id, _) in runs.items()}
    assert sorted(losses["a"]) == list(range(1, 13))
    # The same numbers as a one-worker Ray Train group: the same batches, seed and DeepSpeed engine
    for k in ("b", "d"):
        assert losses[k].keys() == losses["a"].keys()
        np.testing.assert_allclose([losses[k][s] for s in losses["a"]], list(losses["a"].values()), rtol=1e-6)
    # (c) failed after its step-3 checkpoint; the rerun went on from step 4 and ended on (a)'s weights
    assert left == ["checkpoint_000003"]
    assert min(losses["c"]) == 4
    # (d) failed after step 3 too and recovered inside the stage, from its checkpoint
    wa = weights(runs["a"][2])
    for k in ("b", "c", "d"):
        wk = weights(runs[k][2])
        assert wk.keys() == wa.keys()
        for name in wa:
            np.testing.assert_allclose(wk[name], wa[name], atol=1e-6)
    # The driver as it was: no process group, not a Ray Train worker, its threads and environment kept
    assert driver == {"threads": (driver["threads"][0],) * 2, "group": False, "worker": False, "rank": None}


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/common/train_loop.py", "stages/common/training.py", "stages/reward/",
                                 "pipeline/upstream/"))
def test_a_one_worker_stage_run_alone_trains_without_starting_ray(smoke_trained, tmp_path):
    """One worker reading its splits from their files needs no Ray at all: a reward stage run alone trains
    in the pipeline's process and never starts Ray (4-6 s of a stage's start-up on this machine kind)."""
    run_dir = smoke_trained(tmp_path / "run")
    out = subprocess.run([sys.executable, "-m", "pipeline", "run", "configs/smoke.yaml", "--only", "reward",
                          "--force", "reward", *TRAINED, "stages.reward.num_workers=1", "stages.reward.max_steps=2",
                          f"run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "in this process" in out.stdout and "Ray not started" in out.stdout, out.stdout[-3000:]
