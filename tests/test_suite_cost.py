"""What the suite prints about its own cost (docs/development.md): the machine's calibration, the wall time
raw and normalised to the reference machine against the budget, the time per module, and how busy the cores
were with steal apart, which bounds what running tests side by side could save."""

from __future__ import annotations

import pytest

from bench import machine

# /proc/stat's first lines as the kernel writes them: user nice system idle iowait irq softirq steal guest guest_nice
BEFORE = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\nintr 1 2 3\n"
AFTER = "cpu  400 20 180 1100 100 0 0 90 30 0\ncpu0 200 10 90 550 50 0 0 45 15 0\nintr 4 5 6\n"


def test_the_aggregate_line_counts_idle_and_iowait_as_idle_steal_apart_and_guest_time_once():
    times = machine.parse_proc_stat(BEFORE)
    assert (times.busy, times.steal, times.total) == (150, 0, 1000)
    after = machine.parse_proc_stat(AFTER)  # guest 30 is already inside user: not added; steal 90 is not busy
    assert (after.busy, after.steal, after.total) == (600, 90, 1890)


def test_the_shares_are_of_the_time_between_two_readings_and_steal_is_not_busy():
    busy, steal = machine.shares(machine.parse_proc_stat(BEFORE), machine.parse_proc_stat(AFTER))
    assert busy == pytest.approx(450 / 890) and steal == pytest.approx(90 / 890)
    same = machine.parse_proc_stat(BEFORE)
    assert machine.shares(same, same) == (0.0, 0.0)  # no time passed: nothing to divide


def test_the_floor_is_the_work_spread_over_every_core():
    line = machine.cores_line(wall_s=2000, busy=0.75, steal=0.05, cores=2)
    assert "cores busy 75%" in line and "steal 5.0%" in line and "3000 core-s" in line and "at least 1500s" in line


def test_the_speed_is_the_geometric_mean_of_the_three_ratios_to_the_reference():
    ref = {"gemm_s": 1.0, "python_s": 2.0, "torch_import_s": 4.0}
    assert machine.speed_against(ref, ref) == pytest.approx(1.0)
    slower = {"gemm_s": 1.8, "python_s": 3.6, "torch_import_s": 7.2}  # a day 1.8x slower in everything
    assert machine.speed_against(slower, ref) == pytest.approx(1 / 1.8)
    mixed = {"gemm_s": 2.0, "python_s": 2.0, "torch_import_s": 4.0}  # only the GEMM twice as slow
    assert machine.speed_against(mixed, ref) == pytest.approx(0.5 ** (1 / 3))


def test_a_time_measured_on_a_slow_day_is_normalised_down_to_the_reference_machine():
    cal = machine.Calibration(gemm_s=machine.REFERENCE["gemm_s"] * 1.8, python_s=machine.REFERENCE["python_s"] * 1.8,
                              torch_import_s=machine.REFERENCE["torch_import_s"] * 1.8, steal=0.0, date="today")
    assert cal.speed == pytest.approx(1 / 1.8)
    assert cal.normalised(1800) == pytest.approx(1000)
    assert "speed 0.56x the reference machine" in cal.line()


def test_the_calibration_runs_the_three_workloads():
    cal = machine.calibrate()
    assert cal.gemm_s > 0 and cal.python_s > 0 and cal.torch_import_s > 0 and 0 <= cal.steal <= 1
    assert "GFLOP/s" in cal.line() and "torch import" in cal.line()


def test_every_run_of_the_suite_prints_its_cost():
    """conftest's summary hook, called as pytest calls it at the end of a run (in-process: a pytest in a
    subprocess would cost the fast suite seconds of imports for the same check)."""
    import conftest

    class Reporter:
        def __init__(self):
            self.lines = []

        def section(self, title):
            self.lines.append(f"== {title}")

        def write_line(self, line, **markup):
            self.lines.append(line)

    class Config:
        stash: dict = {}

        def getoption(self, name, default=None):
            return {"markexpr": "not slow", "tiers": "all"}.get(name, default)

    reporter = Reporter()
    conftest.pytest_terminal_summary(reporter, 0, Config())
    text = "\n".join(reporter.lines)
    assert "== time per module" in text and "tests/test_suite_cost.py" in text  # this module, so far
    assert "suite wall time:" in text and "normalised to the reference machine" in text
    assert "make test-fast's budget of 4 min" in text and "machine calibration" in text
    assert "cores busy" in text and "steal" in text and "however it is run side by side" in text


def test_the_budget_is_chosen_by_what_the_run_selects():
    import conftest

    from helpers import tiers

    class Config:
        def __init__(self, applied=False, **opts):
            self.opts, self.stash = opts, {tiers._STATE: {"applied": applied}}

        def getoption(self, name, default=None):
            return self.opts.get(name, default)

    assert conftest.suite_kind(Config(markexpr="not slow")) == "fast"
    assert conftest.suite_kind(Config(markexpr="", tiers="changed", applied=True)) == "base"
    assert conftest.suite_kind(Config(markexpr="", tiers="changed", applied=False)) == "all"  # no record: every tier
    assert conftest.suite_kind(Config(markexpr="", tiers="all")) == "all"
    cal = machine.Calibration(gemm_s=machine.REFERENCE["gemm_s"] * 2, python_s=machine.REFERENCE["python_s"] * 2,
                              torch_import_s=machine.REFERENCE["torch_import_s"] * 2, steal=0.0, date="today")
    lines = conftest.budget_lines(1800, "base", cal)  # 30 min on a machine half as fast: 15 reference minutes
    assert "1800s (30.0 min) on this machine" in lines[0]
    assert "900s (15.0 min), within make test (base tier and changed tiers)'s budget of 20 min" in lines[1]
    assert conftest.budget_lines(1800, "base", None) == [lines[0]]  # no calibration: the raw time alone
    assert "OVER make test-all's budget of 35 min" in conftest.budget_lines(4400, "all", cal)[1]  # 2200 reference s
