"""Tiers: which end-to-end scenarios a run may leave out, and why (docs/development.md, "Tiers").

Every scenario stays in the suite. Those too slow to run on every change (fault drills, end-to-end
variants) carry a tier and the code they cover:

    pytestmark = pytest.mark.tier("faults", covers=("pipeline/cluster.py", "stages/common/training.py"))

- `pytest` alone, or `--tiers=all` (`make test-all`), runs every test.
- `--tiers=changed` (`make test`, so CI's `.ci/run`) runs the base tier (every test without a tier)
  and each tiered test whose covered code changed since the last recorded full pass. A test's
  own module, `tests/conftest.py`, `tests/helpers/` and the installed packages (`pyproject.toml`,
  `scripts/setup.sh`) count as covered by every tiered test: changing them runs every tier.
  Without a record, or with a record whose commit is not in this checkout's history, every tier runs.
- `--record-full-pass` (`make test-all`) writes `tests/full_pass.json` when every collected test ran
  and passed on a checkout without uncommitted changes: the commit, the date, the wall time and the
  machine's calibration. Committing that file is the record CI reads.
- Each test left out is listed, with the reason, before pytest's closing summary line.
- A tiered test that declares no covered code, or a path that does not exist, fails (a scenario
  whose covered code can never change would never run again).

Why git and a committed record, not a cache: a reader (and CI's clean clone) can audit the decision
with `git diff --stat <commit>` against the record's commit, nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

RECORD = Path("tests") / "full_pass.json"
# Changing any of these changes what every tiered test runs: the suite's shared fixtures and helpers, the
# config every scenario starts from, how the suite is run, and the packages installed.
COVERED_BY_ALL = ("tests/conftest.py", "tests/helpers/", "configs/smoke.yaml", "Makefile", ".ci/", "pyproject.toml",
                  "scripts/setup.sh")
TIERS = ("faults", "e2e")


@dataclass(frozen=True)
class Record:
    commit: str
    date: str


def pytest_addoption(parser):
    group = parser.getgroup("tiers", "scenario tiers (docs/development.md)")
    group.addoption("--tiers", choices=("all", "changed"), default="all",
                    help="all: every test (the default); changed: the base tier and the tiered tests whose "
                         "covered code changed since the recorded full pass (make test, CI)")
    group.addoption("--record-full-pass", action="store_true",
                    help="write tests/full_pass.json if every test ran and passed on a clean checkout (make test-all)")


def pytest_configure(config):
    config.addinivalue_line("markers", "tier(name, covers=(paths...)): a scenario left out of `make test` "
                                       "unless its covered code changed since the recorded full pass")
    config.stash[_STATE] = {"skipped": [], "problems": {}, "note": None, "clean": None, "head": None,
                            "started": time.time(), "deselected": 0, "collected": 0, "applied": False}
    if config.getoption("record_full_pass"):
        config.stash[_STATE]["clean"] = uncommitted(config.rootpath)
        config.stash[_STATE]["head"] = _git(config.rootpath, "rev-parse", "HEAD").stdout.strip()


_STATE = pytest.StashKey[dict]()


# --------------------------------------------------------------------------- pure decisions
def tier_of(item) -> tuple[str, tuple[str, ...]] | None:
    """(tier, covers) of a test, or None for the base tier."""
    marker = item.get_closest_marker("tier")
    if marker is None:
        return None
    name = marker.args[0] if marker.args else marker.kwargs.get("name", "")
    return name, tuple(marker.kwargs.get("covers", ()))


def problem(tier: str, covers: tuple[str, ...], root: Path) -> str | None:
    """Why a tier declaration is unusable, or None."""
    if tier not in TIERS:
        return f"tier {tier!r} is not one of {', '.join(TIERS)}"
    if not covers:
        return (f"tier {tier!r} declares no covered code: name the files or folders it exercises, "
                "pytest.mark.tier(..., covers=('stages/ppo/', ...))")
    for path in covers:
        target = root / path
        if os.path.isabs(path) or os.path.normpath(path) != path.rstrip("/"):
            return f"covers {path!r}: name it relative to the repository's root, as git does (stages/ppo/rl.py)"
        if not target.exists():
            return f"covers {path}, which does not exist (renamed? name the code it exercises now)"
        if target.is_dir() != path.endswith("/"):
            return (f"covers {path!r}: a folder ends with '/' and a file does not "
                    f"({'stages/ppo/' if target.is_dir() else 'stages/ppo/rl.py'})")
    return None


def touched(covers: tuple[str, ...], module: str, changed: set[str]) -> list[str]:
    """The changed files among what a tiered test covers (its own module and COVERED_BY_ALL included)."""
    watched = (*covers, module, *COVERED_BY_ALL)
    return sorted(f for f in changed if any(f == w or (w.endswith("/") and f.startswith(w)) for w in watched))


# --------------------------------------------------------------------------- git
def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    """git in the checkout, without a calling hook's GIT_DIR/GIT_INDEX_FILE (which would point it elsewhere);
    a missing git answers like a failing one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, env=env)
    except OSError as exc:
        return subprocess.CompletedProcess(["git", *args], 127, "", str(exc))


def read_record(root: Path) -> Record | None:
    try:
        data = json.loads((root / RECORD).read_text())
        return Record(commit=data["commit"], date=data["date"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def changed_since(root: Path, commit: str) -> set[str] | str:
    """Files that differ from `commit` in the working tree (committed or not, untracked included), or why
    that cannot be known. Renames count as both paths: a file moved out of a covered folder changed it."""
    repo = _git(root, "rev-parse", "--git-dir")
    if repo.returncode:
        return f"git cannot read this checkout ({repo.stderr.strip()[:200]})"
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode:
        return f"the recorded full pass {commit[:10]} is not in this checkout's history"
    ancestor = _git(root, "merge-base", "--is-ancestor", commit, "HEAD")
    if ancestor.returncode == 1:
        return f"the recorded full pass {commit[:10]} is not in this checkout's history"
    if ancestor.returncode:
        return f"git could not compare with the recorded full pass {commit[:10]} ({ancestor.stderr.strip()[:200]})"
    diff = _git(root, "diff", "--name-only", "--no-renames", "-z", commit)
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--full-name", "-z")
    if diff.returncode or untracked.returncode:
        return f"git diff failed ({(diff.stderr or untracked.stderr).strip()[:200]})"
    return {name for name in (diff.stdout + untracked.stdout).split("\0") if name}


def uncommitted(root: Path) -> list[str]:
    """What `git status` shows, the record itself aside (a failing git counts as not clean)."""
    status = _git(root, "status", "--porcelain")
    if status.returncode:
        return ["(git status failed)"]
    return [line[3:] for line in status.stdout.splitlines() if line[3:] != str(RECORD)]


def applied(config) -> bool:
    """Whether `--tiers=changed` compared with a full-pass record (and so may have left tests out); False
    when it ran every tier for want of one."""
    state = config.stash.get(_STATE, None)
    return bool(state and state["applied"])


# --------------------------------------------------------------------------- hooks
@pytest.hookimpl(trylast=True)  # after -m and -k: what they remove is not this plugin's to list
def pytest_collection_modifyitems(session, config, items):
    state, root = config.stash[_STATE], config.rootpath
    for item in items:
        declared = tier_of(item)
        if declared:
            why = problem(*declared, root)
            if why:
                state["problems"][item.nodeid] = why
    if config.getoption("tiers") != "changed":
        return
    record = read_record(root)
    changed = changed_since(root, record.commit) if record else f"no full pass recorded ({RECORD})"
    if isinstance(changed, str):
        state["note"] = f"every tier runs: {changed}"
        return
    state["applied"] = True
    keep, drop = [], []
    for item in items:
        declared = tier_of(item)
        if declared is None or item.nodeid in state["problems"]:
            keep.append(item)
            continue
        tier, covers = declared
        hits = touched(covers, item.nodeid.split("::")[0], changed)
        if hits:
            keep.append(item)
        else:
            drop.append(item)
            state["skipped"].append((item.nodeid, f"tier {tier}: covers {', '.join(covers)}, unchanged since "
                                                  f"{record.commit[:10]} (full pass {record.date})"))
    state["note"] = (f"tiers: {len(drop)} tiered test(s) not run, {sum(tier_of(i) is not None for i in keep)} run "
                     f"(code changed since the full pass {record.commit[:10]}, {record.date}: {len(changed)} file(s))")
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    state = session.config.stash.get(_STATE, None)
    if state is not None:
        state["collected"] = len(session.items)


def pytest_deselected(items):
    if items:
        state = items[0].config.stash.get(_STATE, None)
        if state is not None:
            state["deselected"] += len(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    why = item.config.stash[_STATE]["problems"].get(item.nodeid)
    if why:
        pytest.fail(f"{item.nodeid}: {why} (tests/helpers/tiers.py)", pytrace=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = config.stash[_STATE]
    if state["skipped"] or state["note"]:
        terminalreporter.section("tiers")
        for nodeid, why in state["skipped"]:
            terminalreporter.write_line(f"not run: {nodeid} ({why})")
        if state["note"]:
            terminalreporter.write_line(state["note"])
    if config.getoption("record_full_pass"):
        terminalreporter.write_line(_record(config, exitstatus, state))


def _record(config, exitstatus, state) -> str:
    """Write the full-pass record, or say why not."""
    root = config.rootpath
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    passed = len([r for r in stats.get("passed", []) if getattr(r, "when", "call") == "call"])
    skipped = [getattr(r, "nodeid", "?") for r in stats.get("skipped", [])]
    if exitstatus != 0 or stats.get("failed") or stats.get("error") or reporter is None:
        return f"full pass not recorded: the run did not pass (exit {int(exitstatus)})"
    if skipped:
        return f"full pass not recorded: {len(skipped)} test(s) skipped ({', '.join(skipped[:5])})"
    opt = config.option
    if state["deselected"] or config.getoption("markexpr") or config.getoption("keyword") or \
            config.args_source != pytest.Config.ArgsSource.TESTPATHS or opt.collectonly or opt.setuponly or \
            opt.setupplan or getattr(opt, "ignore", None) or getattr(opt, "ignore_glob", None):
        return "full pass not recorded: only part of the suite ran (a path, -k, -m, --ignore, a deselection)"
    if stats.get("xfailed") or stats.get("xpassed") or passed != state["collected"] or not passed:
        return f"full pass not recorded: {passed} of {state['collected']} collected tests passed"
    if state["clean"]:
        return f"full pass not recorded: uncommitted changes when the run started ({', '.join(state['clean'][:5])})"
    head = _git(root, "rev-parse", "HEAD").stdout.strip()
    if head != state["head"] or uncommitted(root) or not head:
        return "full pass not recorded: the checkout changed while the suite ran (HEAD or the files)"
    wall = time.time() - state["started"]
    payload = {"commit": head, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "passed": passed,
               "wall_s": round(wall), **config.stash.get(CALIBRATION, {})}
    (root / RECORD).write_text(json.dumps(payload, indent=1) + "\n")
    return f"full pass recorded in {RECORD} at {head[:10]}: commit that file, and CI runs only what changes after it"


# conftest stores the run's calibration here (bench/machine.py), so the record carries the machine's speed.
CALIBRATION = pytest.StashKey[dict]()
