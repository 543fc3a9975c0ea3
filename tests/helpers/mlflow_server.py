"""A real `mlflow server` (or any process answering /health) for tests, in its own process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def serving(cmd: list[str], port: int, timeout_s: float = 120):
    """Start `cmd`, wait for http://127.0.0.1:PORT/health, yield its URL; stop its whole group after."""
    with server_process(cmd, port, timeout_s) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, timeout_s: float = 120):
    """As `serving`, yielding (URL, the Popen) so a test can signal the command itself."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{cmd[:4]} did not start")
                time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:  # a test may have stopped it already
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers: our own process group
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def mlflow_server(store: Path, port: int):
    """`with mlflow_server(tmp_path, port) as url:` a tracking server whose store lives under `store`."""
    return serving([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                    "--backend-store-uri", f"sqlite:///{store / 'server.db'}",
                    "--artifacts-destination", str(store / "server-artifacts"), "--workers", "1"], port)
