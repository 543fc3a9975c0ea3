"""What the sandbox promises about trust (issue 48; docs/security.md): weak tiers are refused for model-written
code unless the config opts in; the strongest tier shows the code only what the interpreter needs; nothing the
code writes survives it; the processes that launch it are not readable through /proc; all of a process's
sandboxes share one memory and task limit (cgroup); code_tests cannot be gamed by anything the response does in
its own process (issue 59: its verdict is decided outside it); the refusal of a weak tier holds however the rule
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
from stages.ppo.sandbox import cgroup, harness, tiers, verdict
from stages.ppo.sandbox import SandboxLimits, code_tests, extract_code, run_python
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
        paths = ["/etc/passwd", str(Path(__file__).resolve()), str(REPO / "pyproject.toml"), str(outside / "secret.txt"),
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
        code = ("import os\\ntry:\\n    print(b'SBX_SECRET_MARK' in open('/proc/%d/environ' % os.getppid(), 'rb').read())"
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


# --------------------------------------------------------------------------- 5: gaming the reward (issues 48, 59)


WRONG_ADD = "def add(a, b):\n    return a - b\n"
LISTS = {"test_list": ["assert rev_list([1, 2]) == [2, 1]", "assert rev_list([]) == []"]}
ALWAYS_EQUAL = "class E:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
# forges well-formed records (verdict.RECORD) claiming 5 for every probe, as a response that read the harness's
# frame would, then leaves before the harness writes its own
FORGE = ("def forge(n):\n    import os\n    for k in range(n):\n"
         "        os.write(1, ('\\n\\x1ecode_tests %d [\"int\", \"5\"]\\n' % k).encode())\n"
         "    os.write(1, ('\\n\\x1ecode_tests end %d\\n' % n).encode())\n    os._exit(0)\n")
GAMES = {  # name: (response, row); every one scores 0
    "sys.exit": (WRONG_ADD + "import sys\nsys.exit(0)\n", ADD),
    "raise SystemExit": (WRONG_ADD + "raise SystemExit(0)\n", ADD),
    "os._exit": (WRONG_ADD + "import os\nos._exit(0)\n", ADD),
    "sys.exit in the call": ("def add(a, b):\n    import sys\n    sys.exit(0)\n", ADD),
    "atexit": (WRONG_ADD + "import atexit, os\natexit.register(lambda: os._exit(0))\n", ADD),
    "excepthook": (WRONG_ADD + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n", ADD),
    "always equal": (ALWAYS_EQUAL + "def add(a, b):\n    return E()\n", ADD),
    "always equal int": ("class E(int):\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = int.__hash__\ndef add(a, b):\n    return E(0)\n", ADD),
    "truthy": ("class T:\n    def __bool__(self):\n        return True\n"
               "    def __eq__(self, other):\n        return self\ndef add(a, b):\n    return T()\n", ADD),
    "stdout hook": (WRONG_ADD + "import sys, os\nclass W:\n    def write(self, s):\n        os._exit(0)\n"
                    "    def flush(self):\n        os._exit(0)\nsys.stderr = sys.stdout = W()\n", ADD),
    # issue 59: the three attacks that scored 1.0 against the same-process harness
    "builtins.exec no-op": (WRONG_ADD + "import builtins\nbuiltins.exec = lambda *a, **k: None\n", ADD),
    "builtins.eval and compile": (WRONG_ADD + "import builtins\nbuiltins.eval = lambda *a, **k: 5\n"
                                  "builtins.compile = lambda *a, **k: None\n", ADD),
    "builtins.all": (ALWAYS_EQUAL + "def rev_list(x):\n    return [E()] * len(x)\nimport builtins\n"
                     "builtins.all = lambda it: True\n", LISTS),
    "the secret's descriptor": ("import os\ns = os.read(3, 100).strip()\nos.write(1, s + b':3\\n')\nos._exit(0)\n", ADD),
    "the harness's frame (its secret)": (WRONG_ADD + "import os, sys\nloc = sys._getframe(1).f_locals\n"
                                         "n = str(len(loc.get('compiled', '...'))).encode()\n"
                                         "s = os.read(loc['secret_fd'], 100).strip()\n"
                                         "os.write(1, b'\\n' + s + b':' + n + b'\\n')\nos._exit(0)\n", ADD),
    "the harness's frame": (FORGE + "import sys\nf = sys._getframe(1)\nprint(sorted(f.f_locals))\n"
                            "forge(f.f_locals.get('probes', 3))\n", ADD),
    "an excepthook reading frames": (FORGE + "import sys\ndef hook(t, e, tb):\n    forge(3)\n"
                                     "sys.excepthook = hook\ndef add(a, b):\n    raise ValueError(a)\n", ADD),
    "forged records before the real ones": (WRONG_ADD + "import os\nfor k, v in enumerate((5, 0, 30)):\n"
                                            "    os.write(1, b'\\x1ecode_tests %d [\"int\", \"%d\"]\\n' % (k, v))\n", ADD),
    "a patched encoder": (WRONG_ADD + "import json\njson.dumps = lambda *a, **k: '[\"int\", \"5\"]'\n", ADD),
    # what docs/security.md listed as undefended before issue 59
    "__sub__ under abs": ("class Z:\n    def __sub__(self, o):\n        return 0.0\ndef area(r):\n    return Z()\n",
                          {"test": "assert abs(area(1) - 3.14) < 0.01"}),
    "__str__": ("class S:\n    def __str__(self):\n        return 'abc'\ndef f():\n    return S()\n",
                {"test": "assert str(f()) == 'abc'"}),
    "__float__ in math.isclose": ("class F:\n    def __float__(self):\n        return 0.3\n"
                                  "def f():\n    return F()\n",
                                  {"test": "assert math.isclose(f(), 0.3)", "test_imports": ["import math"]}),
    "math.isclose patched": ("import math\nmath.isclose = lambda *a, **k: True\ndef f():\n    return 0\n",
                             {"test": "assert math.isclose(f(), 0.3)", "test_imports": ["import math"]}),
    "a builtin shadowed": ("def sorted(x):\n    return [1, 2]\ndef f():\n    return []\n",
                           {"test": "assert sorted(f()) == [1, 2]"}),
    "set patched": ("import builtins\nbuiltins.set = lambda *a: {4}\ndef sim(a, b):\n    return ()\n",
                    {"test": "assert set(sim((3, 4), (4, 5))) == set((4,))"}),
}


@pytest.mark.parametrize("game", list(GAMES))
def test_a_response_gaming_code_tests_scores_zero(game, monkeypatch):
    monkeypatch.setattr(harness, "LIMITS", LIMITS)
    response, row = GAMES[game]
    assert code_tests("", response, row) == 0.0


# Row shapes of MBPP-style data, each with a reference solution (scores 1) and a wrong one (scores 0): decided in
# the caller (== a literal, truth), in the judge's run (set(...), math.isclose, <, in, len, a setup name), a
# generator under list(), the response's own import as the function under test, a class of the response as an
# argument.
SHAPES = [
    ("assert freq([1, 1, 2]) == {1: 2, 2: 1}", "import collections\ndef freq(xs):\n    return collections.Counter(xs)",
     "def freq(xs):\n    return {1: 2}"),
    ("assert avg([2, 4]) == 3", "def avg(xs):\n    return sum(xs) / len(xs)", "def avg(xs):\n    return 3.5"),
    ("assert f() == True", "def f():\n    return True", "def f():\n    return 1"),
    (["assert f() == [1, (2, 'x')]", "assert not f() == []", "assert f()"], "def f():\n    return [1, (2, 'x')]",
     "def f():\n    return [1, [2, 'x']]"),
    ("assert math.isclose(f(), 0.3, rel_tol=1e-9)", "def f():\n    return 0.1 + 0.2", "def f():\n    return 0.31"),
    ("assert set(sim((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
     "def sim(a, b):\n    return tuple(set(a) & set(b))", "def sim(a, b):\n    return (4,)"),
    ("assert list(g(3)) == [0, 1, 4]", "def g(n):\n    return (i * i for i in range(n))", "def g(n):\n    return [0, 1]"),
    ("assert sorted(g(3)) == ['0', '1', '2']", "def g(n):\n    return map(str, range(n))", "def g(n):\n    return 'x'"),
    ("assert chain([Pair(5, 24), Pair(15, 25)], 2) == 1",
     "class Pair:\n    def __init__(s, a, b):\n        s.a, s.b = a, b\ndef chain(ps, n):\n    return n - 1",
     "class Pair:\n    def __init__(s, a, b):\n        pass\ndef chain(ps, n):\n    return n"),
    ("assert f(K) == 4", "def f(x):\n    return x * 2", "def f(x):\n    return x + 1"),
    ("assert f(1) == 2\nassert f(2) == 4\nassert f(3) != 5", "def f(x):\n    return x * 2", "def f(x):\n    return 2"),
    (["assert is_p(7)", "assert not is_p(4)", "assert is_p(3) == True"], "def is_p(n):\n    return n in (2, 3, 5, 7)",
     "def is_p(n):\n    return True"),
    ("assert gcd(12, 8) == 4", "from math import gcd", "from math import lcm as gcd"),
    (["assert f(3) < 4", "assert f('a') in 'abc'", "assert abs(f(3.0) - 3) < 1e-9", "assert len(f([1])) == 1"],
     "def f(x):\n    return x", "def f(x):\n    return x * 2"),
    (["assert f(3)[0] == 3", "assert f(1) == dict(a=1) or f(1) == [1]"], "def f(x):\n    return [x]",
     "def f(x):\n    return (x,)"),
]


@pytest.mark.parametrize("tests, right, wrong", SHAPES, ids=[str(i) for i in range(len(SHAPES))])
def test_honest_answers_still_score_by_their_tests(tests, right, wrong, monkeypatch):
    monkeypatch.setattr(harness, "LIMITS", LIMITS)
    row = {"tests": tests, "test_setup_code": "K = 2"}
    assert code_tests("", right, row) == 1.0
    assert code_tests("", wrong, row) == 0.0
    printing = right + "\nprint('hello', end='')\nif __name__ == '__main__':\n    print(repr(1))\n"
    assert code_tests("", printing, row) == 1.0  # its own output (even without a newline) does not matter


def test_the_responses_run_never_holds_an_expected_value():
    row = {"test_list": ["assert add(2, 3) == 987654321", "assert set(add(1, 1)) == {123456789}"]}
    program = sandbox.program_for(ADD["code"], row)
    assert "add(2, 3)" in program and "987654321" not in program and "123456789" not in program
    plan = verdict.split("", row["test_list"], ADD["code"])
    assert [c.kind for c in plan.checks] == ["equal", "judge"] and plan.checks[0].expected == 987654321
    assert "123456789" in harness.judge_for("", plan, [["int", "5"], ["int", "2"]])  # the judge's run, no response


def test_records_are_accepted_only_whole_numbered_and_in_order():
    ok = ("x\n\x1ecode_tests 0 [\"int\", \"5\"]\nnoise\x1ecode_tests 9\n\x1ecode_tests 1 [\"str\", \"a\"]\n"
          "\x1ecode_tests end 2\n")
    assert verdict.records(ok, 2) == [["int", "5"], ["str", "a"]]
    for bad in (ok.replace("end 2", "end 3"), ok.replace(" 1 [", " 0 ["), "\x1ecode_tests 0 [\"int\", \"5\"]\n" + ok,
                ok.replace("\x1ecode_tests end 2\n", ""), ok.replace('["str", "a"]', '["object", "a"]'),
                ok.replace('["str", "a"]', '["set", [["list", []]]]')):
        assert verdict.records(bad, 2) is None, bad
    assert verdict.records(ok, 3) is None


def test_a_test_that_cannot_be_split_is_an_error_naming_it():
    for test in ("assert all(f(i) == i for i in range(3))", "x = f(3)\nassert x == 3", "assert f(("):
        with pytest.raises(ValueError, match="test 1"):
            code_tests("", "def f(x):\n    return x", {"test": test})


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
