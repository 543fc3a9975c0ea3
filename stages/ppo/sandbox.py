r"""A sandbox for code-execution rewards: run untrusted Python (a model's response plus a row's test cases) in a
separate process with CPU-time, memory, process, file-size and output limits, no network and a throw-away working
directory, and return what happened. A response that loops forever, forks, writes outside its directory, opens a
socket, eats memory or prints megabytes fails (scores 0) within `SandboxLimits.wall_s` plus a fraction of a second,
and never stalls or damages the caller.

    run_python(code, limits) -> SandboxResult     # the process's exit, output (capped), timing and a reason
    code_tests(prompt, response, row) -> float    # MBPP-style reward: 1.0 iff the code plus every assert passes
    extract_code(response) -> str                 # the last ```python block, else any fenced block, else all
    isolation() -> str                            # the layers in use here, e.g. "bwrap+rlimits+uid"
    interpreter() -> str                          # the Python it runs, e.g. /usr/bin/python3

The layers (each stops something the others may not):

- process: a fresh `python -I` (isolated mode: no PYTHON* variables, no user site, no cwd on sys.path), stdin
  /dev/null, a clean environment, a session of its own. Stops: touching the caller's interpreter, memory or
  environment.
- rlimits: RLIMIT_CPU (SIGXCPU, SIGKILL a second later), RLIMIT_AS (memory: an allocation fails, MemoryError),
  RLIMIT_FSIZE (each file), RLIMIT_NOFILE, RLIMIT_NPROC (tasks at once; see uid), RLIMIT_CORE=0. Stops: busy
  loops, memory hogs, huge files, fd exhaustion, fork bombs.
- wall clock and output cap: the parent reads stdout and stderr with `selectors`, keeps at most `output_bytes` of
  each, and kills everything at the deadline or once either cap is passed; once the main process has exited, its
  process group is killed (a background child holding the pipes cannot stretch the run). Stops: sleeps and
  blocking reads (no CPU used), megabytes of output (never held in the parent).
- uid: when the caller is root, the sandbox runs as a fresh, unused uid (random in [UID_BASE, UID_BASE +
  UID_SPAN), no passwd entry, no groups); after the run every process of that uid is killed. Stops: fork bombs
  (RLIMIT_NPROC counts a user's tasks and never applies to root, so only a uid of its own gives each sandbox its
  own fork limit), writes to anything but world-writable places, reads of anything not world-readable, a child
  that left the process group (setsid) outliving the run.
- bwrap: bubblewrap (Debian package `bubblewrap`; scripts/setup.sh installs it where it runs as root) with new
  user, network, pid, ipc, uts and cgroup namespaces, `/` bound read-only, fresh tmpfs mounts of `file_mb` as
  /tmp (the working directory is /tmp/work in it) and /dev/shm, /dev read-only, `--die-with-parent`,
  `--new-session`, no capabilities, no nested user namespaces. Stops: the network (only an unconnected loopback
  exists), writes anywhere but its own tmpfs, seeing other processes, stragglers (the pid namespace dies with
  it), TIOCSTI on a terminal.

`isolation()` picks the first of these that works on this machine (each is probed once per process with a tiny
program; `PIPELINE_SANDBOX=<name>` forces one, an error if it does not work here):

1. `bwrap+rlimits+uid`: all layers. Needs root (for the uid) and bwrap. The interpreter is the first of the
   caller's `sys.executable`, /usr/bin/python3, /usr/local/bin/python3, `python3` on PATH that the fresh uid can run
   (a pyenv Python under /root is not one: then it is the system's python3, so the code runs on the stdlib).
2. `bwrap+rlimits`: bwrap as the caller's own uid (no root, or no interpreter the fresh uid can run). As root the
   fork limit does not apply (a fork bomb runs until the wall clock, inside the pid namespace); as another user
   RLIMIT_NPROC is set to the user's current task count plus `processes` (concurrent sandboxes share it).
3. `unshare+rlimits+uid` (root, no bwrap): `unshare(CLONE_NEWNET | CLONE_NEWNS)` through libc (ctypes: Python 3.11
   has no os.unshare) before dropping to the fresh uid: no network, and fresh size-limited tmpfs mounts over /tmp,
   /var/tmp and /dev/shm, so the world-writable places are the sandbox's own. It cannot stop: reading what is
   world-readable (the repository, /etc), writing a world-writable file or directory elsewhere (none on a stock
   Debian besides those three), seeing other processes in /proc.
4. `userns-net+rlimits` (not root, no bwrap, unprivileged user namespaces allowed): a user + network namespace, so no
   network; otherwise as 5.
5. `rlimits`: the process, rlimits, wall-clock and output layers only. It cannot stop: network access, writes
   anywhere the caller can write (the repository, the home directory), reading what the caller can read, a child
   that calls setsid() outliving the run, and (as root) fork bombs up to the wall clock. Fit for trusted code only:
   log `isolation()` where the sandbox is used.

What even tier 1 cannot stop: reading what is world-readable (the repository, /etc; read-only, and with no network
only the run's own output can carry it out); CPU and memory adding up across its tasks until the wall clock (the
rlimits are per process: at most `processes` x `memory_mb`, plus the two tmpfs mounts of `file_mb`; a pids or
memory cgroup would bound the total, and is left out because it needs a cgroup the caller may create); a kernel
exploit (no seccomp filter).

Why the standard library where it is used: there is no maintained Python package that wraps bubblewrap, rlimits
and uid changes; `subprocess`, `resource`, `selectors` and `os` are what such a package would use. The rlimits,
namespaces and uid change are applied by a tiny launcher (`python -I -S -c LAUNCHER spec`) that then execs bwrap
or the interpreter, not by `preexec_fn`: reward functions run on threads inside Ray actors, and `preexec_fn` is not
safe in a process with threads (it can deadlock in the forked child).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

UID_BASE = 0x3B000000  # ~989M: far from any distribution's user and subuid ranges
UID_SPAN = 1 << 24
ENV_VAR = "PIPELINE_SANDBOX"
TIERS = ("bwrap+rlimits+uid", "bwrap+rlimits", "unshare+rlimits+uid", "userns-net+rlimits", "rlimits")
SETUP_FAILED = 125  # the launcher's exit code when it could not build the sandbox
EXIT_GRACE_S = 0.5  # after the main process exits, how long its output pipes are still read

CLONE_NEWNS = 0x00020000
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


# --------------------------------------------------------------------------- the launcher
# Runs as `python -I -S -c LAUNCHER <json>` in the child: namespaces (tiers 3-4), rlimits, the uid, then exec.
LAUNCHER = r"""
import json, os, resource, sys
spec = json.loads(sys.argv[1])
def fail(what, err):
    os.write(2, ("sandbox: %s: %s\n" % (what, err)).encode())
    os._exit(125)
if spec["unshare"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    if libc.unshare(spec["unshare"]) != 0:
        fail("unshare", os.strerror(ctypes.get_errno()))
    if spec["tmpfs"]:
        with open("main.py", "rb") as f:  # the host's working directory is about to be hidden under /tmp
            code = f.read()
        if libc.mount(b"none", b"/", None, 16384 | 262144, None) != 0:  # MS_REC | MS_PRIVATE
            fail("mount --make-rprivate /", os.strerror(ctypes.get_errno()))
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


def isolation() -> str:
    """The isolation layers `run_python` uses on this machine (probed once per process), e.g. "bwrap+rlimits+uid";
    see the module docstring for what each stops."""
    return _config().tier


def interpreter() -> str:
    """The Python interpreter the sandbox runs (not always the caller's: see tier 1 in the module docstring)."""
    return _config().python


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


def _candidates(tier: str) -> list[_Config]:
    root = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    if tier == "bwrap+rlimits+uid":
        return [_Config(tier, p, uid=True, bwrap=bwrap) for p in _pythons()] if root and bwrap else []
    if tier == "bwrap+rlimits":
        return [_Config(tier, sys.executable, uid=False, bwrap=bwrap)] if bwrap else []
    if tier == "unshare+rlimits+uid":
        tmpfs = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
        return [_Config(tier, p, uid=True, unshare=CLONE_NEWNET | CLONE_NEWNS, tmpfs=tmpfs)
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


# --------------------------------------------------------------------------- running
def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a Python program in the sandbox (see the module docstring) and return its result. Never
    raises for anything the code does; returns within about `limits.wall_s` (plus the one-off probe of
    `isolation()` on the first call of a process)."""
    return _run(_config(), code, limits)


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


def _run(cfg: _Config, code: str, limits: SandboxLimits) -> SandboxResult:
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
        if cfg.bwrap:
            argv = [cfg.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                    "--new-session", "--cap-drop", "ALL", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
                    "--size", str(file_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                    "--size", str(file_bytes), "--tmpfs", "/tmp", "--dir", work,
                    "--ro-bind", main, f"{work}/main.py", "--chdir", work, "--"] + argv
        spec = {"unshare": cfg.unshare, "tmpfs": cfg.tmpfs, "tmpfs_bytes": file_bytes, "work": work,
                "rlimits": rlimits, "uid": uid, "argv": argv, "env": env}
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(spec)], cwd=host_dir,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, start_new_session=True, close_fds=True)
        except OSError as e:
            return SandboxResult(False, None, "", str(e), False, False, time.monotonic() - started, "sandbox")
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
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.#-]*)[^\n]*\n(.*?)(?:\n[ \t]*)?```", re.DOTALL)
_PYTHON_TAGS = {"python", "python3", "py", "py3"}


def extract_code(response: str) -> str:
    """The Python code of a model response: the last ```python (py, python3) fenced block, else the last fenced
    block of any language, else the whole response. A fence that was opened and never closed (the response was
    cut at its token limit) counts as a block running to the end."""
    matches = list(_FENCE.finditer(response))
    blocks = [(m.group(1).lower(), m.group(2)) for m in matches]
    tail = response[matches[-1].end():] if matches else response
    opened = re.search(r"```[ \t]*([A-Za-z0-9_+.#-]*)[^\n]*\n", tail)
    if opened:  # an unclosed fence after the last closed block
        blocks.append((opened.group(1).lower(), tail[opened.end():]))
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


def program_for(response: str, row: dict) -> str | None:
    """The program `code_tests` runs: the response's code, the row's setup code, its tests; None without tests."""
    setup, tests = row_tests(row)
    if not tests:
        return None
    return "\n\n".join(part for part in (extract_code(response), setup, "\n".join(tests)) if part) + "\n"


def code_tests(prompt: str, response: str, row: dict) -> float:
    """The code-execution reward for MBPP-style rows: 1.0 if the response's code (`extract_code`) followed by
    the row's setup code and every test (`row_tests`) runs to exit 0 in the sandbox (`run_python` with
    `LIMITS`), else 0.0; a row without tests scores 0.0."""
    program = program_for(response, row)
    return 1.0 if program is not None and run_python(program, LIMITS).ok else 0.0
