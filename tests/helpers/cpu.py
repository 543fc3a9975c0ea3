"""How busy the machine's cores were while the suite ran, and what that says about its time.

The suite runs its tests one after another. Whether running them side by side (pytest-xdist) could
bring it inside its budget depends on how much of the wall time the cores sat idle: the CPU work a
suite does takes at least `core-seconds / cores` of wall time however it is scheduled. The counters
are the kernel's, for the whole machine (/proc/stat), so other work on the machine counts too: the
budget is measured with the suite alone on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuTimes:
    """The kernel's cumulative CPU counters, summed over every core (clock ticks)."""

    busy: int
    total: int


def parse_proc_stat(text: str) -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat: user nice system idle iowait irq softirq steal ...
    Idle and iowait are idle; guest time is already inside user and nice, so it is not added again."""
    fields = next(line for line in text.splitlines() if line.startswith("cpu ")).split()[1:]
    ticks = [int(v) for v in fields[:8]]
    idle = ticks[3] + ticks[4]
    return CpuTimes(busy=sum(ticks) - idle, total=sum(ticks))


def read() -> CpuTimes | None:
    """The counters now, or None where the kernel does not expose them (not Linux)."""
    try:
        with open("/proc/stat") as f:
            return parse_proc_stat(f.read())
    except OSError:
        return None


def busy_share(before: CpuTimes, after: CpuTimes) -> float:
    """The share of the cores' time spent busy between two readings (0..1)."""
    total = after.total - before.total
    return (after.busy - before.busy) / total if total > 0 else 0.0


def summary_line(wall_s: float, share: float, cores: int | None = None) -> str:
    """What the share means for the wall time: the floor no scheduling of the same work can beat."""
    cores = cores or os.cpu_count() or 1
    core_s = share * cores * wall_s
    return (f"cores busy {share:.0%} of the wall time ({cores} cores, {core_s:.0f} core-s of work): the same work "
            f"takes at least {core_s / cores:.0f}s however it is run side by side")
