"""How fast this machine is today, printed beside every figure the suite and the benches measure.

This machine kind's speed varies about 1.8x from day to day (the default's `make run` took 1,140 s on
2026-11-29 and 624 s on 2026-12-01), so a wall time alone says nothing about the code. Every suite run
(tests/conftest.py) and every bench script (`announce()` at its start) first times a fixed workload:

- `gemm`: float32 matrix products (1024 x 1024) in torch on every core, the rate training and
  generation run at;
- `python`: a pure-Python loop on one core, the rate of the driver's and Ray's own Python;
- `torch_import`: a fresh `python -c "import torch"`, the cost each worker, actor and engine process
  pays before it does anything (the median of three; the page cache is warm after the first).

Each is compared with the same workload on the reference machine (`REFERENCE`: 2026-12-01, the day the
default's `make run` took ~620 s alone): `speed` is the geometric mean of the three ratios, 1.0 on the
reference, about 0.55 on a day 1.8x slower. `normalised(seconds)` is what a time measured today would
have been on the reference machine. The calibration measures; it never judges: no test asserts a time.

The kernel's counters (/proc/stat) say how busy the cores were. Steal time (the hypervisor running
someone else on our cores) is reported apart from busy time: busy is our work, steal is the machine.

    .venv/bin/python bench/machine.py           # the calibration alone, one line
    .venv/bin/python bench/machine.py --json    # the same as JSON
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

# The workloads on the reference machine: 2026-12-01 16:02 UTC, `.venv/bin/python bench/machine.py` twice, alone
# on the 2-core machine kind (0.25/0.25 s, 0.30/0.29 s, 1.11/1.12 s). That machine then ran the suite at e246bf0
# in 2,730 s, where the fresh machine of the same morning took 2,229 s (a failed Ctrl-C drill cost the
# first ~4 minutes of the difference, a DeepSpeed rebuild more): the reference is, if anything, slower than
# that morning's machine, so times normalised to it err long (docs/development.md, "Calibration").
REFERENCE = {"gemm_s": 0.25, "python_s": 0.295, "torch_import_s": 1.115}
REFERENCE_DATE = "2026-12-01"

GEMM_SIZE, GEMM_REPEATS = 1024, 40
PYTHON_LOOP = 10_000_000


# --------------------------------------------------------------------------- the kernel's counters
@dataclass(frozen=True)
class CpuTimes:
    """The kernel's cumulative CPU counters, summed over every core (clock ticks)."""

    busy: int   # user, nice, system, irq, softirq: work done on this machine's behalf
    steal: int  # time a virtual CPU waited while the hypervisor ran something else
    total: int


def parse_proc_stat(text: str) -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat: user nice system idle iowait irq softirq steal ...
    Idle and iowait are idle; steal is counted apart; guest time is already inside user and nice, so it
    is not added again."""
    fields = next(line for line in text.splitlines() if line.startswith("cpu ")).split()[1:]
    ticks = [int(v) for v in fields[:8]] + [0] * (8 - len(fields[:8]))
    idle, steal = ticks[3] + ticks[4], ticks[7]
    return CpuTimes(busy=sum(ticks) - idle - steal, steal=steal, total=sum(ticks))


def read_cpu() -> CpuTimes | None:
    """The counters now, or None where the kernel does not expose them (not Linux)."""
    try:
        with open("/proc/stat") as f:
            return parse_proc_stat(f.read())
    except OSError:
        return None


def shares(before: CpuTimes, after: CpuTimes) -> tuple[float, float]:
    """(busy, steal): the shares of the cores' time between two readings (0..1 each)."""
    total = after.total - before.total
    if total <= 0:
        return 0.0, 0.0
    clamp = lambda x: min(1.0, max(0.0, x))  # noqa: E731  (a migrated VM's steal counter can step back)
    return clamp((after.busy - before.busy) / total), clamp((after.steal - before.steal) / total)


def cores_line(wall_s: float, busy: float, steal: float, cores: int | None = None) -> str:
    """What the shares mean for a wall time: the floor no scheduling of the same work can beat."""
    cores = cores or os.cpu_count() or 1
    core_s = busy * cores * wall_s
    return (f"cores busy {busy:.0%} of the wall time, steal {steal:.1%} ({cores} cores, {core_s:.0f} core-s of "
            f"work): the same work takes at least {core_s / cores:.0f}s however it is run side by side")


# --------------------------------------------------------------------------- the calibration
@dataclass(frozen=True)
class Calibration:
    gemm_s: float          # GEMM_REPEATS products of two GEMM_SIZE^2 float32 matrices
    python_s: float        # PYTHON_LOOP iterations of a pure-Python loop
    torch_import_s: float  # a fresh interpreter that imports torch (median of 3)
    steal: float           # share of the cores' time stolen while the workload ran
    date: str

    @property
    def gemm_gflops(self) -> float:
        return 2 * GEMM_SIZE**3 * GEMM_REPEATS / self.gemm_s / 1e9

    @property
    def speed(self) -> float:
        return speed_against(asdict(self), REFERENCE)

    def normalised(self, seconds: float) -> float:
        """A time measured today as it would have been on the reference machine."""
        return seconds * self.speed

    def line(self) -> str:
        return (f"machine calibration ({self.date}): GEMM {self.gemm_gflops:.0f} GFLOP/s ({self.gemm_s:.2f}s), "
                f"Python loop {self.python_s:.2f}s, torch import {self.torch_import_s:.2f}s, steal {self.steal:.1%}; "
                f"speed {self.speed:.2f}x the reference machine ({REFERENCE_DATE}: the default's make run ~620 s): "
                f"times x {self.speed:.2f} = reference seconds")


def speed_against(measured: dict, reference: dict) -> float:
    """The geometric mean of reference/measured over the three workloads: 1.0 on the reference machine,
    below 1 on a slower day. A workload missing on either side is left out; none at all gives 1.0."""
    ratios = [reference[k] / measured[k] for k in ("gemm_s", "python_s", "torch_import_s")
              if reference.get(k) and measured.get(k)]
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0


def _gemm() -> float:
    import torch

    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    a @ b  # warm-up: the first call picks its kernels
    start = time.perf_counter()
    for _ in range(GEMM_REPEATS):
        a @ b
    return time.perf_counter() - start


def _python_loop() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(PYTHON_LOOP):
        total += i % 7
    return time.perf_counter() - start


def _torch_import() -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate() -> Calibration:
    """Time the fixed workload now (about 5 s on the reference machine)."""
    before = read_cpu()
    gemm, loop, imp = _gemm(), _python_loop(), _torch_import()
    after = read_cpu()
    steal = shares(before, after)[1] if before and after else 0.0
    return Calibration(gemm_s=gemm, python_s=loop, torch_import_s=imp, steal=steal,
                       date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def announce() -> Calibration:
    """Calibrate and print the line: what every bench script does first (on stderr: a bench's stdout may be
    its JSON)."""
    cal = calibrate()
    print(cal.line(), file=sys.stderr, flush=True)
    return cal


if __name__ == "__main__":
    cal = calibrate()
    print(json.dumps({**asdict(cal), "speed": cal.speed, "gemm_gflops": cal.gemm_gflops}) if "--json" in sys.argv
          else cal.line())
