"""What our code reports while it works, from any process of a run: lines, progress and metrics.

    say("sft: DeepSpeed engine ready in 3.1s")                      # one line for the person
    advance("sft", done=6, total=12, unit="step", note="loss 2.31")  # progress of a long phase
    advance("data: tokenize", by=64, total=360, unit="row")         # ... counted in increments
    RankZeroLogger(...).log(metrics, step)                           # a Train worker's metrics to MLflow

In a Ray worker an event is one marked line on stdout, which Ray forwards to the driver; in the
driver of `python -m pipeline run` it goes straight to the router `pipeline.console` installs, which
shows it. Stages import this module, never the console's router.

Nothing here can change what a stage produces, so this module is in no cache key
(`pipeline.artifacts.REPORTING`): editing a progress line reruns nothing. Keep it that way: it
reports, it never computes a stage's result.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

MARK = "::pipeline:: "  # prefix of an event line written by a worker (JSON after it)
# What a progress report shows of a training step's metrics (all of them go to MLflow).
PROGRESS_METRICS = ("train_loss", "eval_loss", "eval_accuracy")

_sink: Callable[[dict], None] | None = None  # the driver's router (`pipeline.console.install`), if any


def say(text: str) -> None:
    """One line of ours for the person watching (a Train worker's: rank 0 only, the caller decides)."""
    _send({"line": text})


def advance(task: str, done: int | None = None, total: int | None = None, unit: str = "step", note: str = "",
            by: int | None = None) -> None:
    """Report progress of a long phase: `done` so far (or `by` more), out of `total` if known."""
    event: dict[str, Any] = {"task": task, "total": total, "unit": unit, "note": note}
    event.update({"by": by} if by is not None else {"done": done})
    _send(event)


# What `record_start` counts: the starts that cost seconds each on a small machine.
START_KINDS = ("pipelines", "ray", "train_groups", "vllm_engines", "serve_deployments")
START_LEDGER = "PIPELINE_START_LEDGER"


def record_start(kind: str, count: int = 1, detail: str = "") -> None:
    """Note a costly start (a pipeline run, a local Ray, a Train worker group, a vLLM engine, a Serve
    deployment) in the file PIPELINE_START_LEDGER names, if set: one line each, appended whole, from any
    process of the run (Ray's processes inherit the variable). The test suite sets it to hold each test
    module to the starts it declares (tests/helpers/starts.py); anyone can set it to see what a command
    starts. Never raises: a count is not worth a run."""
    path = os.environ.get(START_LEDGER)
    if not path or count <= 0:
        return
    line = json.dumps({"t": time.time(), "kind": kind, "n": count, "pid": os.getpid(), "detail": detail}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # O_APPEND: one write, one whole line
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def set_sink(sink: Callable[[dict], None] | None) -> None:
    """Deliver this process's events to `sink` (the driver's router) instead of stdout; None: stdout."""
    global _sink
    _sink = sink


def _send(event: dict) -> None:
    """Never raises: a progress report is not worth a training step (a value JSON cannot hold is sent
    as its text, and a stdout that cannot be written drops the line)."""
    try:
        if _sink is not None:
            _sink(event)
            return
        # Not `print`: Ray Train patches it in its workers to log through the root logger as well, and
        # every line reached the console twice.
        sys.stdout.write(MARK + json.dumps(event, default=str) + "\n")
        sys.stdout.flush()
    except Exception:  # noqa: BLE001, S110 - see the docstring
        pass


def parse(line: str) -> dict | None:
    """The event in a forwarded line, or None for a library's line."""
    i = line.find(MARK)
    if i < 0:
        return None
    try:
        event = json.loads(line[i + len(MARK):])
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


class RankZeroLogger:
    """Metrics from rank 0 straight into the stage's MLflow run (workers have no driver objects), and
    the training progress on the driver's console."""

    def __init__(self, tracking_uri: str, run_id: str, rank: int, prefix: str):
        self.rank, self.prefix, self.client, self.run_id = rank, prefix, None, run_id
        if rank == 0:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def print(self, message: str) -> None:
        if self.rank == 0:
            say(f"{self.prefix}: {message}")

    def step(self, step: int, total: int, metrics: dict[str, float]) -> None:
        """Progress of training on the driver's console (a live bar, or periodic lines in logs)."""
        if self.rank == 0:
            shown = {k: v for k, v in metrics.items() if k in PROGRESS_METRICS}
            advance(self.prefix, step, total, "step", " ".join(f"{k} {v:.4g}" for k, v in shown.items()))


@contextmanager
def timed(into: dict, key: str) -> Iterator[dict]:
    """`with timed(stats, "train_s"):` adds the block's wall-clock seconds to `stats[key]` (summed when
    the block repeats, as a phase inside a loop does).

    Why one idiom: phase timings (an iteration's train, sync and score; a step's backward and optimizer)
    read as the phase they time, and a reader does not have to pair `t0 = time.time()` with the
    subtraction further down. The time is recorded even when the block raises.
    """
    began = time.time()
    try:
        yield into
    finally:
        into[key] = into.get(key, 0.0) + time.time() - began


class StartupClock:
    """A stage's start-up: from the moment its `run()` begins to its first optimizer step (Ray Train
    stages) or first iteration (ppo), and where that time went.

        clock = StartupClock()            # in run(), first thing
        ctx.ray(); clock.mark("ray")      # each part ends where the next begins
        ...                               # the clock travels to rank 0 (plain data, picklable)
        clock.mark("evaluation", counted=False)   # work the user asked for, not start-up
        clock.done(); say(clock.line("sft"))      # at the first step; clock.metrics() to MLflow

    Why it exists: a short job's wall time is mostly this fixed cost (processes started, modules
    imported, engines and optimisers initialised), so it is measured and shown like the steps are.
    Held-out evaluations before the first step are recorded as parts but not counted: they scale with
    the eval prompts the config asks for, not with the machinery. Times are wall-clock seconds
    (`time.time()`), so a part measured on a worker of another node is as good as the nodes' clocks.
    """

    def __init__(self, started: float | None = None):
        self.started = time.time() if started is None else started
        self.last = self.started  # where the next part begins
        self.parts: dict[str, float] = {}
        self.uncounted: set[str] = set()
        self.details: dict[str, float] = {}  # inside a part, e.g. the slowest rank's imports (they may overlap)
        self.total: float | None = None  # set by done()
        self.processes = 0  # processes the stage started for its work (ranks, engines, controllers)

    def mark(self, part: str, counted: bool = True, seconds: float | None = None) -> float:
        """The time since the last mark (or `seconds` given) is `part`'s (added up if marked twice)."""
        now = time.time()
        took = now - self.last if seconds is None else seconds
        self.parts[part] = self.parts.get(part, 0.0) + took
        if not counted:
            self.uncounted.add(part)
        self.last = now
        return took

    def detail(self, name: str, seconds: float) -> None:
        """Where time went inside a part (processes side by side overlap, so details do not add up)."""
        self.details[name] = seconds

    def done(self) -> float:
        """Start-up ends now (the first step or iteration begins): its seconds, uncounted parts left out."""
        if self.total is None:
            self.total = time.time() - self.started - sum(self.parts[p] for p in self.uncounted)
        return self.total

    def metrics(self) -> dict[str, float]:
        """`startup_s` and `startup_<part>_s` for MLflow and the manifest (uncounted parts included, named)."""
        out = {"startup_s": self.done(), "startup_processes": float(self.processes)}
        out.update({f"startup_{name}_s": round(s, 3) for name, s in (self.parts | self.details).items()})
        return out

    def line(self, what: str = "first step") -> str:
        """'start-up 12.3s to the first step (ray 2.1s, workers 6.0s, ...; evaluation 0.8s not counted)'."""
        counted = ", ".join(f"{n} {s:.1f}s" for n, s in self.parts.items() if n not in self.uncounted)
        other = ", ".join(f"{n} {s:.1f}s" for n, s in self.parts.items() if n in self.uncounted)
        return (f"start-up {self.done():.1f}s to the {what}" + (f" ({counted})" if counted else "")
                + (f"; {other} not counted" if other else ""))
