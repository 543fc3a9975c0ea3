r"""A sandbox for model-written code (the code_tests reward, the python tool): run untrusted Python in a separate
process with CPU-time, memory, process, file-size and output limits, no network and a throw-away working
directory, and return what happened. A response that loops forever, forks, writes outside its directory, opens a
socket, eats memory or prints megabytes fails (scores 0) within `SandboxLimits.wall_s` plus a fraction of a second,
and never stalls or damages the caller. docs/security.md is the user's account of what follows.

    run_python(code, limits, stdin) -> SandboxResult  # the process's exit, output (capped), timing and a reason
    code_tests(prompt, response, row) -> float    # MBPP-style reward: 1.0 iff the harness ran every test to its end
    extract_code(response) -> str                 # the last ```python block, else any fenced block, else all
    isolation() -> str                            # the layers in use here, e.g. "bwrap+rlimits+uid"
    interpreter() -> str                          # the Python it runs, e.g. /usr/bin/python3
    describe() -> dict                            # tier, interpreter, what it hides: MLflow params sandbox_*
    check_isolation(allow_weak, users, log)       # the stage-start check: a weak tier is a UserError unless allowed
    model_code_users(rule, environment) -> str    # what in a ppo config runs model-written code ("" if nothing)

The layers (each stops something the others may not):

- process: a fresh `python -I` (isolated mode: no PYTHON* variables, no user site, no cwd on sys.path), stdin
  /dev/null (or the bytes the caller gives), a clean environment, a session of its own. Stops: touching the
  caller's interpreter, memory or environment.
- rlimits: RLIMIT_CPU (SIGXCPU, SIGKILL a second later), RLIMIT_AS (memory: an allocation fails, MemoryError),
  RLIMIT_FSIZE (each file), RLIMIT_NOFILE, RLIMIT_NPROC (tasks at once; see uid), RLIMIT_CORE=0. Stops: busy
  loops, memory hogs, huge files, fd exhaustion, fork bombs.
- cgroup: where the caller may create one (cgroup v2 with memory and pids delegated, or the v1 memory and pids
  hierarchies), every sandbox process of a caller joins one cgroup of its own with memory.max and pids.max from
  `TOTAL`; otherwise that is logged once. Stops: many concurrent sandboxes adding up past what the rlimits bound.
- wall clock and output cap: the parent reads stdout and stderr with `selectors`, keeps at most `output_bytes` of
  each, and kills everything at the deadline or once either cap is passed; once the main process has exited, its
  process group is killed (a background child holding the pipes cannot stretch the run). Stops: sleeps and
  blocking reads (no CPU used), megabytes of output (never held in the parent).
- uid: when the caller is root, the sandbox runs as a fresh, unused uid (random in [UID_BASE, UID_BASE +
  UID_SPAN), no passwd entry, no groups); after the run every process of that uid is killed. Stops: fork bombs
  (RLIMIT_NPROC counts a user's tasks and never applies to root, so only a uid of its own gives each sandbox its
  own fork limit), writes to anything but world-writable places, reads of anything not world-readable (the
  caller's /proc/<pid>/environ), a child that left the process group (setsid) outliving the run.
- bwrap: bubblewrap (Debian package `bubblewrap`; the Dockerfile and, as root, scripts/setup.sh install it) with
  new user, network, pid, ipc, uts and cgroup namespaces and a root of its own: /usr, the /bin, /sbin and /lib*
  directories (or their symlinks), /etc/ld.so.cache and the interpreter's prefixes (sys.prefix, sys.base_prefix:
  a venv and its base), all read-only; fresh tmpfs mounts of `file_mb` as /tmp (the working directory is
  /tmp/work in it) and /dev/shm, a fresh /proc, /dev read-only, `--die-with-parent`, `--new-session`, no
  capabilities, no nested user namespaces. Not there: /etc/passwd, /home, /root, /var (a Kubernetes
  service-account token), the repository. Stops: the network (only an unconnected loopback exists), reading the
  host's files, writes anywhere but its own tmpfs, seeing other processes, stragglers (the pid namespace dies
  with it), TIOCSTI on a terminal.
- undumpable callers: `run_python` sets PR_SET_DUMPABLE=0 on its own process once (`make_undumpable`), so the
  reward workers and engines that launch sandboxes, which hold the MLflow password and cloud keys in their
  environment, cannot have /proc/<pid>/environ or their memory read by a process without CAP_SYS_PTRACE (the
  weak tiers run the code as the caller's uid).

`isolation()` picks the first of these that works on this machine (each is probed once per process with a tiny
program; `PIPELINE_SANDBOX=<name>` forces one, an error if it does not work here). STRONG are the first two;
the other three are WEAK (what each fails to hide is in `WEAK`), and `check_isolation` refuses them for
model-written code at the ppo stage's start unless `stages.ppo.sandbox.allow_weak`:

1. `bwrap+rlimits+uid`: all layers. Needs root (for the uid) and bwrap. The interpreter is the first of the
   caller's `sys.executable`, /usr/bin/python3, /usr/local/bin/python3, `python3` on PATH that the fresh uid can run
   (bwrap resolves its binds as that uid: a pyenv Python under /root is not one, so then it is the system's
   python3 and the code runs on the stdlib).
2. `bwrap+rlimits`: bwrap as the caller's own uid (no root, or no interpreter the fresh uid can run), with the
   caller's interpreter (its venv under /work or /root bound read-only). As root the fork limit does not apply (a
   fork bomb runs until the wall clock or the cgroup's pids.max, inside the pid namespace); as another user
   RLIMIT_NPROC is set to the user's current task count plus `processes` (concurrent sandboxes share it).
3. `unshare+rlimits+uid` (root, no bwrap): `unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC)` through libc
   (ctypes: Python 3.11 has no os.unshare) before dropping to the fresh uid: no network, no shared IPC, every
   mount remounted read-only in its namespace (a bind remount: the host's mounts are untouched) and fresh
   size-limited tmpfs mounts over /tmp, /var/tmp and /dev/shm, so nothing it writes survives the run. Weak: it
   cannot stop reading what is world-readable (the repository, /etc, a service-account token) or seeing other
   processes in /proc.
4. `userns-net+rlimits` (not root, no bwrap, unprivileged user namespaces allowed): a user + network namespace, so no
   network; otherwise as 5.
5. `rlimits`: the process, rlimits, cgroup, wall-clock and output layers only. It cannot stop: network access,
   writes anywhere the caller can write (the repository, the home directory), reading what the caller can read, a
   child that calls setsid() outliving the run, and (as root) fork bombs up to the wall clock. Fit for trusted
   code only.

What even tier 1 cannot stop: reading the world-readable files of its own root (system libraries, the interpreter
and its packages); CPU adding up across its tasks until the wall clock; a kernel exploit (no seccomp filter).

code_tests runs a harness (`HARNESS`, `program_for`, `passed`): the response's code, the setup and each test in one
namespace, each assert rewritten to compare only plain values of matching types, and a per-run secret the caller
writes to stdin that the harness reads only after the last test and prints as its last line before os._exit(0).
Exiting early, atexit hooks, a replaced excepthook or stdout, and values that equal anything then score 0
(docs/security.md states the guarantee and its limits).

Why the standard library where it is used: there is no maintained Python package that wraps bubblewrap, rlimits
and uid changes; `subprocess`, `resource`, `selectors` and `os` are what such a package would use. The cgroup,
rlimits, namespaces and uid change are applied by a tiny launcher (`python -I -S -c LAUNCHER spec`) that then
execs bwrap or the interpreter, not by `preexec_fn`: reward functions run on threads inside Ray actors, and
`preexec_fn` is not safe in a process with threads (it can deadlock in the forked child).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import random
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

UID_BASE = 0x3B000000  # ~989M: far from any distribution's user and subuid ranges
UID_SPAN = 1 << 24
ENV_VAR = "PIPELINE_SANDBOX"
TIERS = ("bwrap+rlimits+uid", "bwrap+rlimits", "unshare+rlimits+uid", "userns-net+rlimits", "rlimits")
STRONG = ("bwrap+rlimits+uid", "bwrap+rlimits")  # hide the parent's environment, the network and the filesystem
WEAK = {  # what each other tier fails to hide (docs/security.md)
    "unshare+rlimits+uid": "the filesystem (every world-readable file: the repository, /etc, a Kubernetes "
                           "service-account token) and the other processes (/proc)",
    "userns-net+rlimits": "the parent's environment (its /proc/<pid>/environ where that process is dumpable), the "
                          "filesystem (reads and writes as the caller) and the other processes",
    "rlimits": "the network, the parent's environment (its /proc/<pid>/environ where that process is dumpable), the "
               "filesystem (reads and writes as the caller) and the other processes",
}
ALLOW_WEAK_KEY = "stages.ppo.sandbox.allow_weak"
SETUP_FAILED = 125  # the launcher's exit code when it could not build the sandbox
EXIT_GRACE_S = 0.5  # after the main process exits, how long its output pipes are still read

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


@dataclass
class SandboxLimits:
    cpu_s: float = 5  # CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds)
    wall_s: float = 10  # wall clock of the whole run; everything is killed then
    memory_mb: int = 512  # address space per process (RLIMIT_AS); 0: no limit
    output_bytes: int = 65536  # kept of stdout and of stderr each; past it the run is killed
    processes: int = 16  # tasks (processes and threads) the sandbox may have at once (RLIMIT_NPROC)
    file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE), and the size of each of its tmpfs mounts
    open_files: int = 64  # RLIMIT_NOFILE


@dataclass
class SandboxResult:
    ok: bool  # exited 0, in time, within the output cap
    returncode: int | None  # negative: killed by that signal; None: never started
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    wall_s: float
    error: str  # "" when ok, else a short reason: timeout, output limit, cpu, memory, killed, nonzero exit, sandbox


@dataclass
class _Config:
    tier: str
    python: str  # the interpreter the sandbox runs
    uid: bool  # run as a fresh uid
    bwrap: str | None = None
    unshare: int = 0
    tmpfs: list[str] = field(default_factory=list)  # mounted over after `unshare` (tier 3)
    binds: list[str] = field(default_factory=list)  # bwrap: the bind and symlink arguments of its minimal root
    own_binds: list[tuple[str, str]] = field(default_factory=list)  # bwrap: (source, dest): the interpreter's dirs


# --------------------------------------------------------------------------- the launcher
# Runs as `python -I -S -c LAUNCHER <json>` in the child: namespaces (tiers 3-4), rlimits, the uid, then exec.
LAUNCHER = r"""
import json, os, resource, sys
spec = json.loads(sys.argv[1])
def fail(what, err):
    os.write(2, ("sandbox: %s: %s\n" % (what, err)).encode())
    os._exit(125)
for procs in spec["cgroups"]:  # the total memory and task limit across sandboxes (cgroup), before any fork
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        fail("cgroup " + procs, e)
if spec["unshare"]:
    import ctypes, re
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    if libc.unshare(spec["unshare"]) != 0:
        fail("unshare", os.strerror(ctypes.get_errno()))
    if spec["tmpfs"]:
        with open("main.py", "rb") as f:  # the host's working directory is about to be hidden under /tmp
            code = f.read()
        if libc.mount(b"none", b"/", None, 16384 | 262144, None) != 0:  # MS_REC | MS_PRIVATE
            fail("mount --make-rprivate /", os.strerror(ctypes.get_errno()))
        # every mount read-only in this namespace (a bind remount changes this mount only, not the host's), so
        # nothing the code writes outlives it: world-writable places such as /run/lock included. /proc and /sys
        # stay as they are (their writable files are the process's own or root's).
        flags = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split(" - ")[0].split() for line in f]
        for fields in mounts:
            target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if target in ("/proc", "/sys") or target.startswith(("/proc/", "/sys/")):
                continue
            keep = sum(flags.get(o, 0) for o in fields[5].split(","))
            if libc.mount(None, target.encode(), None, 4096 | 32 | 1 | keep, None) != 0:  # MS_BIND|MS_REMOUNT|MS_RDONLY
                err = ctypes.get_errno()
                if err != 2:  # ENOENT: a mount point shadowed or gone
                    fail("remount read-only " + target, os.strerror(err))
        for target in spec["tmpfs"]:
            opts = ("size=%d,mode=1777" % spec["tmpfs_bytes"]).encode()
            if libc.mount(b"tmpfs", target.encode(), b"tmpfs", 2 | 4, opts) != 0:  # MS_NOSUID | MS_NODEV
                fail("mount tmpfs " + target, os.strerror(ctypes.get_errno()))
        os.mkdir(spec["work"], 0o700)
        with open(os.path.join(spec["work"], "main.py"), "wb") as f:
            f.write(code)
        if spec["uid"] is not None:
            os.chown(spec["work"], spec["uid"], spec["uid"])
        os.chdir(spec["work"])
try:
    for name, value in spec["rlimits"]:
        which = getattr(resource, name)
        soft, hard = value
        cur_hard = resource.getrlimit(which)[1]
        if cur_hard != resource.RLIM_INFINITY and os.getuid() != 0:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(which, (soft, hard))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
except OSError as e:
    fail("setup", e)
"""


# --------------------------------------------------------------------------- choosing the isolation
_lock = threading.Lock()
_configs: dict[str, _Config] = {}
_prefix_cache: dict[str, list[str] | None] = {}
HIDDEN_ROOTS = ("/", "/root", "/home", "/etc", "/var", "/run", "/tmp", "/srv", "/mnt", "/media", "/opt", "/work")


def isolation() -> str:
    """The isolation layers `run_python` uses on this machine (probed once per process), e.g. "bwrap+rlimits+uid";
    see the module docstring for what each stops."""
    return _config().tier


def interpreter() -> str:
    """The Python interpreter the sandbox runs (not always the caller's: see tier 1 in the module docstring)."""
    return _config().python


HIDES = {
    "bwrap+rlimits+uid": "the parent's environment, the network, the filesystem (its root holds only /usr, /lib*, "
                         "the interpreter's prefixes and /etc/ld.so.cache, read-only, and a tmpfs /tmp of its own), "
                         "the other processes (pid namespace), IPC; its own fork limit (a fresh uid)",
    "bwrap+rlimits": "the parent's environment, the network, the filesystem (its root holds only /usr, /lib*, the "
                     "interpreter's prefixes and /etc/ld.so.cache, read-only, and a tmpfs /tmp of its own), the other "
                     "processes (pid namespace), IPC",
    "unshare+rlimits+uid": "the parent's environment (a fresh uid), the network, IPC, writes (every mount read-only "
                           "but its own tmpfs /tmp, /var/tmp, /dev/shm); its own fork limit",
    "userns-net+rlimits": "the network",
    "rlimits": "nothing (CPU, memory, file-size, output and wall-clock limits only)",
}


def describe() -> dict[str, str]:
    """What the sandbox is on this machine, as MLflow params: sandbox_tier, sandbox_interpreter, sandbox_strong,
    sandbox_hides, sandbox_exposes and sandbox_total_limit (the cgroup across sandboxes, or why there is none)."""
    cfg = _config()
    _cgroup_procs()
    return {"sandbox_tier": cfg.tier, "sandbox_interpreter": cfg.python,
            "sandbox_strong": str(cfg.tier in STRONG).lower(), "sandbox_hides": HIDES[cfg.tier],
            "sandbox_exposes": WEAK.get(cfg.tier, "the world-readable files of /usr, /lib* and the interpreter's "
                                        "prefixes (read-only)"),
            "sandbox_total_limit": _cgroup_note.get((TOTAL.memory_mb, TOTAL.tasks), "")}


FIX = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; the project's Dockerfile does) and let the "
       "container create unprivileged user namespaces and mount a fresh /proc in them: Docker: `docker run "
       "--security-opt seccomp=unconfined` (or a seccomp profile allowing unshare/clone with CLONE_NEWUSER), "
       "`--security-opt apparmor=unconfined` on hosts with AppArmor (Ubuntu) and `--security-opt "
       "systempaths=unconfined` (a masked /proc forbids the sandbox's own /proc); Kubernetes: the container's "
       "securityContext `seccompProfile: {type: Unconfined}`, `appArmorProfile: {type: Unconfined}` and "
       "`procMount: Unmasked` (which needs the pod's `hostUsers: false`), no privileged mode or added capabilities; "
       "on the host, user.max_user_namespaces > 0 (and kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu "
       "24.04+). PIPELINE_SANDBOX=auto (or unset) picks the strongest tier that works")


def check_isolation(allow_weak: bool, users: str, log: Callable[[str], None] = print) -> dict[str, str]:
    """The stage-start check of the sandbox model-written code runs in (`users`: e.g. "code_tests reward"): logs the
    tier and returns `describe()` when it is strong (STRONG); a weak tier (WEAK) is a UserError naming what it
    fails to hide, the config key that accepts it and how to get a stronger one, unless `allow_weak` (then a
    warning is logged)."""
    from pipeline.errors import UserError

    try:
        info = describe()
    except (RuntimeError, ValueError) as exc:
        raise UserError(f"{users}: {exc}") from None
    tier = info["sandbox_tier"]
    if tier in STRONG:
        log(f"{users}: model-written code runs sandboxed ({tier}, {info['sandbox_interpreter']}; total limit: "
            f"{info['sandbox_total_limit']})")
        return info
    problem = (f"{users}: the strongest sandbox tier on this machine is {tier!r} ({ENV_VAR}="
               f"{os.environ.get(ENV_VAR, 'auto')}), which cannot hide {WEAK[tier]} from model-written code")
    if allow_weak:
        log(f"warning: {problem}; running it anyway because {ALLOW_WEAK_KEY} is true (docs/security.md)")
        return info
    raise UserError(f"{problem}. To get a stronger tier, {FIX}. To run it anyway (code you trust), set "
                    f"{ALLOW_WEAK_KEY}: true (docs/security.md).")


def model_code_users(rule: str, environment: str | None) -> str:
    """What runs model-written code in a ppo stage configured with `rewards.rule` and `environment.name` (None: no
    environment): "code_tests reward", "python tool", both joined by "and", or "" (then no check is needed)."""
    users = [u for u, on in (("code_tests reward", rule == "code_tests"), ("python tool", environment == "python")) if on]
    return " and ".join(users)


_announced: set[str] = set()


def announce(users: str, log: Callable[[str], None] = print) -> None:
    """Log, once per process, the tier `users` (e.g. "python tool") runs model-written code in."""
    if users in _announced:
        return
    _announced.add(users)
    tier = isolation()
    note = "" if tier in STRONG else f" (a weak tier: it cannot hide {WEAK[tier]})"
    log(f"{users}: model-written code runs sandboxed ({tier}, {interpreter()}){note}")


def _config() -> _Config:
    wanted = os.environ.get(ENV_VAR, "auto").strip() or "auto"
    if wanted != "auto" and wanted not in TIERS:
        raise ValueError(f"{ENV_VAR}={wanted!r}: must be 'auto' or one of {', '.join(TIERS)}")
    with _lock:
        if wanted not in _configs:
            _configs[wanted] = _choose(wanted)
        return _configs[wanted]


def _pythons() -> list[str]:
    out = []
    for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")):
        if p and os.path.isfile(p) and os.path.realpath(p) not in [os.path.realpath(q) for q in out]:
            out.append(p)
    return out


def _prefixes(python: str) -> list[str] | None:
    """The directories `python` runs from: its prefixes (a venv's and its base's) and its executable's directory;
    None if it cannot be asked (then it is not a candidate for bwrap)."""
    if python not in _prefix_cache:
        ask = ("import os, sys; print('\\n'.join([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,"
               " os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(os.path.abspath(sys.executable))]))")
        try:
            out = subprocess.run([python, "-I", "-c", ask], capture_output=True, text=True, timeout=30,  # site: venv
                                 env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
            _prefix_cache[python] = out.stdout.split() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            _prefix_cache[python] = None
    return _prefix_cache[python]


def _root_binds(python: str) -> tuple[list[str], list[tuple[str, str]]] | None:
    """bwrap arguments for a root holding only what `python` needs: /usr and the /bin, /sbin, /lib* directories
    (or their symlinks into /usr) and /etc/ld.so.cache, read-only; and (source, dest) of the interpreter's own
    directories (its prefixes, a venv's and its base's). Not /etc (passwd), /home, /root, /var (a Kubernetes
    service-account token), the repository."""
    prefixes = _prefixes(python)
    if prefixes is None:
        return None
    args, covered, own = [], [], []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
            covered.append(top)
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for p in prefixes + [os.path.dirname(os.path.abspath(python))]:
        for path in dict.fromkeys([os.path.normpath(p), os.path.realpath(p)]):
            if path in HIDDEN_ROOTS or not os.path.isdir(path):
                continue
            if any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered):
                continue
            own.append((os.path.realpath(path), path))
            covered.append(path)
    return args, own


def _candidates(tier: str) -> list[_Config]:
    root = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    if tier == "bwrap+rlimits+uid":
        return [_Config(tier, p, uid=True, bwrap=bwrap, binds=_root_binds(p)[0], own_binds=_root_binds(p)[1])
                for p in _pythons() if _root_binds(p) is not None] if root and bwrap else []
    if tier == "bwrap+rlimits":
        binds = _root_binds(sys.executable) if bwrap else None
        return [_Config(tier, sys.executable, uid=False, bwrap=bwrap, binds=binds[0], own_binds=binds[1])] \
            if binds is not None else []
    if tier == "unshare+rlimits+uid":
        tmpfs = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
        return [_Config(tier, p, uid=True, unshare=CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC, tmpfs=tmpfs)
                for p in _pythons()] if root and sys.platform == "linux" else []
    if tier == "userns-net+rlimits":
        return [_Config(tier, sys.executable, uid=False, unshare=CLONE_NEWUSER | CLONE_NEWNET)] \
            if not root and sys.platform == "linux" else []
    return [_Config(tier, sys.executable, uid=False)]


def _choose(wanted: str) -> _Config:
    tiers = TIERS if wanted == "auto" else (wanted,)
    tried = []
    for tier in tiers:
        for cfg in _candidates(tier):
            res = _run(cfg, "print(6 * 7)", SandboxLimits(cpu_s=5, wall_s=20))
            if res.ok and res.stdout.strip() == "42":
                return cfg
            tried.append(f"{tier} ({cfg.python}): {res.error}: {(res.stderr.strip().splitlines() or [''])[-1]}")
    raise RuntimeError(f"no sandbox isolation works here ({ENV_VAR}={wanted}); tried: " + "; ".join(tried or ["none"]))


# --------------------------------------------------------------------------- the total limit (cgroup)
@dataclass
class Totals:
    """Limits on all the sandboxes of one process together (a cgroup of their own), beyond each one's rlimits."""

    memory_mb: int = 4096  # memory.max (v2) / memory.limit_in_bytes (v1)
    tasks: int = 512  # pids.max


TOTAL = Totals()
_cg_lock = threading.Lock()
_cgroups: dict[tuple, list[str]] = {}  # (memory_mb, tasks) -> the cgroup.procs files a sandbox joins
_cgroup_note: dict[tuple, str] = {}  # ... -> what it is, or why there is none
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


def _cgroup_procs() -> list[str]:
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
                _cgroup_note[key] = f"{TOTAL.memory_mb} MB and {TOTAL.tasks} tasks across sandboxes ({where})"
            except (OSError, ValueError, IndexError, subprocess.SubprocessError) as exc:
                _cgroups[key] = []
                _cgroup_note[key] = f"none (per-sandbox rlimits only): {exc}"
                logging.getLogger(__name__).warning("sandbox: no total memory and task limit across sandboxes, "
                                                    "each has its own rlimits only: %s", exc)
        return _cgroups[key]


@atexit.register
def _remove_cgroups() -> None:
    for path in reversed(_cgroup_dirs):
        with contextlib.suppress(OSError):
            os.rmdir(path)


# --------------------------------------------------------------------------- the caller
_undumpable = False


def make_undumpable() -> bool:
    """PR_SET_DUMPABLE=0 for this process (once): its /proc/<pid>/environ, memory and fds become unreadable to
    any process without CAP_SYS_PTRACE, including sandboxed code of the same uid (weak tiers), and it cannot
    be ptraced. Called by `run_python`: the reward workers and engines that launch sandboxes hold secrets
    (MLflow password, cloud keys) in their environment. Returns whether it is set."""
    global _undumpable
    if not _undumpable and sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        _undumpable = libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    return _undumpable


# --------------------------------------------------------------------------- running
def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: bytes = b"") -> SandboxResult:
    """Run `code` as a Python program in the sandbox (see the module docstring) and return its result. `stdin`:
    what the program reads on its standard input (none: /dev/null). Never raises for anything the code does;
    returns within about `limits.wall_s` (plus the one-off probe of `isolation()` on the first call of a
    process). Makes this process undumpable first (`make_undumpable`)."""
    make_undumpable()
    return _run(_config(), code, limits, stdin)


def _user_tasks(uid: int) -> int:
    """Tasks (processes and threads) of `uid` now: RLIMIT_NPROC counts them all for a user that is not root."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                pass
    return n


def _kill_uid(uid: int, deadline: float) -> None:
    """SIGKILL every process of `uid` until none is left (a fork bomb refills between scans) or the deadline."""
    while True:
        alive = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != uid:
                    continue
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":  # a zombie is dead; its parent reaps it
                        continue
                alive = True
                os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, IndexError):
                pass
        if not alive or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _run(cfg: _Config, code: str, limits: SandboxLimits, stdin: bytes = b"") -> SandboxResult:
    started = time.monotonic()
    uid = random.SystemRandom().randrange(UID_BASE, UID_BASE + UID_SPAN) if cfg.uid else None
    file_bytes = max(1, int(limits.file_mb)) << 20
    cpu = max(1, math.ceil(limits.cpu_s))
    nproc = max(1, int(limits.processes)) + (2 if cfg.bwrap else 0)  # bwrap's monitor and its pid 1
    if uid is None and os.geteuid() != 0:
        nproc += _user_tasks(os.geteuid())  # the limit is on all of the user's tasks, not the sandbox's
    rlimits = [("RLIMIT_CPU", (cpu, cpu + 1)), ("RLIMIT_FSIZE", (file_bytes, file_bytes)),
               ("RLIMIT_NOFILE", (limits.open_files, limits.open_files)), ("RLIMIT_CORE", (0, 0)),
               ("RLIMIT_NPROC", (nproc, nproc))]
    if limits.memory_mb:
        mem = int(limits.memory_mb) << 20
        rlimits.append(("RLIMIT_AS", (mem, mem)))
    with tempfile.TemporaryDirectory(prefix="sandbox-", ignore_cleanup_errors=True) as host_dir:
        main = os.path.join(host_dir, "main.py")
        with open(main, "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(main, 0o644)
        if uid is not None:
            os.chown(host_dir, uid, uid)
        work = "/tmp/work" if cfg.bwrap or cfg.tmpfs else host_dir  # bwrap, unshare: in the sandbox's own /tmp
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": "/tmp" if work == "/tmp/work"
               else work, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        argv = [cfg.python, "-I", "-B", "main.py"]
        if cfg.bwrap:  # a root of its own: the system's /usr and /lib*, the interpreter, a tmpfs /tmp
            own = [a for src, dest in cfg.own_binds for a in ("--ro-bind", src, dest)]
            argv = [cfg.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                    "--new-session", "--cap-drop", "ALL", *cfg.binds, "--proc", "/proc", "--dev", "/dev",
                    "--size", str(file_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                    "--size", str(file_bytes), "--tmpfs", "/tmp", "--dir", work,  # a venv under /tmp: bound after
                    *own, "--ro-bind", main, f"{work}/main.py", "--chdir", work, "--"] + argv
        spec = {"unshare": cfg.unshare, "tmpfs": cfg.tmpfs, "tmpfs_bytes": file_bytes, "work": work,
                "rlimits": rlimits, "uid": uid, "argv": argv, "env": env, "cgroups": _cgroup_procs()}
        r = None
        try:
            if stdin:
                r, w = os.pipe()
                with open(w, "wb") as f:
                    f.write(stdin[:60000])  # within a pipe's buffer: written before the program starts
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(spec)], cwd=host_dir,
                                    stdin=r if r is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, start_new_session=True, close_fds=True)
        except OSError as e:
            return SandboxResult(False, None, "", str(e), False, False, time.monotonic() - started, "sandbox")
        finally:
            if r is not None:
                os.close(r)
        try:
            out, err, timed_out, truncated = _collect(proc, started + limits.wall_s, limits.output_bytes,
                                                      lambda: _kill_rest(proc, uid))
        finally:
            _kill_all(proc, uid)
        rc = proc.returncode
    if cfg.bwrap and rc is not None and rc > 128:
        rc = 128 - rc  # bwrap reports a child killed by signal N as 128 + N; report it as subprocess does
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    ok = rc == 0 and not timed_out and not truncated
    return SandboxResult(ok, rc, stdout, stderr, timed_out, truncated, time.monotonic() - started,
                         _reason(ok, rc, stderr, timed_out, truncated))


def _collect(proc: subprocess.Popen, deadline: float, cap: int, kill_rest) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, the deadline passes, or either passes `cap` bytes (what is kept
    is at most `cap` each; the rest is never held). Once the main process has exited, its leftovers are killed
    (`kill_rest`) so that a background child holding the pipes cannot stretch the run; one that escaped that
    (tiers without a uid or pid namespace) gets EXIT_GRACE_S more, then its pipes are left unread."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    timed_out = truncated = False
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        exited_at = None
        while sel.get_map():
            now = time.monotonic()
            if exited_at is not None and now > exited_at + EXIT_GRACE_S:
                break
            remaining = deadline - now
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(remaining, 0.1)):
                buf = bufs[key.fd]
                try:
                    chunk = os.read(key.fd, min(65536, cap - len(buf) + 1))
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf += chunk
                if len(buf) > cap:
                    del buf[cap:]
                    truncated = True
            if truncated:
                break
            if exited_at is None and _exited(proc):
                exited_at = time.monotonic()
                kill_rest()  # the leftovers of an exited main process; the pipes then close
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out, truncated


def _exited(proc: subprocess.Popen) -> bool:
    """Has the main process exited? Without reaping it, so its process group id cannot be reused before the
    group is killed."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _signal_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    """Has `pid` exited (a zombie or reaped)? For the pid 1 of a pid namespace that means every process in it has
    (the kernel kills them all and waits for them before that pid 1 is done)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _kill_rest(proc: subprocess.Popen, uid: int | None) -> None:
    inits = _children(proc.pid)  # under bwrap: the pid 1 of its pid namespace (bwrap's own init)
    for pid in inits:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    _signal_group(proc)  # the main process and its process group
    deadline = time.monotonic() + 2.0
    while inits and not all(_gone(pid) for pid in inits) and time.monotonic() < deadline:
        time.sleep(0.002)  # the namespace is being torn down
    if uid is not None:
        _kill_uid(uid, time.monotonic() + 2.0)  # anything that left the group (setsid)


def _kill_all(proc: subprocess.Popen, uid: int | None) -> None:
    _kill_rest(proc, uid)
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:  # cannot happen after SIGKILL short of a hung kernel; don't hang the caller
        pass
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()


def _reason(ok: bool, rc: int | None, stderr: str, timed_out: bool, truncated: bool) -> str:
    if ok:
        return ""
    if timed_out:
        return "timeout"
    if truncated:
        return "output limit"
    if (rc == SETUP_FAILED and stderr.startswith("sandbox:")) or stderr.startswith("bwrap:"):
        return "sandbox"
    if rc == -signal.SIGXCPU:
        return "cpu"
    if "MemoryError" in stderr[-2000:]:
        return "memory"
    if rc is not None and rc < 0:
        return f"killed ({signal.Signals(-rc).name})" if -rc in signal.valid_signals() else "killed"
    return "nonzero exit"


# --------------------------------------------------------------------------- the reward
_OPEN = re.compile(r"[ \t]*([A-Za-z0-9_+.#-]*)")
_PYTHON_TAGS = {"python", "python3", "py", "py3"}


def extract_code(response: str) -> str:
    """The Python code of a model response: the last ```python (py, python3) fenced block, else the last fenced
    block of any language, else the whole response. A fence that was opened and never closed (the response was
    cut at its token limit) counts as a block running to the end. One pass over the text (linear time: a
    response of a megabyte of unclosed fences costs milliseconds)."""
    blocks, pos = [], 0
    while True:
        start = response.find("```", pos)
        if start < 0:
            break
        newline = response.find("\n", start + 3)
        if newline < 0:  # an opening fence needs the end of its line; no later one has one either
            break
        tag = _OPEN.match(response, start + 3, newline).group(1).lower()
        body = newline + 1
        close = response.find("```", body)
        if close < 0:  # unclosed: the block runs to the end
            blocks.append((tag, response[body:]))
            break
        end = close
        blank = close
        while blank > body and response[blank - 1] in " \t":
            blank -= 1
        if blank > body and response[blank - 1] == "\n":  # the closing fence's own line is not code
            end = blank - 1
        blocks.append((tag, response[body:end]))
        pos = close + 3
    if not blocks:
        return response.strip("\n")
    python = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    return (python or [code for _, code in blocks])[-1].strip("\n")


def _lines(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [str(v) for v in value if str(v).strip()]  # a list, tuple or numpy array (a parquet list column)


def row_tests(row: dict) -> tuple[str, list[str]]:
    """A row's setup code and its test statements: `test_list` (MBPP), else `tests` (a list, or one string of
    newline-joined asserts), else `test` (one string); setup from `test_setup_code` and `test_imports` (MBPP)."""
    row = row or {}
    for key in ("test_list", "tests", "test"):
        tests = _lines(row.get(key))
        if tests:
            break
    setup = "\n".join(_lines(row.get("test_imports")) + _lines(row.get("test_setup_code")))
    return setup, tests


LIMITS = SandboxLimits()  # what `code_tests` runs with (tests set smaller ones)

# The program code_tests runs: this harness, then a call with the response's code, the row's setup and its tests
# as string literals. It runs the response's code, the setup and each test statement in one namespace (each
# assert rewritten so that what it compares or tests must be a plain value: docs/security.md), then, only after
# the last test statement ran, reads the run's secret from the pipe the parent wrote it to (stdin, moved off
# fd 0 before the response's code runs) and writes `<secret>:<number of tests>` as the last line of stdout
# with os.write, and leaves with os._exit(0): no hook of the response's (atexit, excepthook, finalizers, a
# replaced sys.stdout) runs after it. The verdict needs that line, exactly once, last, with exit 0.
HARNESS = r'''
def __harness(response, setup, tests):
    import ast, builtins, collections, os, sys
    secret_fd = os.dup(0)  # the secret: read after the last test only
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out, stdout = os.dup(1), sys.stdout
    type_, len_, id_, str_ = type, len, id, str
    atoms = {bool, int, float, complex, str, bytes, type(None)}
    seqs = {list, tuple, set, frozenset}
    maps = {dict, collections.Counter, collections.OrderedDict, collections.defaultdict}
    numbers = {int, float}

    def plain(value, depth=0):
        t = type_(value)
        if t in atoms:
            return True
        if depth > 100:
            return False
        if t in seqs:
            return all(plain(v, depth + 1) for v in value)
        if t in maps:
            return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in dict.items(value))
        return False

    def value(v):
        if not plain(v):
            raise AssertionError("not a plain value (built-in types only): " + str_(type_(v).__name__))
        return v

    def equal(a, b):
        value(a)
        value(b)
        ta, tb = type_(a), type_(b)
        if not (ta is tb or (ta in numbers and tb in numbers) or (ta in maps and tb in maps)):
            return False
        return a == b

    def guard(node):
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Compare):
            if len_(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
                return ast.Call(ast.Name("__sbx_equal", ast.Load()), [guard(node.left), guard(node.comparators[0])], [])
            return ast.Compare(guard(node.left), node.ops, [guard(c) for c in node.comparators])
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(node.op, [guard(v) for v in node.values])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ast.UnaryOp(node.op, guard(node.operand))
        return ast.Call(ast.Name("__sbx_value", ast.Load()), [node], [])

    def strict(source, name):
        tree = ast.parse(source, name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                node.test = guard(node.test)
        return compile(ast.fix_missing_locations(tree), name, "exec")

    compiled = [strict(t, "<test %d>" % (i + 1)) for i, t in enumerate(tests)]  # before the response runs
    ns = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(response, "<response>", "exec"), ns)
    if setup:
        exec(compile(setup, "<setup>", "exec"), ns)
    for code in compiled:
        ns["__sbx_value"], ns["__sbx_equal"] = value, equal
        exec(code, ns)
    try:
        stdout.flush()
    except BaseException:
        pass
    secret = b""
    while True:
        chunk = os.read(secret_fd, 4096)
        if not chunk:
            break
        secret += chunk
    os.write(out, b"\n" + secret.strip() + b":" + str_(len_(compiled)).encode() + b"\n")
    os._exit(0)
'''


def program_for(response: str, row: dict) -> str | None:
    """The program `code_tests` runs (HARNESS with the response's code, the row's setup code and its tests); None
    without tests. The run's secret is not in it: code_tests writes it to the program's stdin."""
    setup, tests = row_tests(row)
    if not tests:
        return None
    return f"{HARNESS}\n__harness({extract_code(response)!r}, {setup!r}, {tests!r})\n"


def passed(result: SandboxResult, secret: str, tests: int) -> bool:
    """Whether a harness run passed: exit 0 in time and within the output cap, and its last line of stdout is
    `<secret>:<tests>`, the secret appearing nowhere else."""
    marker = f"{secret}:{tests}"
    lines = result.stdout.splitlines()
    return (result.ok and result.stdout.endswith("\n") and bool(lines) and lines[-1] == marker
            and result.stdout.count(secret) == 1)


def code_tests(prompt: str, response: str, row: dict) -> float:
    """The code-execution reward for MBPP-style rows: 1.0 if the response's code (`extract_code`) followed by
    the row's setup code and every test (`row_tests`) ran to the harness's last line in the sandbox
    (`run_python` with `LIMITS`; `program_for`, `passed`), else 0.0; a row without tests scores 0.0."""
    program = program_for(response, row)
    if program is None:
        return 0.0
    secret = secrets.token_hex(16)  # per run; never in the program, its argv or its environment
    result = run_python(program, LIMITS, stdin=secret.encode() + b"\n")
    return 1.0 if passed(result, secret, len(row_tests(row)[1])) else 0.0
