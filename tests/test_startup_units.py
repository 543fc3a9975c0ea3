"""A stage's start-up clock (pipeline.events.StartupClock) and where its figures are shown. No Ray.

The stages' own measurements are checked on the shared command-line run (tests/test_cli_e2e.py)."""

from __future__ import annotations

import pickle

import pytest

from pipeline import events, outcomes
from pipeline.registry import STAGES


def _clock(monkeypatch, times):
    """A clock whose `time.time()` returns `times` in turn (the first is the stage's start)."""
    ticks = iter(times)
    monkeypatch.setattr(events.time, "time", lambda: next(ticks))
    return events.StartupClock()


def test_parts_add_up_to_the_start_up_and_uncounted_work_is_left_out(monkeypatch):
    clock = _clock(monkeypatch, [100.0, 102.0, 108.0, 111.0, 112.5, 112.5])
    clock.mark("ray")  # 2 s
    clock.mark("workers")  # 6 s
    clock.mark("evaluation", counted=False)  # 3 s of held-out work the config asked for
    clock.mark("data")  # 1.5 s
    assert clock.done() == pytest.approx(9.5)  # 12.5 s since the start, less the evaluation
    assert clock.parts == {"ray": 2.0, "workers": 6.0, "evaluation": 3.0, "data": 1.5}
    assert clock.line("first optimizer step") == ("start-up 9.5s to the first optimizer step (ray 2.0s, workers 6.0s, "
                                                  "data 1.5s); evaluation 3.0s not counted")


def test_the_start_up_ends_once_and_a_part_marked_twice_adds_up(monkeypatch):
    clock = _clock(monkeypatch, [0.0, 1.0, 3.0, 4.0, 4.0])
    clock.mark("evaluation", counted=False)
    clock.mark("roles")
    clock.mark("evaluation", counted=False)
    assert clock.done() == pytest.approx(2.0)
    assert clock.done() == pytest.approx(2.0)  # later calls (the metrics at the end of the stage) keep it
    assert clock.parts["evaluation"] == pytest.approx(2.0)


def test_metrics_name_every_part_and_detail_and_the_clock_travels_to_workers(monkeypatch):
    clock = _clock(monkeypatch, [10.0, 12.0, 15.0, 15.0])
    clock.mark("driver")
    clock = pickle.loads(pickle.dumps(clock))  # as Ray Train's loop config hands it to rank 0
    clock.mark("workers")
    clock.detail("policy_imports", 4.25)
    clock.processes = 3
    assert clock.metrics() == {"startup_s": 5.0, "startup_processes": 3.0, "startup_driver_s": 2.0,
                               "startup_workers_s": 3.0, "startup_policy_imports_s": 4.25}


def test_every_training_stage_shows_its_start_up_in_the_run_summary():
    shown = {spec.name: outcomes.describe(spec.outcomes, {"startup_s": 12.34}) for spec in STAGES}
    assert {name for name, line in shown.items() if line == "start-up 12.3s"} == {"sft", "reward", "dpo", "ppo"}
