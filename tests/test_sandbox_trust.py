"""What the sandbox promises about trust (issue 48; docs/security.md): weak tiers are refused for model-written
code unless the config opts in; the strongest tier shows the code only what the interpreter needs; nothing the
code writes survives it; the processes that launch it are not readable through /proc; all of a process's
sandboxes share one memory and task limit (cgroup); the refusal of a weak tier holds however the rule
or environment is spelled, at the call; extract_code is linear. No Ray. Tiers are forced with PIPELINE_SANDBOX."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from stages.ppo import sandbox
from stages.ppo.sandbox import cgroup, harness, tiers
from stages.ppo.sandbox import SandboxLimits, extract_code, run_python
from helpers.sandbox_tiers import WORKING

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 1}

REPO = Path(__file__).resolve().parents[1]
SAMPLE = [json.loads(line) for line in (Path(__file__).parent / "helpers" / "mbpp_sample.jsonl").open()]
ADD = SAMPLE[0]
LIMITS = SandboxLimits(cpu_s=2, wall_s=4, memory_mb=256, processes=8)


BWRAP = [t for t in WORKING if t.startswith("bwrap")]
CONTAINED = [t for t in WORKING if t != "rlimits" and t != "userns-net+rlimits"]  # claim: no write survives


@pytest.fixture
def tier(request, monkeypatch):
    monkeypatch.setenv(sandbox.ENV_VAR, request.param)
    monkeypatch.setenv(sandbox.ALLOW_ENV, "1")  # a weak tier, forced on purpose
    # ... whatever an earlier in-process ppo stage permitted this process (`tiers.permit`, which outranks the variable)
    monkeypatch.setattr(sandbox.tiers, "_permitted", None)
    return request.param


# --------------------------------------------------------------------------- 4b: weak tiers are refused


def test_a_weak_tier_is_refused_for_model_written_code_unless_the_config_opts_in(monkeypatch):
    from pipeline.errors import UserError
    from stages.ppo.config import PPOConfig

    assert set(sandbox.STRONG) | set(sandbox.WEAK) == set(sandbox.TIERS) and not set(sandbox.STRONG) & set(sandbox.WEAK)
    monkeypatch.setenv(sandbox.ENV_VAR, "rlimits")
    lines = []
    with pytest.raises(UserError) as err:
        sandbox.check_isolation(False, "code_tests reward", lines.append)
    message = str(err.value)
    for part in ("'rlimits'", "network", "environment", "filesystem", "stages.ppo.sandbox.allow_weak: true",
                 "bubblewrap", "seccomp=unconfined", "apparmor=unconfined", "seccompProfile", "docs/security.md"):
        assert part in message, (part, message)
    info = sandbox.check_isolation(True, "code_tests reward", lines.append)  # opted in: proceeds, with a warning
    assert info["sandbox_tier"] == "rlimits" and info["sandbox_strong"] == "false"
    assert len(lines) == 1 and lines[0].startswith("warning:") and "allow_weak" in lines[0]
    # which configurations run model-written code (and so are checked at the stage's start)
    assert sandbox.model_code_users("verifier", None) == "" and sandbox.model_code_users("pkg:fn", "calculator") == ""
    assert sandbox.model_code_users("code_tests", "python") == "code_tests reward and python tool"
    assert sandbox.model_code_users("verifier", "python") == "python tool"
    # the key is typed and off by default
    assert PPOConfig().sandbox.allow_weak is False
    assert PPOConfig.model_validate({"sandbox": {"allow_weak": True}}).sandbox.allow_weak is True
    if BWRAP:  # the strongest tier here passes the check and is logged
        monkeypatch.setenv(sandbox.ENV_VAR, BWRAP[0])
        lines.clear()
        assert sandbox.check_isolation(False, "python tool", lines.append)["sandbox_strong"] == "true"
        assert BWRAP[0] in lines[0]


class OwnPython(__import__("stages.ppo.environments", fromlist=["Python"]).Python):
    """A user's environment built on the python tool: it runs model-written code too."""


def test_the_weak_tier_refusal_follows_the_code_whatever_its_spelling(monkeypatch):
    """Issue 59: `stages.ppo.sandbox:code_tests` and `stages.ppo.environments:Python` skipped the stage-start check;
    and run_python itself refuses a weak tier to a process that was not allowed one, whatever called it."""
    from stages.ppo.environments import environment_factory
    from stages.ppo.rewards import load

    for rule in ("code_tests", "stages.ppo.sandbox:code_tests", "stages.ppo.sandbox.harness:code_tests"):
        assert sandbox.model_code_users(rule, None) == "code_tests reward", rule
    for env in ("python", "stages.ppo.environments:Python", f"{__name__}:OwnPython"):
        assert sandbox.model_code_users("verifier", env) == "python tool", env
    assert sandbox.model_code_users("stages.ppo.sandbox:code_tests", "stages.ppo.environments:Python") == \
        "code_tests reward and python tool"
    assert sandbox.model_code_users("stages.ppo.environments:calculate", "stages.ppo.environments:Calculator") == ""
    assert sandbox.model_code_users("no_such_module:f", "no_such_module:C") == ""  # the stage names that error
    # at the call: a weak tier, and this process not allowed one
    monkeypatch.setenv(sandbox.ENV_VAR, "rlimits")
    monkeypatch.delenv(sandbox.ALLOW_ENV, raising=False)
    monkeypatch.setattr(tiers, "_permitted", None)
    monkeypatch.setattr(harness, "LIMITS", LIMITS)
    reward = load("stages.ppo.sandbox:code_tests", "reward")  # as a reward worker loads the rule
    tool = environment_factory("stages.ppo.environments:Python")().tools["python"]
    calls = (lambda: reward("", ADD["code"], ADD), lambda: tool("print(1)"), lambda: run_python("print(1)", LIMITS))
    for call in calls:
        with pytest.raises(sandbox.WeakSandbox, match="'rlimits'.*stages.ppo.sandbox.allow_weak: true"):
            call()
    assert sandbox.allowance_env() == {sandbox.ALLOW_ENV: "0"}
    sandbox.permit(True)  # the stage's allow_weak: true, carried to the workers it starts
    assert sandbox.allowance_env() == {sandbox.ALLOW_ENV: "1"}
    assert reward("", ADD["code"], ADD) == 1.0 and tool("print(6 * 7)") == "42\n"
    sandbox.permit(False)
    monkeypatch.setenv(sandbox.ALLOW_ENV, "1")  # the stage's word wins over the environment's
    with pytest.raises(sandbox.WeakSandbox):
        tool("print(1)")
    monkeypatch.setattr(tiers, "_permitted", None)
    assert tool("print(1)") == "1\n"  # a process of one's own: PIPELINE_SANDBOX_ALLOW_WEAK=1


# --------------------------------------------------------------------------- 4c: a minimal root


@pytest.mark.parametrize("tier", BWRAP, indirect=True)
def test_the_bwrap_root_holds_only_what_the_interpreter_needs(tier):
    outside = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        (outside / "secret.txt").write_text("host secret")
        paths = ["/etc/passwd", str(Path(__file__).resolve()), str(REPO / "pyproject.toml"),
                 str(outside / "secret.txt"),
                 "/var/run/secrets", "/home", "/etc/hostname"]
        code = textwrap.dedent(f"""
            import json, re, math, collections, os
            seen = [p for p in {paths!r} if os.path.exists(p)]
            print(json.dumps({{"seen": seen, "root": sorted(os.listdir("/")), "etc": os.listdir("/etc"),
                              "math": math.sqrt(16), "re": re.sub("a", "b", "aa")}}))
        """)
        res = run_python(code, LIMITS)
        assert res.ok, res
        out = json.loads(res.stdout)
        assert out["seen"] == [] and out["math"] == 4.0 and out["re"] == "bb", out
        assert set(out["etc"]) <= {"ld.so.cache"}, out["etc"]
        assert not {"home", "var", "run", "srv", "mnt", "opt", "boot"} & set(out["root"]), out["root"]
    finally:
        (outside / "secret.txt").unlink()
        outside.rmdir()


# --------------------------------------------------------------------------- 4d: nothing written survives


@pytest.mark.parametrize("tier", CONTAINED, indirect=True)
def test_nothing_the_code_writes_survives_the_run(tier):
    name = f"sbx-survive-{uuid.uuid4().hex}"
    targets = [f"{d}/{name}" for d in ("/run/lock", "/var/lock", "/var/tmp", "/tmp", "/dev/shm", "/dev/mqueue")
               if os.path.isdir(d)]
    code = "".join(f"try:\n    open({t!r}, 'w').write('x')\nexcept OSError:\n    pass\n" for t in targets)
    try:
        res = run_python(code, LIMITS)
        assert res.ok, res
        assert [t for t in targets if os.path.exists(t)] == []
    finally:
        for t in targets:
            if os.path.exists(t):
                os.unlink(t)


# --------------------------------------------------------------------------- 4e: callers are not dumpable


def test_the_caller_is_undumpable_after_run_python():
    assert run_python("print(1)", LIMITS).ok
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(3, 0, 0, 0, 0) == 0  # PR_GET_DUMPABLE


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root to start a "
                    "caller as another uid, and a system python3 that uid can run")
def test_code_of_the_callers_own_uid_cannot_read_its_environment():
    # the weakest tier runs the code as the caller's uid: without PR_SET_DUMPABLE=0 it reads the caller's
    # /proc/<pid>/environ (an MLflow password, cloud keys). The caller here is a non-root process (nobody).
    script = textwrap.dedent(f"""
        import json, sys, types
        for name, path in (("stages", "stages"), ("stages.ppo", "stages/ppo")):  # the sandbox alone: stdlib only
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__path__ = [{str(REPO)!r} + "/" + path]
        import stages.ppo.sandbox as sbx
        code = ("import os\\ntry:\\n"
                "    print(b'SBX_SECRET_MARK' in open('/proc/%d/environ' % os.getppid(), 'rb').read())"
                "\\nexcept OSError as e:\\n    print('denied', e.errno)\\n")
        res = sbx.run_python(code, sbx.SandboxLimits(cpu_s=2, wall_s=5, processes=8))
        print(json.dumps([sbx.isolation(), res.stdout, res.stderr[-300:]]))
    """)
    env = {"PATH": "/usr/bin:/bin", "PIPELINE_SANDBOX": "rlimits", "PIPELINE_SANDBOX_ALLOW_WEAK": "1",
           "SBX_SECRET_MARK": "hunter2", "LANG": "C.UTF-8"}
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", script], user=65534, group=65534, extra_groups=[],
                         env=env, cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    tier, stdout, stderr = json.loads(out.stdout.strip().splitlines()[-1])
    assert tier == "rlimits"
    assert stdout.startswith("denied"), (stdout, stderr)


@pytest.mark.parametrize("tier", [t for t in WORKING if t.endswith("+uid")], indirect=True)
def test_code_as_a_fresh_uid_cannot_read_the_callers_environment(tier):
    code = (f"try:\n    open('/proc/{os.getpid()}/environ', 'rb').read()\n    print('read')\n"  # not there: bwrap
            "except OSError:\n    print('denied')\n")
    res = run_python(code, LIMITS)
    assert res.ok and res.stdout.strip() == "denied", res


# --------------------------------------------------------------------------- 4f: a total limit (cgroup)


def _cgroups_writable() -> str:
    """Why a cgroup cannot be made here ("" if it can), as the sandbox found out."""
    cgroup.procs()
    note = cgroup.note[(cgroup.TOTAL.memory_mb, cgroup.TOTAL.tasks)]
    return note if note.startswith("none") else ""


@pytest.mark.skipif(bool(_cgroups_writable()), reason=f"this machine lets no process create a cgroup: "
                    f"{_cgroups_writable()}")
def test_all_sandboxes_of_a_process_share_one_memory_and_task_limit(monkeypatch):
    monkeypatch.setattr(cgroup, "TOTAL", cgroup.Totals(memory_mb=96, tasks=12))
    assert "cgroup" in sandbox.describe()["sandbox_total_limit"]
    roomy = SandboxLimits(cpu_s=4, wall_s=8, memory_mb=0, processes=64)  # no per-process limit stops these
    threads = ("import threading, time\nn = 0\nfor _ in range(40):\n    try:\n"
               "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n        n += 1\n"
               "    except RuntimeError:\n        break\nprint(n)\n")
    res = run_python(threads, roomy)
    assert res.ok and int(res.stdout) < 12, res
    res = run_python("x = b'x' * (400 << 20)\nprint(len(x))\n", roomy)
    assert not res.ok and res.returncode == -9, res  # the cgroup's OOM killer


# --------------------------------------------------------------------------- 4g: the tier is logged and described


def test_the_python_tool_logs_its_tier_and_describe_gives_mlflow_params(capsys, monkeypatch):
    from stages.ppo.environments import Python

    monkeypatch.setattr(tiers, "_announced", set())
    Python()
    Python()
    out = capsys.readouterr().out
    assert out.count("python tool: model-written code runs sandboxed") == 1 and sandbox.isolation() in out
    info = sandbox.describe()
    assert set(info) == {"sandbox_tier", "sandbox_interpreter", "sandbox_strong", "sandbox_hides", "sandbox_exposes",
                         "sandbox_total_limit"}
    assert all(isinstance(v, str) and v for v in info.values())


# --------------------------------------------------------------------------- 5: gaming the reward
# tests/test_code_tests.py: the attack corpus (tests/code_corpus.py) and the verdict's parts (issue 67).


# --------------------------------------------------------------------------- 6: extract_code is linear


def test_extract_code_is_linear_on_unclosed_fences():
    # a megabyte of fence openings: the old regex took quadratic time (48 KB: 4 s; this: tens of minutes)
    script = textwrap.dedent("""
        import sys
        from stages.ppo.sandbox import extract_code
        a = "```" * 350_000
        b = "```a" * 250_000 + "\\n"
        c = "```py\\nx\\n" + "`" * 1_000_000
        print(extract_code(a) == a, extract_code(b) == "", extract_code(c)[:1] == "x")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True", "True"], out


_OLD_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.#-]*)[^\n]*\n(.*?)(?:\n[ \t]*)?```", re.DOTALL)


def _old_extract_code(response: str) -> str:  # the regex version it replaces, as the reference on small inputs
    matches = list(_OLD_FENCE.finditer(response))
    blocks = [(m.group(1).lower(), m.group(2)) for m in matches]
    tail = response[matches[-1].end():] if matches else response
    opened = re.search(r"```[ \t]*([A-Za-z0-9_+.#-]*)[^\n]*\n", tail)
    if opened:
        blocks.append((opened.group(1).lower(), tail[opened.end():]))
    if not blocks:
        return response.strip("\n")
    python = [code for tag, code in blocks if tag in {"python", "python3", "py", "py3"}]
    return (python or [code for _, code in blocks])[-1].strip("\n")


def test_extract_code_keeps_the_regex_behaviour():
    import random

    rng = random.Random(48)
    pieces = ["```", "```python", "```py ", "```Text", "\n", "  ", "\t", "x = 1", "`", "``", "a", " ```"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 14)))
        assert extract_code(text) == _old_extract_code(text), repr(text)


@pytest.mark.slow
def test_a_ppo_stage_running_model_code_refuses_a_weak_sandbox_before_training(smoke_upstream, tmp_path):
    """From the command line, as a user meets it: code_tests on a machine where only rlimits works stops the
    stage at its start (exit 2, before Ray or any engine), naming the tier, the fix and the opt-in key. The rule
    is spelled as a module path (issue 59: that spelling used to skip the check; `code_tests` is the unit test's)."""
    from conftest import SMOKE, run_cli

    run_dir = smoke_upstream(tmp_path / "run")
    result = run_cli("run", str(SMOKE), f"run_dir={run_dir}", "--to", "ppo", "stages.sft=null", "stages.reward=null",
                     "stages.ppo.rewards.rule=stages.ppo.sandbox:code_tests", "stages.ppo.rewards.model_weight=0",
                     env={"PIPELINE_SANDBOX": "rlimits"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    for part in ("code_tests reward", "'rlimits'", "bubblewrap", "stages.ppo.sandbox.allow_weak"):
        assert part in result.stderr
    assert "starting 2 vLLM engines" not in result.stdout
    assert not list((run_dir / "artifacts" / "ppo").glob("*/manifest.json"))
