"""What the person running the pipeline sees, and where everything else goes.

Our code speaks through two calls that work in any process of a run (the driver, a Ray Train
worker, a Ray Data actor, a Tune trial):

    say("sft: DeepSpeed engine ready in 3.1s")                      # one line for the person
    advance("sft", done=6, total=12, unit="step", note="loss 2.31")  # progress of a long phase
    advance("data: tokenize", by=64, total=360, unit="row")         # ... counted in increments

In a Ray worker they write one marked line to stdout, which Ray forwards to the driver. The driver
of `python -m pipeline run` installs a `Router` that takes over everything else the process and
its workers print (Ray, vLLM, DeepSpeed, MLflow, httpx, C++ log lines):

- our lines go to the console; progress is a live bar with rate and ETA on a terminal, and plain
  periodic lines otherwise (cron, CI, `--json`: at most one per `PLAIN_INTERVAL_S` per phase, plus
  the first and the last);
- library output goes to `<run_dir>/logs/<stage>.log` (`run.log` outside any stage), and with
  `verbose` to the console as well; a library line that matters (an error, a traceback, a dead
  engine or actor) still reaches the console as one line naming the log file.

Why the file descriptors and not logging handlers: half of the noise never passes through Python's
logging (Ray's C++ core, tqdm bars, prints), so the router points fds 1 and 2 at a pipe that it
reads, and writes the console through duplicates of the original descriptors. Ray's forwarded
worker output is taken from Ray's own dispatcher (`ray._private.ray_logging`, no public hook
exists) in place of the handler that prints it, so lines keep the worker's name in the log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

MARK = "::pipeline:: "  # prefix of an event line written by a worker (JSON after it)
PLAIN_INTERVAL_S = 30.0  # off a terminal, at most one progress line per phase this often
MAX_NOTICES = 5  # library lines that matter, shown per stage before "more in the log"
# Library lines worth one console line: errors, tracebacks, dead engines/actors, the OOM killer.
# Not Ray's C++ "E" lines: on this stack they are warnings about actor arguments, every run.
NOTICE = re.compile(r"\bERROR\b|\bCRITICAL\b|Traceback \(most recent call last\)|EngineDeadError|ActorDiedError|"
                    r"\bOutOfMemory|out of memory|worker died|\bKilled\b")
_SYNC = "\x00pipeline-sync "

_router: Router | None = None


# --------------------------------------------------------------------------- any process


def say(text: str) -> None:
    """One line of ours for the person watching (a Train worker's: rank 0 only, the caller decides)."""
    _send({"line": text})


def advance(task: str, done: int | None = None, total: int | None = None, unit: str = "step", note: str = "",
            by: int | None = None) -> None:
    """Report progress of a long phase: `done` so far (or `by` more), out of `total` if known."""
    event: dict[str, Any] = {"task": task, "total": total, "unit": unit, "note": note}
    event.update({"by": by} if by is not None else {"done": done})
    _send(event)


def _send(event: dict) -> None:
    if _router is not None:
        _router.event(event)
        return
    # Not `print`: Ray Train patches it in its workers to log through the root logger as well, and
    # every line reached the console twice.
    sys.stdout.write(MARK + json.dumps(event) + "\n")
    sys.stdout.flush()


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


# --------------------------------------------------------------------------- progress, pure


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
        parts.append((f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}") + f" {unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{unit}")
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
        now, task, total, unit = time.time(), str(e["task"]), e.get("total"), e.get("unit", "step")
        t = self._tasks.get(f"{task}/{unit}")  # a stage's phases differ by unit: serve's replicas, then requests
        done = (t["done"] if t else 0) + int(e["by"]) if "by" in e else int(e.get("done") or 0)
        if t is None:
            t = self._tasks[f"{task}/{unit}"] = {"first": (now, 0 if "by" in e else done), "shown": None, "bar": None}
        t["done"] = done
        rate, eta = rate_eta(t["first"], now, done, total)
        note = str(e.get("note") or "")
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
            self._bars = Progress(TextColumn("  {task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                  console=self.console, transient=False)
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


class Router:
    """Console and log files of one `python -m pipeline run` process (see the module docstring).

    Build it first, then the rich consoles on `out` / `err` (duplicates of the original stdout and
    stderr), then `install` it; the runner wraps the run in `run_logs(run_dir)` (this router's
    `capture`) and each stage in `stage_log(name)` (its `stage`)."""

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
        self.err = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
        self.console = None  # the rich console our lines go to; set by the caller
        self.log_path: Path | None = None
        self._logs_dir: Path | None = None
        self._file = None
        self._stage = "run"
        self._lock = threading.RLock()
        self._board: Board | None = None
        self._notices = 0
        self._synced = threading.Event()
        self._capturing = False

    # ---- set-up

    @contextlib.contextmanager
    def capture(self, run_dir: Path) -> Iterator[Router]:
        """Send fds 1 and 2 (this process's and its children's) to the log files until the block ends."""
        self._logs_dir = Path(run_dir) / "logs"
        self._logs_dir.mkdir(parents=True, exist_ok=True)
        self._open("run", mode="a")
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        threading.Thread(target=self._pump, args=(read_end,), name="pipeline-log-pump", daemon=True).start()
        self._capturing = True
        try:
            yield self
        finally:
            self._sync()
            self._stop_board()
            self._capturing = False
            os.dup2(self.out.fileno(), 1)
            os.dup2(self.err.fileno(), 2)
            with self._lock:
                if self._file:
                    self._file.close()
                    self._file = None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Path | None]:
        """Library output of the block goes to `logs/<name>.log` (the last run's is kept as `.1`); yields its path."""
        if not self._capturing:
            yield None
            return
        self._sync()
        self._stage, self._notices = name, 0
        self._open(name, mode="w")
        path = self.log_path
        try:
            yield path
        except BaseException:
            import traceback

            with self._lock:
                self._file.write(traceback.format_exc())
            raise
        finally:
            self._sync()
            self._stop_board()
            if self._notices > MAX_NOTICES:
                self._print(f"  [yellow]! {self._stage}: {self._notices - MAX_NOTICES} more such lines in "
                            f"{_shown(path)}[/]")
            self._stage = "run"
            self._open("run", mode="a")

    def _open(self, name: str, mode: str) -> None:
        path = self._logs_dir / f"{name}.log"
        if mode == "w" and path.exists():
            path.replace(path.with_suffix(".log.1"))
        with self._lock:
            if self._file:
                self._file.close()
            self._file = open(path, mode, encoding="utf-8", errors="replace", buffering=1)
            self._file.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {name}\n")
            self.log_path = path

    def capture_ray_logs(self) -> None:
        """Take over Ray's printing of forwarded worker output (call after every `ray.init`)."""
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:  # a Ray without the dispatcher: its own printing (to our pipe) still works
            return
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.remove_handler("pipeline")
        dispatcher.add_handler("pipeline", self._ray_batch)

    # ---- input

    def _ray_batch(self, data: dict) -> None:
        """One batch of forwarded worker lines (Ray's log thread calls this; it must never raise)."""
        try:
            who = data.get("actor_name") or data.get("task_name") or ""
            ip = data.get("ip")
            prefix = f"({who + ' ' if who else ''}pid={data.get('pid')}{'' if ip == data.get('localhost') else f', ip={ip}'}) "
            lines = data.get("lines", [])
            if data.get("pid") == "autoscaler":  # its status table every few seconds: keep only events, as Ray does
                from ray._private.worker import filter_autoscaler_events

                lines = list(filter_autoscaler_events(lines))
            for line in lines:
                event = parse(line)
                if event is None:
                    self._library(prefix + line)
                else:
                    self.event(event)
        except Exception as exc:  # noqa: BLE001 - a broken line must not stop Ray's log thread
            self._library(f"(pipeline could not route a log batch: {exc!r})")

    def _pump(self, fd: int) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            *lines, buf = (buf + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", errors="replace")
                if line.startswith(_SYNC):
                    self._synced.set()
                    continue
                event = parse(line)
                if event is None:
                    self._library(line)
                else:
                    self.event(event)

    def _sync(self, timeout: float = 2.0) -> None:
        """Wait until what was written to fds 1 and 2 so far has been read (so it lands in this stage's log)."""
        if not self._capturing:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self._synced.clear()
        with contextlib.suppress(OSError):
            os.write(1, (_SYNC + "\n").encode())
        self._synced.wait(timeout)

    # ---- output

    def _library(self, line: str) -> None:
        with self._lock:
            if self._file:
                self._file.write(line + "\n")
            if self.verbose:
                self.err.write(line + "\n")
                return
            if NOTICE.search(line):
                self._notices += 1
                if self._notices <= MAX_NOTICES:
                    text = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
                    self._print(f"  [yellow]! {self._stage}: {_escape(text[:200])}[/] (see {_shown(self.log_path)})")

    def event(self, event: dict) -> None:
        """Show one of our events (a line, or progress)."""
        with self._lock:
            if "line" in event:
                self._print(stamped(_escape(str(event["line"]))))
                return
            self._progress(event)

    def _progress(self, e: dict) -> None:
        if self.console is None:
            return
        if self._board is None:
            self._board = Board(self.console, live=self.console.is_terminal and not self.verbose)
        self._board.update(e)

    def _stop_board(self) -> None:
        with self._lock:
            if self._board is not None:
                self._board.stop()
                self._board = None

    def _print(self, markup: str) -> None:
        if self.console is not None:
            self.console.print(markup)
        else:
            self.err.write(re.sub(r"\[/?[a-z ]*\]", "", markup) + "\n")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _shown(path: Path | None) -> str:
    if path is None:
        return "the log"
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def install(router: Router | None) -> None:
    """Make `router` this process's (the command line does, for `run`); None removes it."""
    global _router
    _router = router


def current() -> Router | None:
    """The router of this process, if `python -m pipeline run` installed one."""
    return _router


@contextlib.contextmanager
def run_logs(run_dir: Path) -> Iterator[None]:
    """`Router.capture` for the installed router (the runner calls it once the run directory is
    known to be usable and locked); nothing without one."""
    if _router is None or _router._capturing:
        yield
        return
    with _router.capture(run_dir):
        yield


@contextlib.contextmanager
def stage_log(name: str) -> Iterator[Path | None]:
    """`Router.stage` when a router is capturing; otherwise nothing (a library caller keeps its own streams)."""
    if _router is None or not _router._capturing:
        yield None
        return
    with _router.stage(name) as path:
        yield path


def capture_ray_logs() -> None:
    if _router is not None:
        _router.capture_ray_logs()
