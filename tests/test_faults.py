"""The fault drills' one hook (pipeline/faults.py; issue 69, item 4): every drill is named in DRILLS, an unknown
name is a loud KeyError rather than a drill that never fires, a malformed number names its variable, and the
message the resume tests match is the one `inject` raises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline import faults

ROOT = Path(__file__).resolve().parents[1]


def test_unknown_drill_is_a_key_error_naming_the_drills():
    with pytest.raises(KeyError, match="AFTER_STEP"):
        faults.value("AFTER_STPE")


def test_number_reads_the_setting_and_defaults_when_off(monkeypatch):
    monkeypatch.delenv("PIPELINE_FAULT_AFTER_STEP", raising=False)
    assert faults.number("AFTER_STEP", 0) == 0
    monkeypatch.setenv("PIPELINE_FAULT_AFTER_STEP", "3")
    assert faults.number("AFTER_STEP", 0) == 3
    monkeypatch.setenv("PIPELINE_FAULT_AFTER_STEP", "three")
    with pytest.raises(ValueError, match=r"PIPELINE_FAULT_AFTER_STEP='three' is not a whole number"):
        faults.number("AFTER_STEP", 0)


def test_inject_raises_the_message_the_resume_tests_match():
    with pytest.raises(RuntimeError, match=r"^injected fault after step 3 \(PIPELINE_FAULT_AFTER_STEP\)$"):
        faults.inject("AFTER_STEP", "after step 3")


def test_worker_env_passes_the_drills_and_nothing_else(monkeypatch):
    monkeypatch.setenv("PIPELINE_FAULT_IN_STAGE", "sft")
    monkeypatch.setenv("PIPELINE_SECRET_TOKEN", "x")
    env = faults.worker_env()
    assert env.get("PIPELINE_FAULT_IN_STAGE") == "sft"
    assert not any(not k.startswith("PIPELINE_FAULT_") for k in env)


def test_no_drill_is_read_outside_the_hook():
    """Every PIPELINE_FAULT_ variable the code reads goes through pipeline/faults.py, and each is in DRILLS."""
    readers = []
    for path in [*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("stages/**/*.py")]:
        if path.name == "faults.py":
            continue
        if re.search(r"environ[^\n]*PIPELINE_FAULT_", path.read_text()):
            readers.append(str(path.relative_to(ROOT)))
    assert readers == []
    named = set()
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("docs/*.md")]:
        named |= set(re.findall(r"PIPELINE_FAULT_([A-Z_]+[A-Z])", path.read_text()))
    assert named and named <= set(faults.DRILLS), named - set(faults.DRILLS)
