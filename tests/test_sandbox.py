"""The code-execution sandbox (stages/ppo/sandbox/): MBPP-style rows score 1 for a correct solution and 0
for a wrong one, and hostile responses (a busy loop, a sleep, a fork bomb, a daemon, writes outside the working
directory, a socket, 50 MB of output, a 2 GB allocation) score 0 within the wall clock plus a small margin and
leave no process behind. Every isolation tier this machine has is run (PIPELINE_SANDBOX forces one), on the
hostile cases that tier claims to stop (module docstring): the cases are generated per tier, not skipped. No Ray."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from stages.ppo import sandbox
from stages.ppo.sandbox import harness
from stages.ppo.sandbox import SandboxLimits, code_tests, extract_code, run_python
from helpers.sandbox_tiers import WORKING

SAMPLE = [json.loads(line) for line in (Path(__file__).parent / "helpers" / "mbpp_sample.jsonl").open()]
LIMITS = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, output_bytes=65536, processes=8)
MARGIN_S = 1.0  # start-up, the kill and the clean-up, on a shared 2-core machine
MARK = "sbx_hostile"  # hostile programs rename themselves (and so their children) to this, to find leftovers
RENAME = f"open('/proc/self/comm', 'w').write({MARK!r})\n"
ADD = SAMPLE[0]["code"] + "\n"

# what each tier stops (the module docstring): the hostile cases beyond the basics
FULL = {"fork", "daemon", "write", "socket"}
STOPS = {"bwrap+rlimits+uid": FULL, "unshare+rlimits+uid": FULL,
         "bwrap+rlimits": {"write", "socket"} | ({"fork", "daemon"} if os.geteuid() != 0 else set()),
         "userns-net+rlimits": {"socket"}, "rlimits": set()}




def stopping(case: str) -> list[str]:
    """The working tiers that claim to stop `case`."""
    return [t for t in WORKING if case in STOPS[t]]


@pytest.fixture
def tier(request, monkeypatch):
    monkeypatch.setenv(sandbox.ENV_VAR, request.param)
    monkeypatch.setenv(sandbox.ALLOW_ENV, "1")  # weak tiers too: each is tested on what it claims to stop
    # ... whatever an earlier in-process ppo stage permitted this process (`tiers.permit`, which outranks the variable)
    monkeypatch.setattr(sandbox.tiers, "_permitted", None)
    monkeypatch.setattr(harness, "LIMITS", LIMITS)
    yield request.param
    assert _marked() == [], "a hostile program's processes outlived its run"


def _marked() -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                comm = Path(f"/proc/{entry.name}/comm").read_text().strip()
                state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if comm == MARK and state != "Z":
                pids.append(int(entry.name))
    return pids


def _timed_score(response: str, row: dict) -> float:
    start = time.monotonic()
    score = code_tests("", response, row)
    elapsed = time.monotonic() - start
    assert elapsed <= LIMITS.wall_s + MARGIN_S, f"took {elapsed:.2f}s"
    return score


def test_the_strongest_isolation_works_here_and_every_hostile_case_is_run():
    # bwrap is installed by `make setup` (or, as root without it, unshare and a fresh uid): every hostile case
    # then runs on at least one tier, none of them is left untested on this machine
    assert WORKING and all(stopping(case) for case in FULL), WORKING


def test_isolation_uses_bwrap_where_installed(monkeypatch):
    monkeypatch.delenv(sandbox.ENV_VAR, raising=False)
    name = sandbox.isolation()
    assert name in sandbox.TIERS
    if __import__("shutil").which("bwrap"):
        assert name.startswith("bwrap")


@pytest.mark.parametrize("tier", WORKING, indirect=True)
def test_correct_and_wrong_solutions(tier):
    wrong = {"add": "def add(a, b):\n    return a - b", "is_even": "def is_even(n):\n    return n % 2 == 1",
             "rev": "def rev(s):\n    return s"}
    for row in SAMPLE:
        fenced = f"Here is my solution:\n```python\n{row['code']}\n```\nIt is short."
        assert code_tests(row["text"], fenced, row) == 1.0
        name = row["code"].split("(")[0].removeprefix("def ")
        assert code_tests(row["text"], wrong[name], row) == 0.0
        assert code_tests(row["text"], "I don't know.", row) == 0.0
    # the other row formats: `tests` as one newline-joined string, `test` alone, setup code; a row without tests
    # is the reward's error naming it (nothing to check is never a pass)
    tests = "\n".join(SAMPLE[0]["test_list"])
    assert code_tests("", ADD, {"tests": tests}) == 1.0
    assert code_tests("", ADD, {"test": "assert add(1, 1) == 2"}) == 1.0
    assert code_tests("", ADD, {"tests": ["assert add(K, 1) == 3"], "test_setup_code": "K = 2"}) == 1.0
    with pytest.raises(ValueError, match="row 7: it has no tests"):
        code_tests("", ADD, {"answer": "5", "task_id": 7})


@pytest.mark.parametrize("tier", WORKING, indirect=True)
def test_busy_loop(tier):
    assert _timed_score(RENAME + ADD + "while True:\n    pass\n", SAMPLE[0]) == 0.0
    res = run_python("while True:\n    pass\n", LIMITS)
    assert not res.ok and res.error in ("cpu", "timeout", "killed (SIGKILL)")


@pytest.mark.parametrize("tier", WORKING, indirect=True)
def test_sleep_hits_the_wall_clock(tier):
    start = time.monotonic()
    res = run_python(RENAME + "import time\ntime.sleep(60)\n", LIMITS)
    assert time.monotonic() - start <= LIMITS.wall_s + MARGIN_S
    assert res.timed_out and not res.ok and res.error == "timeout"


@pytest.mark.parametrize("tier", stopping('fork'), indirect=True)
def test_fork_bomb(tier):
    bomb = RENAME + "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    assert _timed_score(ADD + bomb, SAMPLE[0]) == 0.0
    assert _marked() == []  # every forked child is gone once the call returns


@pytest.mark.parametrize("tier", stopping('daemon'), indirect=True)
def test_daemon_does_not_outlive_the_run(tier):
    daemon = RENAME + ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                       "        time.sleep(60)\n    os._exit(0)\n")
    start = time.monotonic()
    assert code_tests("", ADD + daemon, SAMPLE[0]) == 1.0  # it passes its tests, so its main process exits 0
    assert time.monotonic() - start < LIMITS.wall_s  # the sleeping grandchild does not stretch the run
    assert _marked() == []


@pytest.mark.parametrize("tier", stopping('write'), indirect=True)
def test_write_outside_its_directory(tier, tmp_path):
    target = tmp_path / "escaped.txt"
    assert _timed_score(ADD + f"open({str(target)!r}, 'w').write('pwned')\n", SAMPLE[0]) == 0.0
    assert not target.exists()
    # /tmp is writable by anyone on the host; the sandbox's /tmp is its own (scored by its tests alone)
    shared = Path("/tmp") / f"sbx-escape-{uuid.uuid4().hex}"
    _timed_score(ADD + f"open({str(shared)!r}, 'w').write('pwned')\n", SAMPLE[0])
    assert not shared.exists()


@pytest.mark.parametrize("tier", stopping('socket'), indirect=True)
def test_socket_to_a_local_listener(tier):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = ADD + f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
        assert _timed_score(code, SAMPLE[0]) == 0.0
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing connected (a completed handshake would be queued here)
            listener.accept()


@pytest.mark.parametrize("tier", WORKING, indirect=True)
def test_50_mb_of_output(tier):
    start = time.monotonic()
    res = run_python("import sys\nsys.stdout.write('x' * 50_000_000)\n", LIMITS)
    assert time.monotonic() - start <= LIMITS.wall_s + MARGIN_S
    assert res.output_truncated and not res.ok and res.error == "output limit"
    assert len(res.stdout.encode()) <= LIMITS.output_bytes
    # code_tests: the response's own output goes to /dev/null (it cannot matter, nor fill the caller); 50 MB on
    # the descriptor its answers travel on stops the run at the output cap
    assert _timed_score(ADD + "print('y' * 50_000_000)\n", SAMPLE[0]) == 1.0
    flood = "import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'y' * 50_000_000)\n" \
            "    except OSError:\n        pass\n"
    assert _timed_score(ADD + flood, SAMPLE[0]) == 0.0


@pytest.mark.parametrize("tier", WORKING, indirect=True)
def test_memory_hog(tier):
    start = time.monotonic()
    res = run_python("x = bytearray(2 * 1024 ** 3)\n", LIMITS)
    assert time.monotonic() - start <= LIMITS.wall_s + MARGIN_S
    assert not res.ok and res.error == "memory", res
    assert _timed_score(ADD + "x = bytearray(2 * 1024 ** 3)\n", SAMPLE[0]) == 0.0


def test_run_python_result():
    res = run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n", LIMITS)
    assert (res.ok, res.returncode, res.stdout, res.stderr, res.error) == (False, 3, "out\n", "err\n", "nonzero exit")
    assert not res.timed_out and not res.output_truncated and 0 < res.wall_s < LIMITS.wall_s
    assert run_python("print(sum(range(10)))", LIMITS).stdout == "45\n"


def test_extract_code():
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1"
    assert extract_code("Sure:\n```python\nx = 1\n```\nthen\n```python\nx = 2\n```\nDone.") == "x = 2"
    assert extract_code("```python\nx = 1\n```\n```text\noutput\n```") == "x = 1"  # python beats a later block
    assert extract_code("Try:\n```\ny = 3\n```\n") == "y = 3"  # no python block: any fenced block
    assert extract_code("```Python3\nz = 4\n```") == "z = 4"
    assert extract_code("```py\na = 1\n```\nand\n```python\nb = 2") == "b = 2"  # cut off at the token limit
    assert extract_code("no code here") == "no code here"
