"""Which isolation this machine allows (`TIERS`, strongest first; each probed once per process with a tiny
program, `PIPELINE_SANDBOX=<name>` forces one), what each hides (`HIDES`, `WEAK`), the refusal of a weak tier for
model-written code (at the stage's start, `check_isolation`, for what `model_code_users` finds; and in every
process at the call, `run_python`, unless `permit` or PIPELINE_SANDBOX_ALLOW_WEAK allows it), and `run_python`:
the entry point that runs code in the chosen tier.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
import subprocess
import sys
import threading
from typing import Callable

import stages.ppo.sandbox.cgroup as cgroup
import stages.ppo.sandbox.process as process
import stages.ppo.sandbox.relay as relay
from stages.ppo.sandbox.process import Config, SandboxLimits, SandboxResult

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
ALLOW_ENV = "PIPELINE_SANDBOX_ALLOW_WEAK"  # "1": this process may run model-written code in a weak tier

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


# --------------------------------------------------------------------------- choosing the isolation
_lock = threading.Lock()
_configs: dict[str, Config] = {}
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
    cgroup.procs()
    return {"sandbox_tier": cfg.tier, "sandbox_interpreter": cfg.python,
            "sandbox_strong": str(cfg.tier in STRONG).lower(), "sandbox_hides": HIDES[cfg.tier],
            "sandbox_exposes": WEAK.get(cfg.tier, "the world-readable files of /usr, /lib* and the interpreter's "
                                        "prefixes (read-only)"),
            "sandbox_total_limit": cgroup.note.get((cgroup.TOTAL.memory_mb, cgroup.TOTAL.tasks), "")}


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


# What runs model-written code, found by the object a spelling resolves to (module, qualified name): a rule spelled
# `code_tests`, `stages.ppo.sandbox:code_tests` or `stages.ppo.sandbox.harness:code_tests` is the same function,
# and an environment is the python tool when it is `environments.Python` or a subclass of it.
CODE_RUNNERS = {"code_tests reward": ("stages.ppo.sandbox.harness", "code_tests"),
                "python tool": ("stages.ppo.environments", "Python")}
SHORT = {"code_tests": "stages.ppo.sandbox.harness:code_tests", "python": "stages.ppo.environments:Python"}


def _resolve(spec: str | None):
    """The object a 'module:name' spec (or a built-in short name) names; None when it does not import (the stage
    reports that itself, naming its key)."""
    spec = SHORT.get(spec, spec) if isinstance(spec, str) else None
    if not spec or ":" not in spec:
        return None
    module, _, name = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - any import error: not ours to report here
        return None
    return obj


def _is(obj, where: tuple[str, str]) -> bool:
    if obj is None:
        return False
    chain = obj.__mro__ if isinstance(obj, type) else (inspect.unwrap(obj),)
    return any((getattr(c, "__module__", None), getattr(c, "__qualname__", None)) == where for c in chain)


def model_code_users(rule: str, environment: str | None) -> str:
    """What runs model-written code in a ppo stage configured with `rewards.rule` and `environment.name` (None: no
    environment), however either is spelled: "code_tests reward", "python tool", both joined by "and", or "" (then
    the stage-start check is not needed; `run_python` still refuses a weak tier to anything else that calls it)."""
    found = (("code_tests reward", _resolve(rule)), ("python tool", _resolve(environment)))
    return " and ".join(users for users, obj in found if _is(obj, CODE_RUNNERS[users]))


_permitted: bool | None = None


def permit(allow_weak: bool) -> None:
    """Set whether this process may run model-written code in a weak tier (the ppo stage's `sandbox.allow_weak`);
    `allowance_env` carries it to the processes it starts. Unset, PIPELINE_SANDBOX_ALLOW_WEAK=1 decides."""
    global _permitted
    _permitted = bool(allow_weak)


def weak_allowed() -> bool:
    """Whether `run_python` may run code in a weak tier in this process (`permit`, else PIPELINE_SANDBOX_ALLOW_WEAK)."""
    if _permitted is not None:
        return _permitted
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")


def allowance_env() -> dict[str, str]:
    """This process's allowance as environment variables, for the Ray actors it starts (reward workers, engines)."""
    return {ALLOW_ENV: "1" if weak_allowed() else "0"}


class WeakSandbox(RuntimeError):
    """`run_python` refused: the tier here is weak and this process was not allowed to use it."""


_announced: set[str] = set()


def announce(users: str, log: Callable[[str], None] = print) -> None:
    """Log, once per process, the tier `users` (e.g. "python tool") runs model-written code in."""
    if users in _announced:
        return
    _announced.add(users)
    tier = isolation()
    note = "" if tier in STRONG else f" (a weak tier: it cannot hide {WEAK[tier]})"
    log(f"{users}: model-written code runs sandboxed ({tier}, {interpreter()}){note}")


def _config() -> Config:
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
               " os.path.dirname(os.path.realpath(sys.executable)), "
               "os.path.dirname(os.path.abspath(sys.executable))]))")
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


def _candidates(tier: str) -> list[Config]:
    root = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    if tier == "bwrap+rlimits+uid":
        return [Config(tier, p, uid=True, bwrap=bwrap, binds=_root_binds(p)[0], own_binds=_root_binds(p)[1])
                for p in _pythons() if _root_binds(p) is not None] if root and bwrap else []
    if tier == "bwrap+rlimits":
        binds = _root_binds(sys.executable) if bwrap else None
        return [Config(tier, sys.executable, uid=False, bwrap=bwrap, binds=binds[0], own_binds=binds[1])] \
            if binds is not None else []
    if tier == "unshare+rlimits+uid":
        tmpfs = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
        return [Config(tier, p, uid=True, unshare=CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC, tmpfs=tmpfs)
                for p in _pythons()] if root and sys.platform == "linux" else []
    if tier == "userns-net+rlimits":
        return [Config(tier, sys.executable, uid=False, unshare=CLONE_NEWUSER | CLONE_NEWNET)] \
            if not root and sys.platform == "linux" else []
    return [Config(tier, sys.executable, uid=False)]


def _choose(wanted: str) -> Config:
    tiers = TIERS if wanted == "auto" else (wanted,)
    tried = []
    for tier in tiers:
        for cfg in _candidates(tier):
            res = process.run(cfg, "print(6 * 7)", SandboxLimits(cpu_s=5, wall_s=20))
            if res.ok and res.stdout.strip() == "42":
                return cfg
            tried.append(f"{tier} ({cfg.python}): {res.error}: {(res.stderr.strip().splitlines() or [''])[-1]}")
    raise RuntimeError(f"no sandbox isolation works here ({ENV_VAR}={wanted}); tried: " + "; ".join(tried or ["none"]))


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
def _allowed_config() -> Config:
    """This machine's tier, after the caller is made undumpable; WeakSandbox when it is weak and not allowed."""
    make_undumpable()
    cfg = _config()
    if cfg.tier not in STRONG and not weak_allowed():
        raise WeakSandbox(f"model-written code: the sandbox tier here is {cfg.tier!r} ({ENV_VAR}="
                          f"{os.environ.get(ENV_VAR, 'auto')}), which cannot hide {WEAK[cfg.tier]}. To get a stronger "
                          f"tier, {FIX}. To run it anyway (code you trust), set {ALLOW_WEAK_KEY}: true, or "
                          f"{ALLOW_ENV}=1 in the environment of a process of your own (docs/security.md).")
    return cfg


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: bytes = b"") -> SandboxResult:
    """Run `code` as a Python program in the sandbox (see the module docstring) and return its result. `stdin`:
    what the program reads on its standard input (none: /dev/null). Never raises for anything the code does;
    returns within about `limits.wall_s` (plus the one-off probe of `isolation()` on the first call of a
    process). Makes this process undumpable first (`make_undumpable`). Raises WeakSandbox, before running
    anything, when the tier here is weak and this process is not allowed one (`weak_allowed`): the refusal holds
    wherever model-written code runs, whatever named the function that runs it."""
    return process.run(_allowed_config(), code, limits, stdin)


def converse(programs: dict[str, str], limits: SandboxLimits, referee) -> relay.Conversation:
    """Run `programs` (name -> code) side by side in the sandbox, each as `run_python` runs one, their lines
    relayed through `referee` (relay.converse); the same refusal of a weak tier first."""
    return relay.converse(_allowed_config(), programs, limits, referee)
