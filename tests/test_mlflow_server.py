"""`pipeline ui`: the MLflow server it starts on a run's store, read back through the MLflow client.

A stage tracked on a remote `mlflow server` (over HTTP, behind basic auth) is checked in
tests/test_tracking_credentials.py."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from conftest import SMOKE, run_cli
from helpers.cluster import free_port
from helpers.mlflow_server import server_process

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 1}

pytestmark = [pytest.mark.slow, pytest.mark.tier("e2e", covers=("pipeline/ui.py", "pipeline/tracking.py"))]


def test_ui_command_serves_the_run_store_and_stops_everything_it_started(tmp_path):
    import psutil
    from mlflow.tracking import MlflowClient

    from pipeline.config import load_config

    run_dir = tmp_path / "run"
    assert run_cli("run", str(SMOKE), f"run_dir={run_dir}", "--only", "model").returncode == 0
    port = free_port()
    with server_process([sys.executable, "-m", "pipeline", "ui", str(SMOKE), f"run_dir={run_dir}", "--port",
                         str(port)], port) as (url, proc):
        exp = MlflowClient(url).get_experiment_by_name("posttrain")
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on the runs table
        runs = MlflowClient(url).search_runs([exp.experiment_id])
        parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
        assert {r.info.run_name for r in runs} == {parent.info.run_name, "model"}
        assert parent.info.run_name.startswith("smoke-") and parent.data.metrics["model.num_parameters"] > 1000
        assert parent.data.tags["mlflow.source.name"] == f"pipeline run {SMOKE}"
        assert load_config(SMOKE, [f"run_dir={run_dir}"]).tracking_uri.endswith(str(run_dir / "mlflow.db"))
        # The address printed opens this experiment's runs table (MLflow 3.17 opens its GenAI view otherwise).
        from pipeline.ui import ui_url

        address = ui_url(load_config(SMOKE, [f"run_dir={run_dir}"]), port)
        prefix = f"{url}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey="
        assert address.startswith(prefix)
        # ... in a view shared through the experiment: runs listed flat, with the headline metric columns
        view = json.loads(MlflowClient(url).get_experiment(exp.experiment_id).tags[
            "mlflow.sharedViewState." + address.removeprefix(prefix)])
        assert view["orderByKey"] == "attributes.end_time" and "metrics.`ppo.eval_accuracy`" in view["selectedColumns"]
        started = psutil.Process(proc.pid).children(recursive=True)
        # `mlflow ui` and one uvicorn worker: no GenAI job runner, no worker pool for one person
        assert [p.cmdline()[2] for p in started] == ["mlflow", "uvicorn"], [p.cmdline()[:4] for p in started]
        proc.send_signal(signal.SIGINT)  # to the command alone, as a terminal's Ctrl-C would not reach its group
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    # The server's own lines went to the run's logs, not the console (issue 59, item 6)
    assert f"127.0.0.1:{port}" in (run_dir / "logs" / "ui.log").read_text()

