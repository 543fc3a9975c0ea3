"""The pipeline on a real two-node Ray cluster (`ray start --head` + `ray start --address`):
a submitted Ray Job whose SFT workers land on both nodes and survive the loss of one worker, a
driver killed mid-stage whose rerun resumes, and job control (status, logs, stop, exit codes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, SMOKE
from helpers.cluster import TwoNodeCluster, end_tree, free_port, wait_for
from helpers.mlflow_server import mlflow_server
from helpers.s3 import CREDENTIALS, S3Server

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 5, "ray": 2, "train_groups": 3}

pytestmark = [pytest.mark.slow, pytest.mark.tier("faults", covers=(
    "pipeline/cluster.py", "pipeline/jobs.py", "pipeline/run_storage.py", "pipeline/bucket.py",
    "pipeline/tracking.py", "stages/common/training.py", "stages/common/train_loop.py", "stages/sft.py",
    "pipeline/upstream/", "pipeline/files.py"))]

# Short SFT with frequent checkpoints, workers on different nodes.
SFT = ["--to", "sft", "stages.sft.placement_strategy=STRICT_SPREAD", "stages.sft.checkpoint_every=3"]


@pytest.fixture(scope="module")
def cluster():
    # The nodes hold credentials for the test's S3 server, as real nodes hold theirs (an instance role).
    with TwoNodeCluster(extra_env=CREDENTIALS) as c:
        yield c


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    """The override every run on the cluster needs: a tracking server, as workers on both nodes log."""
    with mlflow_server(tmp_path_factory.mktemp("tracking"), free_port()) as url:
        yield f"mlflow.tracking_uri={url}"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    # Not seeded with the session's model and data (conftest.smoke_upstream): tried for issue 33, the
    # submitted job then ran SFT alone and failed as SFT ended, its driver's working directory (the
    # job's runtime_env working_dir) gone: os.getcwd() raised FileNotFoundError. Seen once, not yet explained.
    return tmp_path_factory.mktemp("cluster") / "run"


def _cli(cluster, *args, timeout=900):
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, env=cluster.env, capture_output=True,
                          text=True, timeout=timeout)


def test_validate_refuses_a_local_tracking_file_for_a_multi_node_cluster(cluster, tracking):
    local = _cli(cluster, "validate", str(SMOKE), f"ray.address={cluster.gcs}", timeout=120)
    assert local.returncode == 2 and "the Ray cluster has 2 nodes" in local.stderr, local.stderr[-2000:]
    assert "set mlflow.tracking_uri: http://HOST:5000" in local.stderr
    served = _cli(cluster, "validate", str(SMOKE), f"ray.address={cluster.gcs}", tracking, timeout=120)
    assert served.returncode == 0, served.stderr[-2000:]


def _registered(run_dir, skip=()) -> list:
    """SFT runs (by cache key) with a checkpoint Ray Train has registered (in its snapshot), not just written."""
    found = []
    for snapshot in (run_dir / "checkpoints" / "sft").glob("*/train/checkpoint_manager_snapshot.json"):
        key = snapshot.parent.parent.name
        try:
            if key not in skip and json.loads(snapshot.read_text()).get("checkpoint_results"):
                found.append(key)
        except ValueError:  # being written
            pass
    return found


def _resumed_at(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"resuming at step (\d+)", log)]


def test_submitted_job_spreads_sft_over_both_nodes_and_survives_a_killed_worker(cluster, run_dir, tracking):
    nodes = cluster.nodes()
    assert len(nodes) == 2 and sum(n["head"] for n in nodes) == 1

    submitted = _cli(cluster, "submit", str(SMOKE), "--address", cluster.dashboard, f"run_dir={run_dir}",
                     tracking, *SFT)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job_id = submitted.stdout.strip().splitlines()[-1]
    assert job_id.startswith("pipeline-smoke-")

    # Once SFT has written its first checkpoint, kill one of its workers (a process of our cluster).
    wait_for(lambda: _registered(run_dir), 600, "the first registered SFT checkpoint", poll_s=0.25)
    workers = wait_for(lambda: cluster.actors("RayTrainWorker", "ALIVE"), 60, "live SFT workers")
    os.kill(workers[0]["pid"], signal.SIGKILL)

    follow = _cli(cluster, "logs", job_id, "--address", cluster.dashboard, "--follow")
    assert follow.returncode == 0
    status = _cli(cluster, "status", job_id, "--address", cluster.dashboard)
    assert f"{job_id}: SUCCEEDED" in status.stdout, follow.stdout[-4000:]
    assert "[3/3] sft done" in follow.stdout
    assert "run_dir is readable and writable from all 2 nodes" in follow.stdout
    assert any(step >= 3 for step in _resumed_at(follow.stdout)), follow.stdout[-4000:]  # restarted from a checkpoint
    ran_on = {a["node"] for a in cluster.actors("RayTrainWorker")}
    assert ran_on == {n["id"] for n in nodes}  # training workers ran on both nodes
    assert len(list((run_dir / "artifacts" / "sft").glob("*/manifest.json"))) == 1
    print(f"nodes {sorted(n['id'][:12] for n in nodes)}; SFT workers ran on {sorted(n[:12] for n in ran_on)}")


def _registered_in(store, skip=()) -> list:
    """As `_registered`, for checkpoints Ray Train keeps in the object store."""
    found = []
    for name in store.files("checkpoints/sft"):
        key, _, rest = name.partition("/")
        if rest == "train/checkpoint_manager_snapshot.json" and key not in skip:
            try:
                if json.loads(store.read_bytes(f"checkpoints/sft/{name}") or b"{}").get("checkpoint_results"):
                    found.append(key)
            except ValueError:  # being written
                pass
    return found


def test_a_killed_driver_resumes_from_the_object_store_with_finished_stages_cached(cluster, run_dir, tracking):
    """The driver joins the cluster with `storage.uri` on a local S3 server: every node must reach the
    bucket, SFT checkpoints go there, and after the driver is killed the rerun resumes from them."""
    with S3Server() as s3:
        store = s3.store("cluster")
        args = ["run", str(SMOKE), f"run_dir={run_dir}", tracking, *SFT,
                "stages.sft.lr=0.002",  # a new SFT key, same upstream
                f"storage.uri={store.uri}", f"storage.endpoint_url={s3.endpoint}"]
        env = {**cluster.env, "RAY_ADDRESS": cluster.gcs}  # this machine's driver joins the cluster
        before = set(_registered(run_dir))
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(lambda: _registered_in(store) or proc.poll() is not None, 600, "a registered SFT checkpoint",
                     poll_s=0.5)
            assert proc.poll() is None, "the run ended before it could be killed"
            os.kill(proc.pid, signal.SIGKILL)  # the driver dies without any chance to clean up
            proc.wait(timeout=30)
        finally:
            end_tree(proc.pid)
        for manifest in run_dir.glob("artifacts/*/*/manifest.json"):
            json.loads(manifest.read_text())  # every finished artifact is intact
        assert not _registered(run_dir, before), "Ray Train checkpointed into run_dir, not the bucket"

        rerun = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=900)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert f"{store.uri} is readable and writable from all 2 nodes" in rerun.stdout
        assert "model hit" in rerun.stdout and "data hit" in rerun.stdout
        assert "sft miss - last attempt did not finish" in rerun.stdout
        assert any(step >= 3 for step in _resumed_at(rerun.stdout + rerun.stderr)), rerun.stdout[-4000:]
        assert len(list((run_dir / "artifacts" / "sft").glob("*/manifest.json"))) == 2
        for name in ("model", "data", "sft"):  # all finished artifacts are in the bucket too
            assert any(n.endswith("/manifest.json") for n in store.files(f"artifacts/{name}")), name


def test_job_control_stop_and_exit_codes(cluster, tmp_path, tracking):
    # A job that fails on the cluster: --wait exits with the driver's own code (2, a user error).
    failing = _cli(cluster, "submit", str(SMOKE), "--address", cluster.dashboard, "--wait",
                   f"run_dir={tmp_path / 'empty'}", tracking, "--only", "sft")
    assert failing.returncode == 2, failing.stderr[-2000:]
    assert "needs the output of stage" in failing.stdout

    # A running job stopped from the CLI ends STOPPED, and --wait on such a job would exit 130.
    submitted = _cli(cluster, "submit", str(SMOKE), "--address", cluster.dashboard, f"run_dir={tmp_path / 'run'}",
                     tracking, "--to", "data")
    job_id = submitted.stdout.strip().splitlines()[-1]
    wait_for(lambda: "RUNNING" in _cli(cluster, "status", job_id, "--address", cluster.dashboard).stdout, 120,
             "the job to run")
    stopped = _cli(cluster, "stop", job_id, "--address", cluster.dashboard)
    assert stopped.returncode == 0 and f"{job_id}: STOPPED" in stopped.stdout
    unknown = _cli(cluster, "status", "pipeline-no-such-job", "--address", cluster.dashboard)
    assert unknown.returncode == 2 and "no job 'pipeline-no-such-job'" in unknown.stderr

