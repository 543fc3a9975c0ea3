"""What the suite prints about its own cost (docs/development.md): the wall time against the budget, the
time per module, and how busy the cores were, which bounds what running tests side by side could save."""

from __future__ import annotations

import pytest

from helpers import cpu

# /proc/stat's first lines as the kernel writes them: user nice system idle iowait irq softirq steal guest guest_nice
BEFORE = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\nintr 1 2 3\n"
AFTER = "cpu  400 20 180 1100 100 0 0 0 30 0\ncpu0 200 10 90 550 50 0 0 0 15 0\nintr 4 5 6\n"


def test_the_aggregate_line_counts_idle_and_iowait_as_idle_and_guest_time_once():
    times = cpu.parse_proc_stat(BEFORE)
    assert (times.busy, times.total) == (150, 1000)
    after = cpu.parse_proc_stat(AFTER)  # guest 30 is already inside user: not added
    assert (after.busy, after.total) == (600, 1800)


def test_the_busy_share_is_of_the_time_between_two_readings():
    share = cpu.busy_share(cpu.parse_proc_stat(BEFORE), cpu.parse_proc_stat(AFTER))
    assert share == pytest.approx(450 / 800)
    same = cpu.parse_proc_stat(BEFORE)
    assert cpu.busy_share(same, same) == 0.0  # no time passed: nothing to divide


def test_the_floor_is_the_work_spread_over_every_core():
    line = cpu.summary_line(wall_s=2000, share=0.75, cores=2)
    assert "cores busy 75%" in line and "3000 core-s" in line and "at least 1500s" in line


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
        def getoption(self, name):
            return "not slow"

    reporter = Reporter()
    conftest.pytest_terminal_summary(reporter, 0, Config())
    text = "\n".join(reporter.lines)
    assert "== time per module" in text and "tests/test_suite_cost.py" in text  # this module, so far
    assert "suite wall time:" in text and "the fast suite's budget of 4 min" in text
    assert "cores busy" in text and "however it is run side by side" in text
