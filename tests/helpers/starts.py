"""The start-up allowance: each test module declares the costly starts it makes, and may not make more.

On 2 cores the suite's time is mostly start-ups: a pipeline run, a local Ray, a Ray Train worker group,
a vLLM engine, a Serve deployment each cost seconds. A module declares what it starts:

    STARTS = {"pipelines": 2, "ray": 1, "train_groups": 2, "vllm_engines": 1, "serve_deployments": 0}

(missing kinds are 0; a module without STARTS may start nothing). The code that starts each of these
writes a line to the file PIPELINE_START_LEDGER names (`pipeline.events.record_start`), from whichever
process starts it: pytest itself, a `python -m pipeline` it runs, a Ray actor. This plugin sets that
variable before any test runs (every process the suite starts inherits it), and after a module's last
test reads the lines written while the module ran. A module that started more than it declares fails
(an error in its last test's teardown), naming the kind, the count and the allowance. Raising an
allowance is then a visible edit in the commit that needs it; a time is never asserted.

What a session fixture starts (the shared smoke run, the session's Ray) is the suite's, not the module
that happened to ask for it first: the lines written while a session fixture is being set up are
counted apart and printed as `shared`. The summary prints each module's starts against its allowance.

Limits: windows are times, so a start made by a process that outlives its test (an actor Ray restarts
after a fault drill) counts in whichever module runs then; a child started with an environment of its
own, without the variable, is not counted (the cron test passes it on).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.events import START_KINDS, START_LEDGER

_STATE = pytest.StashKey[dict]()


def pytest_configure(config):
    # Before collection, so that every process the suite starts (Ray's included) inherits the variable.
    created = START_LEDGER not in os.environ
    if created:
        fd, path = tempfile.mkstemp(prefix="pipeline-starts-", suffix=".jsonl")
        os.close(fd)
        os.environ[START_LEDGER] = path
    config.stash[_STATE] = {"shared": [], "begun": {}, "counts": {}, "path": Path(os.environ[START_LEDGER]),
                            "created": created, "t0": time.time(), "last": None}


def pytest_unconfigure(config):
    state = config.stash.get(_STATE, None)
    if state is not None and state["created"]:
        os.environ.pop(START_LEDGER, None)
        state["path"].unlink(missing_ok=True)


def read_ledger(path: Path) -> list[dict]:
    """Every start recorded so far (a line cut short by a dying process is skipped)."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def count(lines: list[dict], begin: float, end: float, shared: list[tuple[float, float]]) -> Counter:
    """Starts per kind written in [begin, end], outside every shared (session fixture) window."""
    counts: Counter = Counter()
    for line in lines:
        t = line.get("t", 0)
        if begin <= t <= end and not any(a <= t <= b for a, b in shared):
            counts[line.get("kind", "?")] += int(line.get("n", 1))
    return counts


def allowance(module) -> tuple[dict[str, int], str | None]:
    """(kind -> allowed starts, problem): a module's STARTS, checked."""
    declared = getattr(module, "STARTS", {}) or {}
    unknown = sorted(set(declared) - set(START_KINDS))
    if unknown:
        return (dict.fromkeys(START_KINDS, 0),
                f"STARTS names {', '.join(unknown)}; the kinds are {', '.join(START_KINDS)}")
    return {k: int(declared.get(k, 0)) for k in START_KINDS}, None


def over(counts: Counter, allowed: dict[str, int]) -> list[str]:
    """The kinds a module started more of than it declares, spelled for the failure."""
    return [f"{kind}: started {counts[kind]}, declares {allowed.get(kind, 0)}"
            for kind in sorted(counts) if counts[kind] > allowed.get(kind, 0)]


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope != "session":
        return (yield)
    begin = time.time()
    try:
        return (yield)
    finally:
        request.config.stash[_STATE]["shared"].append((begin, time.time(), fixturedef.argname))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # A module's window opens at the first of its tests in a row (a run order that splits a module, --ff or a
    # random order, gives it one window per run of its tests; the counts add up).
    state, module = item.config.stash[_STATE], item.nodeid.split("::")[0]
    if state["last"] != module:
        state["begun"][module] = time.time()
        state["last"] = module


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)  # module fixtures are torn down by now if this is the module's last test
    finally:
        module = item.nodeid.split("::")[0]
        if nextitem is None or nextitem.nodeid.split("::")[0] != module:
            _check(item, module)


def _check(item, module: str) -> None:
    state = item.config.stash[_STATE]
    state["last"] = None
    windows = [(a, b) for a, b, _ in state["shared"]]
    begun = state["begun"].get(module)
    if begun is None:  # its set-up never reached this plugin: nothing of it to count
        return
    counts = count(read_ledger(state["path"]), begun, time.time(), windows)
    allowed, problem = allowance(item.module)
    counts += state["counts"].get(module, (Counter(), allowed))[0]  # its earlier windows, if split
    state["counts"][module] = (counts, allowed)
    if problem:
        pytest.fail(f"{module}: {problem} (tests/helpers/starts.py)", pytrace=False)
    excess = over(counts, allowed)
    if excess:
        pytest.fail(f"{module} started more than its STARTS allowance ({'; '.join(excess)}): share a run that "
                    "already exists (docs/development.md), or raise STARTS in the commit that needs it",
                    pytrace=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = config.stash[_STATE]
    lines = [line for line in read_ledger(state["path"]) if line.get("t", 0) >= state["t0"]]  # this run's
    rows = [(m, c, a) for m, (c, a) in state["counts"].items() if sum(c.values()) or any(a.values())]
    if not rows and not lines:
        return
    terminalreporter.section("starts per module (started/allowed; tests/helpers/starts.py)")
    for module, counts, allowed in sorted(rows):
        cells = ", ".join(f"{k} {counts[k]}/{allowed[k]}" for k in START_KINDS if counts[k] or allowed[k])
        terminalreporter.write_line(f"{module}: {cells}")
    shared, names = Counter(), set()
    for line in lines:  # each line once, however the session fixtures' set-ups nest
        inside = [name for a, b, name in state["shared"] if a <= line.get("t", 0) <= b]
        if inside:
            shared[line.get("kind", "?")] += int(line.get("n", 1))
            names.update(inside)
    if shared:
        terminalreporter.write_line(f"shared ({', '.join(sorted(names))}): " +
                                    ", ".join(f"{k} {shared[k]}" for k in START_KINDS if shared[k]))
    total = Counter()
    for line in lines:
        total[line.get("kind", "?")] += int(line.get("n", 1))
    terminalreporter.write_line("whole run: " + ", ".join(f"{k} {total[k]}" for k in START_KINDS if total[k]))
