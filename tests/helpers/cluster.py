"""A real multi-node Ray cluster on one machine, made with the commands users type:
`ray start --head` and `ray start --address=HEAD`, each node its own raylet with its own ports.

Every process the cluster starts descends from the two `ray start --block` processes, so teardown
ends exactly those process trees, by PID (never `ray stop`, which would hit other clusters). The
cluster uses token authentication with its own token, passed to every client through `env`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_trees(roots: list[int]) -> list[int]:
    """Each root and all its descendants (from one read of /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += children.get(pid, [])
    return out


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (from /proc), parents first."""
    return process_trees([root])


def end_trees(roots: list[int], grace_s: float = 10) -> None:
    """SIGTERM to every process of every tree at once, one shared grace period, then SIGKILL to what is left."""
    pids = process_trees(roots)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM:
            deadline = time.time() + grace_s
            while time.time() < deadline:
                pids = [p for p in pids if _alive(p)]
                if not pids:
                    return
                time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Still running: a zombie (ended, not yet reaped by its parent) counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def end_tree(root: int, grace_s: float = 10) -> None:
    end_trees([root], grace_s)


class TwoNodeCluster:
    """`with TwoNodeCluster() as c:` -> c.gcs ('127.0.0.1:PORT'), c.dashboard (URL), c.env (for clients)."""

    def __init__(self, cpus_per_node: int = 4, extra_env: dict | None = None):
        self.cpus = cpus_per_node
        self.tmp = Path(tempfile.mkdtemp(prefix="r2n-", dir="/tmp"))  # short: Ray's socket paths have a length limit
        self.env = {**os.environ, **(extra_env or {}), "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.env.pop("RAY_ADDRESS", None)
        self.procs: list[subprocess.Popen] = []
        self.gcs = self.dashboard = ""

    def _node_ports(self, first: int) -> list[str]:
        return ["--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}", "--disable-usage-stats", "--block",
                f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                f"--min-worker-port={first}", f"--max-worker-port={first + 999}"]

    def _start(self, args: list[str], log: str) -> None:
        from pipeline.events import record_start

        record_start("ray", detail=f"ray start ({log})")  # each node counts: each is a Ray start (helpers/starts.py)
        out = open(self.tmp / log, "w")
        self.procs.append(subprocess.Popen([str(VENV_BIN / "ray"), "start", *args], env=self.env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def nodes(self) -> list[dict]:
        """Alive nodes as the cluster's state API reports them."""
        code = ("import json; from ray.util.state import list_nodes; print(json.dumps([{'id': n.node_id, "
                f"'head': n.is_head_node}} for n in list_nodes(address={self.dashboard!r}) if n.state == 'ALIVE']))")
        out = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []

    def actors(self, class_name: str, state: str | None = None) -> list[dict]:
        filters = [("class_name", "=", class_name)] + ([("state", "=", state)] if state else [])
        code = ("import json; from ray.util.state import list_actors; print(json.dumps([{'node': a.node_id, "
                f"'pid': a.pid, 'state': a.state, 'job': a.job_id}} for a in list_actors(address={self.dashboard!r}, "
                f"filters={filters!r}, detail=True, limit=10000)]))")
        out = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def __enter__(self) -> "TwoNodeCluster":
        port, dash = free_port(), free_port()
        self.gcs, self.dashboard = f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}"
        try:
            self._start(["--head", f"--port={port}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
                         f"--ray-client-server-port={free_port()}", f"--temp-dir={self.tmp}",
                         *self._node_ports(30000)], "head.log")
            self._wait(1)
            self._start([f"--address={self.gcs}", *self._node_ports(31000)], "worker.log")
            self._wait(2)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait(self, n: int, timeout_s: float = 180) -> None:
        """Until the state API lists n alive nodes. It is asked (a Python process each time) once the
        newest node's `ray start` says it started, and every 10 s regardless, not every 2 s from the start."""
        log = self.tmp / ("head.log" if n == 1 else "worker.log")
        deadline = time.time() + timeout_s
        ask_at = time.time() + 10
        while time.time() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            if time.time() >= ask_at or (log.exists() and "Ray runtime started" in log.read_text(errors="replace")):
                if len(self.nodes()) >= n:
                    return
                ask_at = time.time() + 10
            time.sleep(0.25)
        logs = "\n".join((self.tmp / f).read_text()[-2000:] for f in ("head.log", "worker.log")
                         if (self.tmp / f).exists())
        raise RuntimeError(f"the {n}-node cluster did not come up:\n{logs}")

    def __exit__(self, *exc) -> None:
        import shutil

        end_trees([proc.pid for proc in self.procs])  # both nodes at once, one grace period
        for proc in self.procs:
            proc.wait(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 1.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
