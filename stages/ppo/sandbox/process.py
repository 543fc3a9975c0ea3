"""One sandboxed run: the launcher (`python -I -S -c LAUNCHER spec`, which applies namespaces, rlimits and the
uid, then execs bwrap or the interpreter), the parent's reading of stdout and stderr with a wall clock and an
output cap (`selectors`), and the killing of everything the run left (its process group, its uid's tasks).
`run(config, code, limits, stdin)` is called by `tiers.run_python` with the tier chosen for this machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import stages.ppo.sandbox.cgroup as cgroup

UID_BASE = 0x3B000000  # ~989M: far from any distribution's user and subuid ranges
UID_SPAN = 1 << 24
SETUP_FAILED = 125  # the launcher's exit code when it could not build the sandbox
EXIT_GRACE_S = 0.5  # after the main process exits, how long its output pipes are still read


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
class Config:
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


# --------------------------------------------------------------------------- one run
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


@contextlib.contextmanager
def started(cfg: Config, code: str, limits: SandboxLimits, stdin: bytes | int = b""):
    """A sandboxed run of `code` in `cfg`'s tier: the launcher started, `(proc, uid)` yielded; on leaving,
    everything the run left is killed and its directory removed. `stdin`: bytes the program reads (within a
    pipe's buffer, written before it starts), or subprocess.PIPE for a conversation (`relay.converse`). OSError
    when the launcher cannot start."""
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
                "rlimits": rlimits, "uid": uid, "argv": argv, "env": env, "cgroups": cgroup.procs()}
        r = None
        try:
            if isinstance(stdin, bytes) and stdin:
                r, w = os.pipe()
                with open(w, "wb") as f:
                    f.write(stdin[:60000])  # within a pipe's buffer: written before the program starts
            source = stdin if stdin is subprocess.PIPE else r if r is not None else subprocess.DEVNULL
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(spec)], cwd=host_dir,
                                    stdin=source, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                    start_new_session=True, close_fds=True)
        finally:
            if r is not None:
                os.close(r)
        try:
            yield proc, uid
        finally:
            _kill_all(proc, uid)


def returncode(cfg: Config, proc: subprocess.Popen) -> int | None:
    """The run's exit status as subprocess reports it (bwrap reports a child killed by signal N as 128 + N)."""
    rc = proc.returncode
    return 128 - rc if cfg.bwrap and rc is not None and rc > 128 else rc


def run(cfg: Config, code: str, limits: SandboxLimits, stdin: bytes = b"") -> SandboxResult:
    started_at = time.monotonic()
    try:
        with started(cfg, code, limits, stdin) as (proc, uid):
            out, err, timed_out, truncated = _collect(proc, started_at + limits.wall_s, limits.output_bytes,
                                                      lambda: kill_rest(proc, uid))
    except OSError as e:
        return SandboxResult(False, None, "", str(e), False, False, time.monotonic() - started_at, "sandbox")
    rc = returncode(cfg, proc)
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    ok = rc == 0 and not timed_out and not truncated
    return SandboxResult(ok, rc, stdout, stderr, timed_out, truncated, time.monotonic() - started_at,
                         reason(ok, rc, stderr, timed_out, truncated))


def _collect(proc: subprocess.Popen, deadline: float, cap: int, cleanup) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, the deadline passes, or either passes `cap` bytes (what is kept
    is at most `cap` each; the rest is never held). Once the main process has exited, its leftovers are killed
    (`cleanup`) so that a background child holding the pipes cannot stretch the run; one that escaped that
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
            if exited_at is None and exited(proc):
                exited_at = time.monotonic()
                cleanup()  # the leftovers of an exited main process; the pipes then close
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out, truncated


def exited(proc: subprocess.Popen) -> bool:
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


def kill_rest(proc: subprocess.Popen, uid: int | None) -> None:
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
    kill_rest(proc, uid)
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:  # cannot happen after SIGKILL short of a hung kernel; don't hang the caller
        pass
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()


def reason(ok: bool, rc: int | None, stderr: str, timed_out: bool, truncated: bool) -> str:
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
