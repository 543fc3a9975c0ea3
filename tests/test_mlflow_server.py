"""Tracking against a real `mlflow server` process over HTTP, read back through the MLflow client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ROOT, SMOKE, run_cli

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cmd: list[str], port: int):
    """Start a server in its own process group, wait for /health, yield its URL, stop the group."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("mlflow server did not start")
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers: our own process group
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    yield from _serve([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                       "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                       "--artifacts-destination", str(tmp_path / "server-artifacts"), "--workers", "1"], port)


def test_ui_command_serves_the_run_store_on_loopback(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.config import load_config

    run_dir = tmp_path / "run"
    assert run_cli("run", str(SMOKE), f"run_dir={run_dir}", "--only", "model").returncode == 0
    port = _free_port()
    server = _serve([sys.executable, "-m", "pipeline", "ui", str(SMOKE), f"run_dir={run_dir}", "--port", str(port)], port)
    url = next(server)
    try:
        runs = MlflowClient(url).search_runs([MlflowClient(url).get_experiment_by_name("posttrain").experiment_id])
        assert {r.info.run_name for r in runs} == {"smoke", "model"}
        assert load_config(SMOKE, [f"run_dir={run_dir}"]).tracking_uri.endswith(str(run_dir / "mlflow.db"))
    finally:
        server.close()


def test_stage_tracked_on_a_tracking_server(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    result = run_cli("run", str(SMOKE), f"run_dir={tmp_path / 'run'}", "--only", "model",
                     f"mlflow.tracking_uri={mlflow_server}", "mlflow.experiment=server-test")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "run" / "mlflow.db").exists()  # nothing went to the local default store

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("server-test")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    stage = next(r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
    assert stage.info.run_name == "model" and stage.info.status == "FINISHED"
    assert stage.data.tags["cache"] == "miss" and len(stage.data.tags["cache_key"]) == 16
    assert stage.data.params["model.builtin.hidden_size"] == "64"
    assert stage.data.metrics["num_parameters"] > 1000
    manifest = client.download_artifacts(stage.info.run_id, "manifest.json", str(tmp_path))
    assert '"stage": "model"' in open(manifest).read()
