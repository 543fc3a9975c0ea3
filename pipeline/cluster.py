"""Ray connection: start a local instance for the run, or join a cluster.

Only stages that need Ray call `ensure_ray` (through `ctx.ray()`), so a fully cached rerun never
starts it. A local instance oversubscribes logical CPUs on purpose (docs/architecture.md, fact 6): rollout
engines, trainer workers and Serve replicas each reserve a CPU, and on a 2-core machine an exact
count would leave work waiting forever. On a cluster, Ray's own resources are used as they are.

Joining a cluster (`ray.address` or RAY_ADDRESS) ships the project's code to every node as the
job's runtime environment (`working_dir`), unless this process already is a submitted Ray Job's
driver (`python -m pipeline submit`), whose runtime environment carries it. On a cluster of more
than one node, the run directory must be shared: every node writes checkpoints into it and reads
its inputs from it, so `check_shared_storage` asks each node to read a file the driver wrote and
to write one back, and stops the run with a clear error before any work if one cannot. With an
object store (`storage.uri`, `pipeline.storage`) run_dir is each node's own working copy and
`check_bucket` asks each node to write and read the bucket instead.
"""

from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import events
from pipeline.console import capture_ray_logs
from pipeline.own_cluster import with_hook
from pipeline.tracking import cluster_store_problem, credentials_env

if TYPE_CHECKING:  # annotations only
    from pipeline.run_storage import RunStorage

# What the cluster's workers need of the project is its code, not the venv, runs or tests.
RUNTIME_EXCLUDES = [".venv", ".git", "runs", "tests", "bench", "**/__pycache__", "*.egg-info", "mlruns"]
JOB_DRIVER_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a submitted job's driver


def ensure_ray(ray_cfg, run_storage: RunStorage | None = None, log=lambda message: None,
               tracking_uri: str | None = None) -> bool:
    """Connect to Ray if not connected yet; True if this call started (and so must stop) it.

    With `run_storage`, a multi-node cluster is first checked to reach the run's bucket from every
    node (`check_bucket`) or, without one, to share its run_dir (`check_shared_storage`). With
    `tracking_uri`, a multi-node cluster must track to a server, not a local file
    (`tracking.cluster_store_problem`). The tracking server's credentials, in this process's
    environment since the config loaded, reach every worker: a local Ray's processes inherit the
    environment, a cluster's workers get them as the job's runtime_env (`job_runtime_env`)."""
    import ray

    if ray.is_initialized():
        return False
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        from pipeline.artifacts import PROJECT_ROOT

        _check_reachable(address)
        runtime_env = job_runtime_env(PROJECT_ROOT)
        try:
            ray.init(address=address, log_to_driver=True, runtime_env=with_hook(runtime_env))
            capture_ray_logs()  # workers' output: ours to the console, the rest to the stage's log file
        except (ConnectionError, RuntimeError, ValueError) as exc:
            from pipeline.errors import UserError

            raise UserError(f"ray.address: cannot connect to the Ray cluster at {address!r} ({exc}); start it with "
                            "`ray start --head`, fix ray.address / RAY_ADDRESS, or leave both empty for a local "
                            "Ray") from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        log(f"joined the Ray cluster at {address}: {len(nodes)} node(s), "
            f"{sum(n['Resources'].get('CPU', 0) for n in nodes):g} CPUs, "
            f"{sum(n['Resources'].get('GPU', 0) for n in nodes):g} GPUs")
        problem = tracking_uri and cluster_store_problem(tracking_uri, len(nodes))
        if problem:
            from pipeline.errors import UserError

            ray.shutdown()
            raise UserError(problem)
        if run_storage is not None:
            try:
                store = run_storage.store
                if store and check_bucket(store):
                    log(f"{store.uri} is readable and writable from all {len(nodes)} nodes (run_dir is each "
                        "node's working copy)")
                elif not store and check_shared_storage(run_storage.run_dir):
                    log(f"run_dir is readable and writable from all {len(nodes)} nodes")
            except BaseException:
                ray.shutdown()
                raise
    else:
        gib = ray_cfg.object_store_memory_gb
        started = init_local(ray_cfg.local_num_cpus(), int(gib * 2**30) if gib else None, ray_cfg.num_gpus)
        events.record_start("ray", detail="local")
        _record_local_session()
        capture_ray_logs()
        # Another run's Ray may hold the default dashboard port: say which one is this run's.
        log(f"started this run's own Ray at {ray.get_runtime_context().gcs_address} "
            f"(dashboard http://{started.dashboard_url})")
    return True


def init_local(num_cpus: int, object_store_memory: int | None = None, num_gpus: int | None = None):
    """Start a local Ray whose workers address it, not another run's Ray on the machine (own_cluster.py);
    `num_gpus` None: the GPUs Ray detects (`detected_gpus`)."""
    import ray

    # The dashboard process also serves Ray's state API, which Ray Train's controller polls.
    return ray.init(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_memory,
                    include_dashboard=True, runtime_env=with_hook(None))


@functools.cache
def detected_gpus() -> int:
    """The GPUs a local `ray.init()` finds on this machine, counted as Ray counts them: the devices
    CUDA_VISIBLE_DEVICES names when it is set, else the NVIDIA driver's GPUs (0 without a driver). Not torch's
    count (no CUDA context in the driver) and not Ray's own call (its accelerator manager, private, imports Ray,
    which `pipeline validate` and `plan` never do): the driver's list of its GPUs, /proc/driver/nvidia/gpus."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def job_runtime_env(project_root: Path) -> dict | None:
    """The runtime_env of a run joining a cluster: the project's code (unless this process is a
    submitted job's driver, whose runtime_env has it) and the MLflow tracking credentials
    (`tracking.credentials_env`), which workers on other nodes would not have otherwise; Ray merges
    env_vars into every task's and actor's own runtime_env.

    Ray keeps a job's runtime_env in its job table (`ray list jobs`, the dashboard) and its
    runtime-env agent logs it on each node: whoever can open the cluster's dashboard can run code on
    it anyway. A local Ray needs none of this: its workers inherit this process's environment."""
    env = credentials_env()
    if JOB_DRIVER_ENV in os.environ:  # Ray refuses an env var that the job's own runtime_env sets too
        import json

        job_env = (json.loads(os.environ[JOB_DRIVER_ENV]).get("runtime_env") or {}).get("env_vars") or {}
        env = {k: v for k, v in env.items() if k not in job_env}
        return {"env_vars": env} if env else None
    return {"working_dir": str(project_root), "excludes": RUNTIME_EXCLUDES, **({"env_vars": env} if env else {})}


def count_nodes(address: str) -> int:
    """Alive nodes of the cluster at `address`, asked as a short-lived driver (nothing is shipped)."""
    import ray

    _check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError) as exc:  # 'auto' with no cluster here, a refused handshake
        from pipeline.errors import UserError

        raise UserError(f"ray.address {address!r}: {str(exc).splitlines()[0]}") from None
    try:
        return sum(1 for n in ray.nodes() if n.get("Alive"))
    finally:
        ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 10) -> None:
    """Fail in seconds on a wrong address: `ray.init` itself retries an unreachable GCS for minutes."""
    import socket

    from pipeline.errors import UserError

    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"ray.address {address!r}: expected 'auto', 'HOST:PORT' or 'ray://HOST:PORT' "
                        "(RAY_ADDRESS takes the same forms)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UserError(f"ray.address: nothing answers at {address!r} ({exc.strerror or exc}); start the cluster "
                        "(`ray start --head`), fix ray.address / RAY_ADDRESS, or leave both empty for a local "
                        "Ray") from None


def shutdown_ray(log=lambda message: None) -> None:
    """Disconnect from Ray; for a local Ray this process started, also end every process of its session.

    `ray.shutdown()` stops the daemons it started (raylet, GCS, dashboard) but leaves the workers to
    notice their raylet's death and exit by themselves. A worker that had already been told to exit
    (an actor gone out of scope, `exit_actor`) has disconnected from its raylet: the raylet no longer
    kills it and it no longer watches the raylet, so if its exit blocks (a finalizer, a thread that
    never ends) it outlives the run, reparented to init (issue 48, item 8: a ray::TrainController of
    the sft stage, 430 MB, 1 h 45 min after `make run`). So the processes of this run's own session
    are listed before the shutdown (descendants of the daemons `ray.init` started, and processes whose
    environment names this session's raylet: RAY_RAYLET_PID, which Ray sets for every worker it
    spawns) and again after it; what is still alive after a short grace gets SIGTERM, then SIGKILL,
    by PID, and is named through `log`. A cluster this run joined (`ray.address`) is left alone."""
    import ray

    global _LOCAL_SESSION
    local, _LOCAL_SESSION = _LOCAL_SESSION, None
    before = session_processes(local) if local else {}
    if ray.is_initialized():
        ray.shutdown()
    if local:
        ended = end_processes({**before, **session_processes(local)})
        if ended:
            log(f"ended {len(ended)} process(es) of this run's Ray session (pid {local['raylet']}'s) that "
                f"outlived ray.shutdown: " + ", ".join(f"{name} (pid {pid})" for pid, name in ended))


# --------------------------------------------------------------------------- the run's own processes
# The local Ray this process started (`ensure_ray`): the PIDs of the daemons `ray.init` spawned, its
# raylet's PID (every worker's parent, in the worker's RAY_RAYLET_PID) and start time, its session dir.
_LOCAL_SESSION: dict | None = None


def _record_local_session() -> None:
    global _LOCAL_SESSION
    from pipeline.upstream.ray_private import global_node

    node = global_node()
    daemons = {kind: [info.process.pid for info in infos] for kind, infos in (node.all_processes or {}).items()}
    raylet = (daemons.get("raylet") or [None])[0]
    if raylet is None:  # connected to something ray.init did not start here: nothing of ours to end
        return
    _LOCAL_SESSION = {"daemons": [pid for pids in daemons.values() for pid in pids], "raylet": raylet,
                      "raylet_start": _proc_stat(raylet)[2], "session_dir": node.get_session_dir_path()}


def _proc_stat(pid: int) -> tuple[int, str, int] | tuple[None, None, None]:
    """(ppid, state, start time in clock ticks since boot) of a process, or Nones if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None, None, None


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")[:80] or "?"
    except OSError:
        return "?"


def session_processes(local: dict) -> dict[int, int]:
    """{pid: start time} of the live processes of a local Ray session this process started: the daemons
    and all their descendants (workers are the raylet's children, vLLM's engine processes theirs), and
    any process, wherever it was reparented, whose environment names the session's raylet (a worker
    that outlived its raylet). Nothing older than the raylet counts, nor this process itself."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    raylet_env = f"RAY_RAYLET_PID={local['raylet']}".encode()
    mine = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        ppid, state, start = _proc_stat(pid)
        if ppid is None or state == "Z":
            continue
        children.setdefault(ppid, []).append(pid)
        starts[pid] = start
        if local["raylet_start"] is not None and start >= local["raylet_start"]:
            try:
                if raylet_env in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    mine.add(pid)
            except OSError:  # another user's process, or gone
                pass
    found: set[int] = set()
    todo = [p for p in local["daemons"] if p in starts] + sorted(mine)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return {pid: starts[pid] for pid in found}


def end_processes(procs: dict[int, int], wait_s: float = 2.0, grace_s: float = 3.0) -> list[tuple[int, str]]:
    """End the processes {pid: start time} that do not exit by themselves within `wait_s`: SIGTERM,
    `grace_s` to exit, then SIGKILL. A PID whose start time changed is another process, left alone.
    Returns (pid, name) of each process that had to be signalled."""
    import signal
    import time

    def alive() -> dict[int, int]:
        out = {}
        for pid, start in procs.items():
            _, state, now = _proc_stat(pid)
            if now == start and state != "Z":
                out[pid] = start
        return out

    deadline = time.time() + wait_s
    while (procs := alive()) and time.time() < deadline:
        time.sleep(0.1)
    ended = [(pid, _name(pid)) for pid in sorted(procs)]
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in procs:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + wait
        while (procs := alive()) and time.time() < deadline:
            time.sleep(0.1)
        if not procs:
            break
    return ended


# --------------------------------------------------------------------------- shared storage


def probe_storage(path: str, token: str) -> dict:
    """On one node: can it read the driver's marker under `path`, and write next to it?"""
    import socket

    import ray

    node = ray.get_runtime_context().get_node_id()
    report = {"node_id": node, "host": socket.gethostname(), "ip": ray.util.get_node_ip_address(),
              "reads": False, "writes": False, "error": ""}
    marker = Path(path) / f".storage-check-{token}"
    try:
        report["reads"] = marker.read_text() == token
        mine = Path(path) / f".storage-check-{token}-{node[:12]}"
        mine.write_text(node)
        mine.unlink()
        report["writes"] = True
    except OSError as exc:
        report["error"] = f"{type(exc).__name__}: {exc.strerror or exc}"
    return report


def storage_problems(path: str, reports: list[dict]) -> list[str]:
    """One line per node that cannot use `path` (empty: every node can)."""
    lines = []
    for r in reports:
        if not r["reads"]:
            lines.append(f"node {r['node_id'][:12]} ({r['host']}, {r['ip']}) does not see {path} as the driver does"
                         + (f" ({r['error']})" if r["error"] else " (a different, local directory there)"))
        elif not r["writes"]:
            lines.append(f"node {r['node_id'][:12]} ({r['host']}, {r['ip']}) cannot write to {path} ({r['error']})")
    return lines


def _on_every_node(fn, *args, timeout_s: float) -> list:
    """`fn(*args)` once on every alive node (pinned there); [] on a single-node cluster."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return []
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    return ray.get([task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(*args)
                    for n in nodes], timeout=timeout_s)


def check_shared_storage(run_dir: Path, timeout_s: float = 120) -> list[dict]:
    """On a multi-node cluster, make sure every alive node reads and writes `run_dir`; the per-node reports."""
    from pipeline.errors import UserError

    run_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    marker = run_dir / f".storage-check-{token}"
    marker.write_text(token)
    try:
        reports = _on_every_node(probe_storage, str(run_dir), token, timeout_s=timeout_s)
    finally:
        marker.unlink(missing_ok=True)
    problems = storage_problems(str(run_dir), reports)
    if problems:
        raise UserError(f"run_dir {run_dir} is not shared by all {len(reports)} nodes of the Ray cluster:\n  "
                        + "\n  ".join(problems) + "\nput run_dir on storage every node mounts at the same path "
                        "(NFS, EFS, Filestore, or a bucket mounted with mountpoint-s3 / gcsfuse), or set "
                        "storage.uri to an s3:// bucket")
    return reports


def check_bucket(store, timeout_s: float = 120) -> list[dict]:
    """On a multi-node cluster, make sure every alive node can write and read the bucket; the per-node reports."""
    from pipeline.errors import UserError

    reports = _on_every_node(_probe_bucket, store, timeout_s=timeout_s)
    problems = [f"node {r['node_id'][:12]} ({r['host']}, {r['ip']}): {r['error']}" for r in reports if r["error"]]
    if problems:
        raise UserError(f"storage.uri {store.uri} is not usable from all {len(reports)} nodes of the Ray cluster:\n  "
                        + "\n  ".join(problems) + "\ngive every node credentials for the bucket (AWS_ACCESS_KEY_ID / "
                        "AWS_SECRET_ACCESS_KEY, an instance role) and a route to storage.endpoint_url")
    return reports


def _probe_bucket(store) -> dict:
    """On one node: can it write, read back and delete an object in the bucket?"""
    import socket

    import ray

    from pipeline.bucket import probe

    return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(), "error": probe(store)}
