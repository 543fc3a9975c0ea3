r"""A sandbox for model-written code (the code_tests reward, the python tool): run untrusted Python in a separate
process with CPU-time, memory, process, file-size and output limits, no network and a throw-away working
directory, and return what happened. A response that loops forever, forks, writes outside its directory, opens a
socket, eats memory or prints megabytes fails (scores 0) within `SandboxLimits.wall_s` plus a fraction of a second,
and never stalls or damages the caller. docs/security.md is the user's account of what follows.

    run_python(code, limits, stdin) -> SandboxResult  # the process's exit, output (capped), timing and a reason
    code_tests(prompt, response, row) -> float    # MBPP/HumanEval reward: 1.0 iff every check holds, judged apart
    extract_code(response) -> str                 # the last ```python block, else any fenced block, else all
    isolation() -> str                            # the layers in use here, e.g. "bwrap+rlimits+uid"
    interpreter() -> str                          # the Python it runs, e.g. /usr/bin/python3
    describe() -> dict                            # tier, interpreter, what it hides: MLflow params sandbox_*
    check_isolation(allow_weak, users, log)       # the stage-start check: a weak tier is a UserError unless allowed
    model_code_users(rule, environment) -> str    # what in a ppo config runs model-written code, however spelled
    permit(allow_weak), allowance_env()           # run_python's own refusal of a weak tier (WeakSandbox), per process

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
model-written code at the ppo stage's start unless `stages.ppo.sandbox.allow_weak`, and `run_python` refuses them
(WeakSandbox) in any process not allowed one (`permit`, PIPELINE_SANDBOX_ALLOW_WEAK=1), whatever calls it:

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

code_tests decides its verdict in a process that runs nothing the response chose (issue 67): two sandboxed runs
start side by side and talk only through the caller (`relay.converse`): the judge's run (`programs.judge`) runs
the row's test as written, any shape, with the response's names bound to what the response's run
(`programs.serve`) reported, and asks that run for every call the test makes on the response's code, sending the
inputs and taking the return values as data (`values`); method calls, subscripts and comparisons on those values
happen in the judge. The caller's referee (`harness.Referee`) checks and rebuilds every message it forwards.
docs/security.md states the threat model, the guarantee and its limits.

Why the standard library where it is used: there is no maintained Python package that wraps bubblewrap, rlimits
and uid changes; `subprocess`, `resource`, `selectors` and `os` are what such a package would use. The cgroup,
rlimits, namespaces and uid change are applied by a tiny launcher (`python -I -S -c LAUNCHER spec`) that then
execs bwrap or the interpreter, not by `preexec_fn`: reward functions run on threads inside Ray actors, and
`preexec_fn` is not safe in a process with threads (it can deadlock in the forked child).

The package, one concern per module (imported bottom up, nothing back):

    cgroup.py    the common limit of all sandboxes of a process (TOTAL)
    process.py   one run: the launcher, reading the output against the clock and the cap, killing what is left
    relay.py     runs in conversation: started side by side, their lines relayed through a referee
    tiers.py     choosing the isolation, describing it, refusing a weak one; run_python, converse
    values.py    values as data between the runs (the codec, the caller's check) and the strict comparison
    verdict.py   the judge's plan, from the row's tests alone: whose names, the rewrite, the refusals
    programs.py  the two sandboxed programs: the response's run (serve) and the judge's run (judge)
    harness.py   the code_tests reward: extract_code, row_tests, the referee, code_tests
"""

from __future__ import annotations

from stages.ppo.sandbox.harness import code_tests, extract_code, judge, row_tests  # noqa: F401
from stages.ppo.sandbox.process import SandboxLimits, SandboxResult  # noqa: F401
from stages.ppo.sandbox.tiers import (  # noqa: F401
    ALLOW_ENV, ALLOW_WEAK_KEY, ENV_VAR, HIDES, STRONG, TIERS, WEAK, WeakSandbox, allowance_env, announce,
    check_isolation, describe, interpreter, isolation, make_undumpable, model_code_users, permit, run_python,
    weak_allowed)
