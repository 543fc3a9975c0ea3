"""The sandboxes' common limit: where this process may create a cgroup (v2 with memory and pids delegated,
or the v1 memory and pids hierarchies), every sandbox it launches joins one cgroup of its own with memory.max
and pids.max from `TOTAL`; where it may not, that is said once (`note`). Bounds what many concurrent sandboxes
add up to beyond each one's rlimits. The cgroups are removed when the process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass


@dataclass
class Totals:
    """Limits on all the sandboxes of one process together (a cgroup of their own), beyond each one's rlimits."""

    memory_mb: int = 4096  # memory.max (v2) / memory.limit_in_bytes (v1)
    tasks: int = 512  # pids.max


TOTAL = Totals()
_cg_lock = threading.Lock()
_cgroups: dict[tuple, list[str]] = {}  # (memory_mb, tasks) -> the cgroup.procs files a sandbox joins
note: dict[tuple, str] = {}  # ... -> what it is, or why there is none
_cgroup_dirs: list[str] = []
CGROUP_PREFIX = "pipeline-sandbox-"


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _cgroup_dir(mounts: list, own: dict[str, str], fstype: str, controller: str) -> str | None:
    """The directory of this process's cgroup in the hierarchy of `controller` ("" for cgroup v2)."""
    if controller not in own:
        return None
    path = own[controller]
    for root, target, fs, opts in mounts:
        if fs != fstype or (fstype == "cgroup" and controller not in opts):
            continue
        if root == "/" or path == root or path.startswith(root + "/"):
            return target + (path if root == "/" else path[len(root):])
    return None


def _new_cgroup(parent: str, limits: dict[str, int]) -> str:
    for entry in os.listdir(parent):  # the leftovers of processes that ended without clean-up (empty: removable)
        if entry.startswith(CGROUP_PREFIX) and not os.path.exists(f"/proc/{entry[len(CGROUP_PREFIX):].split('-')[0]}"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(parent, entry))
    path = os.path.join(parent, f"{CGROUP_PREFIX}{os.getpid()}-{TOTAL.memory_mb}-{TOTAL.tasks}")
    os.makedirs(path, exist_ok=True)
    _cgroup_dirs.append(path)
    for name, value in limits.items():
        if os.path.exists(os.path.join(path, name)):
            with open(os.path.join(path, name), "w") as f:
                f.write(str(value))
        elif not name.startswith("memory.memsw"):
            raise OSError(f"{path} has no {name}")
    return path


def _make_cgroups() -> tuple[list[str], str]:
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                own[c] = path
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, post = line.rstrip("\n").split(" - ", 1)
            fields, rest = pre.split(), post.split()
            mounts.append((_unescape(fields[3]), _unescape(fields[4]), rest[0], rest[2].split(",") if len(rest) > 2
                           else []))
    memory, tasks = int(TOTAL.memory_mb) << 20, int(TOTAL.tasks)
    reasons = []
    v2 = _cgroup_dir(mounts, own, "cgroup2", "")
    if v2:
        try:
            with open(os.path.join(v2, "cgroup.controllers")) as f:
                available = f.read().split()
            if {"memory", "pids"} <= set(available):
                with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
                if not {"memory", "pids"} <= set(enabled):
                    with open(os.path.join(v2, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory +pids")
                path = _new_cgroup(v2, {"memory.max": memory, "memory.swap.max": 0, "pids.max": tasks})
                return [os.path.join(path, "cgroup.procs")], f"cgroup v2 {path}"
            reasons.append(f"cgroup v2 {v2}: no memory and pids controllers")
        except OSError as exc:
            reasons.append(f"cgroup v2 {v2}: {exc}")
    procs, made = [], []
    for controller, limits in (("memory", {"memory.limit_in_bytes": memory, "memory.memsw.limit_in_bytes": memory}),
                               ("pids", {"pids.max": tasks})):
        parent = _cgroup_dir(mounts, own, "cgroup", controller)
        if not parent:
            reasons.append(f"no cgroup v1 {controller} hierarchy")
            continue
        try:
            path = _new_cgroup(parent, limits)
            procs.append(os.path.join(path, "cgroup.procs"))
            made.append(f"{controller} {path}")
        except OSError as exc:
            reasons.append(f"cgroup v1 {parent}: {exc}")
    if not procs:
        raise OSError("; ".join(reasons) or "no cgroup")
    return procs, "cgroup v1 " + ", ".join(made) + (f" (not: {'; '.join(reasons)})" if reasons else "")


def procs() -> list[str]:
    """The cgroup.procs files each sandbox process joins so that all of this process's sandboxes together stay
    within TOTAL (created once per process and TOTAL, removed at exit); [] where this machine does not let the
    caller create a cgroup (logged once: each sandbox then has only its own rlimits)."""
    key = (TOTAL.memory_mb, TOTAL.tasks)
    with _cg_lock:
        if key not in _cgroups:
            try:
                procs, where = _make_cgroups()
                join = "import os, sys\nfor p in sys.argv[1:]:\n    open(p, 'w').write(str(os.getpid()))\n"
                res = subprocess.run([sys.executable, "-I", "-S", "-c", join, *procs], capture_output=True, timeout=30)
                if res.returncode != 0:
                    raise OSError(f"cannot join {where}: {res.stderr.decode(errors='replace').strip()[-300:]}")
                _cgroups[key] = procs
                note[key] = f"{TOTAL.memory_mb} MB and {TOTAL.tasks} tasks across sandboxes ({where})"
            except (OSError, ValueError, IndexError, subprocess.SubprocessError) as exc:
                _cgroups[key] = []
                note[key] = f"none (per-sandbox rlimits only): {exc}"
                logging.getLogger(__name__).warning("sandbox: no total memory and task limit across sandboxes, "
                                                    "each has its own rlimits only: %s", exc)
        return _cgroups[key]


@atexit.register
def _remove_cgroups() -> None:
    for path in reversed(_cgroup_dirs):
        with contextlib.suppress(OSError):
            os.rmdir(path)
