"""The `ui` command: MLflow's UI on a run's tracking store, opened on the run's experiment.

`run_ui` starts `mlflow ui` on a local store (bound to 127.0.0.1) until Ctrl-C, or says where to
browse a tracking server; `ui_url` is the address it prints (the model-training view with each
stage's headline metrics as columns); `_run_server` runs the server and stops its whole process group.
"""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.errors import check_port_free
from pipeline.reports import EXIT_FAILED
from pipeline.tracking import redact, require_run


def ui_url(cfg, port: int) -> str:
    """Where to open the UI: the run's experiment in MLflow's model-training view, its runs listed
    with each stage's headline metrics (a view shared through the experiment, written here).

    MLflow 3.17's UI opens every experiment in its GenAI view (traces, evaluations) unless the
    address says otherwise; the experiment's own kind tag is not what decides it."""
    from mlflow.tracking import MlflowClient

    from pipeline import outcomes
    from pipeline.registry import STAGES
    from pipeline.tracking import share_runs_view

    base = f"http://127.0.0.1:{port}"
    client = MlflowClient(cfg.tracking_uri)
    try:
        exp = client.get_experiment_by_name(cfg.mlflow.experiment)
    except Exception:  # noqa: BLE001 - an unreadable store: the server will say why
        exp = None
    if exp is None:
        return base
    url = f"{base}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
    # Whether post-training worked; the parent run's other outcomes (rows, sizes) are a click away.
    columns = [f"{s.name}.{m}" for s in STAGES if s.view for t in s.outcomes for m in outcomes.fields(t)]
    try:
        return f"{url}&viewStateShareKey={share_runs_view(client, exp.experiment_id, columns)}"
    except Exception:  # noqa: BLE001 - a read-only store: the default view
        return url


def _run_server(cmd: list[str], env: dict[str, str] | None = None, log=None) -> int | None:
    """Run a server command until Ctrl-C / SIGTERM stops it and every process it started (its own process
    group: `mlflow ui` runs its web server and workers as children, which outlived a SIGINT sent to this
    process alone): None; or until it ends by itself: its exit code. Its output goes to `log` (an open
    file) if given: a line per request is the server's business, not the console's."""
    import signal

    proc = subprocess.Popen(cmd, start_new_session=True, env=env, stdout=log, stderr=subprocess.STDOUT if log else None)

    def stop(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_ui(cfg, port: int, workers: int, console) -> int:
    """`python -m pipeline ui CONFIG`: the MLflow UI on the run's local tracking store until Ctrl-C
    (a tracking server has its own UI: its address is printed instead)."""
    if cfg.tracking_uri.startswith(("http://", "https://", "databricks")):
        console.print(f"this run tracks to a server: open {redact(cfg.tracking_uri)} in a browser")
        return 0
    require_run(cfg.tracking_uri, "ui")  # before MLflow, which would create an empty store and serve it
    check_port_free("127.0.0.1", port, "--port")  # before the address is printed
    # The store goes in the environment (MLflow's CLI reads MLFLOW_BACKEND_STORE_URI), not on the command
    # line, where `ps` would show a database store's password to every user of the machine.
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    # The server's own output (a line per request) goes to the run's logs, as a run's library output does.
    log_path = cfg.run_dir / "logs" / "ui.log" if cfg.run_dir.is_dir() else None
    console.print(f"MLflow UI for {redact(cfg.tracking_uri)} at {ui_url(cfg, port)} (Ctrl-C stops it)"
                  + (f"; its log: {log_path}" if log_path else ""), soft_wrap=True)
    # MLflow's job runner (10 task-queue processes, for GenAI scorers) has nothing to do here.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ, "MLFLOW_BACKEND_STORE_URI": cfg.tracking_uri}
    if log_path is None:
        code = _run_server(cmd, env)
    else:
        log_path.parent.mkdir(exist_ok=True)
        with open(log_path, "a") as log:
            code = _run_server(cmd, env, log)
    if code is None:  # Ctrl-C: the way a server run until Ctrl-C ends
        return 0
    # It stopped by itself (MLflow 3 exits 0 when uvicorn cannot bind): never a success.
    tail = log_path.read_text(errors="replace").splitlines()[-5:] if log_path else []
    console.print(f"[bold red]failed:[/] the MLflow UI server stopped by itself (exit {code}); "
                  + (f"the end of its log ({log_path}):" if log_path else "its output is above"), soft_wrap=True)
    for line in tail:
        console.print(f"  {line}", markup=False, soft_wrap=True)
    return EXIT_FAILED

