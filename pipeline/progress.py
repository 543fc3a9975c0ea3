"""What the person sees of a run's progress: progress lines (pure), the `Board` that shows every phase of a
stage (a live bar with rate and ETA on a terminal, plain periodic lines otherwise: at most one per
`PLAIN_INTERVAL_S` per phase, plus the first and the last), and the console stream, which never raises.

The driver's `pipeline.console.Router` feeds it the events our code reports (`pipeline.events.advance`)
from any process of the run. Reporting only: in no cache key (`pipeline.artifacts.REPORTING`).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time
from typing import Any

PLAIN_INTERVAL_S = 30.0  # off a terminal, at most one progress line per phase this often


# --------------------------------------------------------------------------- progress, pure


def progress_event(e: dict) -> dict:
    """`e` (an `advance` event) with the field types `Board` needs; ValueError if it is malformed.

    Events arrive as text from other processes, so they are checked here, before any of their
    values reaches a live bar (rich draws those from its own thread, where a bad total would stop
    the display for good)."""
    if not isinstance(e, dict) or "task" not in e:
        raise ValueError("a progress event needs a task")
    checked = {"task": str(e["task"]), "unit": str(e.get("unit") or "step"), "note": str(e.get("note") or ""),
               "total": None if e.get("total") is None else _count(e["total"])}
    if "by" in e:
        checked["by"] = _count(e["by"])
    else:
        checked["done"] = _count(e.get("done") or 0)
    return checked


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"not a count: {value!r}")
    return int(value)


def rate_eta(first: tuple[float, int], now: float, done: int, total: int | None) -> tuple[float | None, float | None]:
    """(units per second since the first report, seconds left) - None where not yet measurable."""
    t0, d0 = first
    if now - t0 <= 0 or done <= d0:
        return None, None
    rate = (done - d0) / (now - t0)
    return rate, (None if total is None else max(0.0, (total - done) / rate))


def stamped(markup: str) -> str:
    """How every line of ours reads on the console: indented, with the time."""
    return f"  [dim]{time.strftime('%H:%M:%S')}[/] {markup}"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else (
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s")


def progress_line(task: str, unit: str, done: int, total: int | None, rate: float | None, eta: float | None,
                  note: str = "") -> str:
    """The plain (not a terminal) form: 'sft: step 6/12 (50%), 1.9 step/s, ETA 3s, loss 2.31'."""
    parts = [f"{task}: {unit} {done}/{total} ({100 * done / total:.0f}%)" if total else f"{task}: {done} {unit}s"]
    if rate is not None:
        parts.append((f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}") + f" {unit}/s" if rate >= 1
                     else f"{1 / rate:.3g} s/{unit}")
    if eta is not None and total and done < total:
        parts.append(f"ETA {duration(eta)}")
    if note:
        parts.append(note)
    return ", ".join(parts)


class Board:
    """Progress of the running stage's phases, drawn on `console`: live bars on a terminal, else plain
    lines (the first report, then at most one per `PLAIN_INTERVAL_S`, and the last)."""

    def __init__(self, console, live: bool | None = None):
        self.console = console
        self.live = console.is_terminal if live is None else live
        self._tasks: dict[str, dict] = {}
        self._bars = None

    def update(self, e: dict) -> None:
        """Show one `advance` event; ValueError (nothing changed) if it is malformed."""
        e = progress_event(e)
        now, task, total, unit = time.time(), e["task"], e["total"], e["unit"]
        t = self._tasks.get(f"{task}/{unit}")  # a stage's phases differ by unit: serve's replicas, then requests
        done = (t["done"] if t else 0) + e["by"] if "by" in e else e["done"]
        if t is None:
            t = self._tasks[f"{task}/{unit}"] = {"first": (now, 0 if "by" in e else done), "shown": None, "bar": None}
        t["done"] = done
        rate, eta = rate_eta(t["first"], now, done, total)
        note = e["note"]
        if self.live:
            self._bar(task, t, progress_line("", unit, done, total, rate, eta, note).removeprefix(": "), done, total)
            return
        finished = total is not None and done >= total
        if t["shown"] is None or finished or now - t["shown"] >= PLAIN_INTERVAL_S:
            t["shown"] = now
            self.console.print(stamped(_escape(progress_line(task, unit, done, total, rate, eta, note))))

    def _bar(self, task: str, t: dict, info: str, done: int, total: int | None) -> None:
        from rich.progress import BarColumn, Progress, TextColumn

        if self._bars is None:
            # Not rich's redirection of sys.stdout/stderr: it sent the driver's library prints to the
            # console while a bar was up (the router reads fds 1 and 2 into the log).
            self._bars = Progress(TextColumn("  {task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                  console=self.console, transient=False, redirect_stdout=False,
                                  redirect_stderr=False)
            self._bars.start()
        if t["bar"] is None:
            t["bar"] = self._bars.add_task(task, total=total, completed=done, info=info)
        else:
            self._bars.update(t["bar"], total=total, completed=done, info=info)

    def stop(self) -> None:
        """End the phases shown (a finished stage's bars stay on screen as they last were)."""
        if self._bars is not None:
            self._bars.stop()
            self._bars = None
        self._tasks.clear()


# --------------------------------------------------------------------------- the driver


class ConsoleStream(io.TextIOWrapper):
    """A duplicate of the original stdout or stderr whose writes never raise.

    A console that went away (the reading end of a pipe closed, a hung-up terminal) must not stop
    the run: rich, on a broken pipe, exits the process from whichever thread was printing (and
    points fd 1 at /dev/null). After the first failed write the console is left alone."""

    gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return super().write(text)
            except (OSError, ValueError):
                self.gone = True
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                super().flush()
            except (OSError, ValueError):
                self.gone = True

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            super().close()


def _console_stream(fd: int) -> ConsoleStream:
    try:
        fd = os.dup(fd)
    except OSError:  # started with that descriptor closed: nobody would read the console
        fd = os.open(os.devnull, os.O_WRONLY)
    return ConsoleStream(open(fd, "wb"), encoding="utf-8", errors="replace", line_buffering=True)  # noqa: SIM115


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
