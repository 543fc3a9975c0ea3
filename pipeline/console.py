"""What the person running the pipeline sees, and where everything else goes.

Our code reports through `pipeline.events` (`say`, `advance`) in any process of a run (the driver,
a Ray Train worker, a Ray Data actor, a Tune trial); in a Ray worker an event is one marked line on
stdout, which Ray forwards to the driver. The driver of `python -m pipeline run`, and of each command
registered `routed` (pipeline.registry), installs a `Router` that shows those and takes over everything
else the process and its workers print (Ray, vLLM, DeepSpeed, MLflow, httpx, C++ log lines):

- our lines go to the console; progress is a live bar with rate and ETA on a terminal, and plain
  periodic lines otherwise (cron, CI, `--json`: at most one per `PLAIN_INTERVAL_S` per phase, plus
  the first and the last);
- library output goes to `<run_dir>/logs/<stage>.log` (`run.log` outside any stage; a command's to
  its own log, `command_log`), and with `verbose` to the console as well; a library line that
  matters (an error, a traceback, a dead engine or actor) still reaches the console as one line
  naming the log file.

Why the file descriptors and not logging handlers: half of the noise never passes through Python's
logging (Ray's C++ core, tqdm bars, prints), so the router points fds 1 and 2 at a pipe that it
reads, and writes the console through duplicates of the original descriptors. Ray's forwarded
worker output is taken from Ray's own dispatcher (no public hook exists: pipeline/upstream/ray_private.py)
in place of the handler that prints it, so lines keep the worker's name in the log file.

The console never blocks or fails the run. Everything this process and its children print passes
through one pipe, so the thread that reads it (`Router._pump`) must never stop: a writer to a full
pipe (Python, Ray's C++ logging, vLLM, a child process) would wait forever. Each line is handled on
its own and a failure becomes a note in the log; a malformed progress event is dropped with a note.
A log that cannot be opened or written (a full disk, a read-only or vanished directory) is reported
once on the console, its output is dropped, and the log is tried again when the next one opens (each
stage, then `run.log`) and every `logfile.LOG_RETRY_S`: a stage's work never depends on its log. The
console itself is a stream that never raises (a closed pipe, a hung-up terminal). A fatal signal in
the driver (a segfault in C++, an abort) cannot go through the pipe, whose reader dies with the
process, so `faulthandler` writes the Python stacks to the current log file's descriptor directly;
a child's crash output goes through the pipe like the rest. When a stage fails, its traceback
follows its last output in the log (the pipe is drained first) and the console gets one line naming
that log.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

from pipeline import events
from pipeline.events import MARK, parse
from pipeline.logfile import LogFile
from pipeline.logfile import shown as _shown
from pipeline.logfile import why as _why
from pipeline.progress import Board, _console_stream, _escape, stamped

MAX_NOTICES = 5  # library lines that matter, shown per stage before "more in the log"
MAX_LINE = 1 << 20  # bytes without a newline (a tqdm bar's carriage returns) routed as one line
# Library lines worth one console line: errors, tracebacks, dead engines/actors, the OOM killer.
# Not Ray's C++ "E" lines: on this stack they are warnings about actor arguments, every run.
NOTICE = re.compile(r"\bERROR\b|\bCRITICAL\b|Traceback \(most recent call last\)|EngineDeadError|ActorDiedError|"
                    r"\bOutOfMemory|out of memory|worker died|\bKilled\b")
# Teardown, logged only: vLLM's output handler's EngineDeadError traceback (its call site on each line) when Ray Data
# LLM stops the engine first, after every batch inference (Ray 2.60, vLLM 0.32); one dying at work still shows.
TEARDOWN = re.compile(r"\[async_llm\.py:\d+\]")
_SYNC = "\x00pipeline-sync "

_router: Router | None = None


class Router:
    """Console and log files of one `python -m pipeline run` or routed command (see the module docstring).

    Build it first, then the rich consoles on `out` / `err` (duplicates of the original stdout and
    stderr), then `install` it; the runner wraps the run in `run_logs(run_dir)` (this router's
    `capture`) and each stage in `stage_log(name)` (its `stage`)."""

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.out = _console_stream(1)
        self.err = _console_stream(2)
        self.console = None  # the rich console our lines go to; set by the caller
        self._stage = "run"
        self._lock = threading.RLock()
        # the current log file (pipeline/logfile.py): shares the lock, warns on our console, and reopens only
        # while the capture runs
        self.log = LogFile(self._lock, self._print, self.err.fileno, lambda: self._capturing)
        self._board: Board | None = None
        self._notices = 0
        self._synced = threading.Event()
        self._capturing = False
        self._read_end: int | None = None
        self._pump_thread: threading.Thread | None = None

    # ---- set-up

    @contextlib.contextmanager
    def capture(self, run_dir: Path) -> Iterator[Router]:
        """Send fds 1 and 2 (this process's and its children's) to the log files until the block ends."""
        self.log.directory = Path(run_dir) / "logs"
        self.log.faulthandler_was = faulthandler.is_enabled()
        self.log.open("run", mode="a")
        if not self._redirect():
            self.log.close()
            yield self
            return
        self._capturing = True
        try:
            yield self
        finally:
            self._sync()
            self._stop_board()
            self._capturing = False
            os.dup2(self.out.fileno(), 1)
            os.dup2(self.err.fileno(), 2)
            self.log.close()

    def _redirect(self) -> bool:
        """Point fds 1 and 2 at a pipe read by the pump thread; False (library output stays on the
        console) if the process has no descriptor left for one."""
        try:
            read_end, write_end = os.pipe()
        except OSError as exc:
            self._print(f"  [yellow]! library output stays on the console: no pipe for it ({_escape(_why(exc))})[/]")
            return False
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        self._read_end = read_end
        self._start_pump()
        return True

    def _start_pump(self) -> None:
        self._pump_thread = threading.Thread(target=self._pump, args=(self._read_end,), name="pipeline-log-pump",
                                             daemon=True)
        self._pump_thread.start()

    @contextlib.contextmanager
    def stage(self, name: str, log: str | None = None) -> Iterator[Path | None]:
        """Library output of the block goes to `logs/<log or name>.log` (the last run's kept as `.1`); yields its
        path, or None if it could not be opened (the block runs all the same). The console calls it `name`."""
        if not self._capturing:
            yield None
            return
        self._sync()
        self._stage, self._notices = name, 0
        self.log.open(log or name, mode="w")
        path = self.log.path
        try:
            yield path if self.log.fd is not None else None
        except BaseException as exc:
            self._safely(self._stage_failed, name, path, exc)
            raise
        finally:
            self._sync()
            self._stop_board()
            if self._notices > MAX_NOTICES:
                self._print(f"  [yellow]! {self._stage}: {self._notices - MAX_NOTICES} more such errors in "
                            f"{_escape(_shown(path))}[/]")
            self._stage = "run"
            self.log.open("run", mode="a")

    def _stage_failed(self, name: str, path: Path | None, exc: BaseException) -> None:
        """The traceback goes to the stage's log after all the stage printed (the pipe is drained
        first), and the console gets one line naming the log (the command line prints the error)."""
        if isinstance(exc, GeneratorExit):
            return
        import traceback

        self._sync()
        with self._lock:
            self.log.write("".join(traceback.format_exception(exc)))
            where = (f"its log: {_shown(path)}" if self.log.error is None else
                     f"its log {_shown(path)} is incomplete ({self.log.error})")
        what = "failed" if isinstance(exc, Exception) else "was interrupted"
        self._print(f"  [red]{_escape(name)} {what}; {_escape(where)}[/]")

    def capture_ray_logs(self) -> None:
        """Take over Ray's printing of forwarded worker output (call after every `ray.init`)."""
        try:
            from pipeline.upstream.ray_private import global_worker_stdstream_dispatcher as dispatcher
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
            prefix = (f"({who + ' ' if who else ''}pid={data.get('pid')}"
                      f"{'' if ip == data.get('localhost') else f', ip={ip}'}) ")
            lines = data.get("lines", [])
            if data.get("pid") == "autoscaler":  # its status table every few seconds: keep only events, as Ray does
                from pipeline.upstream.ray_private import filter_autoscaler_events

                lines = list(filter_autoscaler_events(lines))
            run: list[str] = []  # library lines in a row: one `_library` call (a traceback, one notice)
            for line in lines:
                event = parse(line)
                if event is None:
                    run.append(prefix + line)
                    continue
                self._library(run)
                run = []
                self.event(event)
            self._library(run)
        except Exception as exc:  # noqa: BLE001 - a broken line must not stop Ray's log thread
            self._safely(self._library, [f"(pipeline could not route a log batch: {exc!r})"])

    def _pump(self, fd: int) -> None:
        """Read fds 1 and 2 until the pipe closes, routing each complete line.

        This loop must never stop while the pipe is open: every writer to it (this process, Ray's C++
        core, each child) would block for good once it holds 64 KiB. Routing catches its own
        failures; only the end of the pipe ends the loop."""
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the read end was closed
                return
            if not chunk:
                return
            buf += chunk
            end = buf.rfind(b"\n")
            if end < 0 and len(buf) < MAX_LINE:
                continue
            end = len(buf) if end < 0 else end
            # A newline byte is never inside a UTF-8 sequence, so the text up to one decodes whole.
            text, buf = buf[:end].decode("utf-8", errors="replace"), buf[end + 1:]
            self._safely(self._route, text)

    def _route(self, text: str) -> None:
        """Complete lines from the pipe: runs of library lines to `_library`, our events to `event`,
        sync marks to `_sync`'s waiter. Each is handled on its own (`_safely`)."""
        if MARK not in text and _SYNC not in text:  # the common case, a chunk of library output: one write
            self._safely(self._library, text.split("\n"))
            return
        run: list[str] = []
        for line in text.split("\n"):
            if _SYNC in line:  # the mark may follow output that ended without a newline
                self._safely(self._library, run)
                run, line = [], line.replace(_SYNC, "")
                self._synced.set()
                if not line:
                    continue
            event = parse(line) if MARK in line else None
            if event is None:
                run.append(line)
                continue
            self._safely(self._library, run)
            run = []
            self.event(event)
        self._safely(self._library, run)

    def _sync(self, timeout: float = 2.0) -> None:
        """Wait until what was written to fds 1 and 2 so far has been read (so it lands in this stage's log)."""
        if not self._capturing:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if self._pump_thread is not None and not self._pump_thread.is_alive():
            self._start_pump()  # cannot happen (`_pump` handles its failures); were it to, writers would block
        self._synced.clear()
        with contextlib.suppress(OSError):
            os.write(1, (_SYNC + "\n").encode())
        self._synced.wait(timeout)

    def _safely(self, fn, *args) -> None:
        """`fn(*args)`, any failure noted in the log instead of raised (for the pump and the error paths)."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            with contextlib.suppress(Exception):
                self.log.write(f"(pipeline: {getattr(fn, '__name__', fn)} failed: {exc!r})\n")

    # ---- output

    def _library(self, lines: list[str]) -> None:
        """Library lines: to the log (with `verbose` to the console as well); a run of them holding one that matters
        reaches the console as one notice naming the log (a traceback is one, though vLLM logs each line as ERROR)."""
        if not lines:
            return
        text = "\n".join(lines) + "\n"
        with self._lock:
            self.log.write(text)
            if self.verbose:
                self.err.write(text)
                return
            if not NOTICE.search(text):
                return
            matters = [line for line in lines if NOTICE.search(line) and not TEARDOWN.search(line)]
            if not matters:
                return
            self._notices += 1
            if self._notices <= MAX_NOTICES:
                shown = re.sub(r"\x1b\[[0-9;]*m", "", matters[0]).strip()
                self._print(f"  [yellow]! {self._stage}: {_escape(shown[:200])}[/] "
                            f"(see {_escape(_shown(self.log.path))})")

    def event(self, event: dict) -> None:
        """Show one of our events (a line, or progress). Never raises: a malformed event (from any
        process's output) is dropped with a note in the log."""
        with self._lock:
            try:
                if "line" in event:
                    self._print(stamped(_escape(str(event["line"]))))
                    return
                self._progress(event)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                self.log.write(f"(pipeline: dropped a malformed event {_repr(event)}: {exc})\n")

    def _progress(self, e: dict) -> None:
        if self.console is None:
            return
        if self._board is None:
            self._board = Board(self.console, live=self.console.is_terminal and not self.verbose)
        self._board.update(e)

    def _stop_board(self) -> None:
        with self._lock:
            if self._board is not None:
                board, self._board = self._board, None
                self._safely(board.stop)

    def _print(self, markup: str) -> None:
        """One line on the console. Never raises: the run goes on without a console."""
        try:
            if self.console is not None:
                self.console.print(markup)
            else:
                self.err.write(re.sub(r"\[/?[a-z ]*\]", "", markup) + "\n")
        except (Exception, SystemExit):  # noqa: BLE001 - SystemExit: rich's answer to a broken pipe
            pass


def _repr(event: Any) -> str:
    with contextlib.suppress(Exception):
        return json.dumps(event, default=str)[:500]
    return repr(event)[:500]


def install(router: Router | None) -> None:
    """Make `router` this process's (the command line does, for `run` and the routed commands), and the
    receiver of its `pipeline.events`; None removes it."""
    global _router
    _router = router
    events.set_sink(router.event if router is not None else None)


def current() -> Router | None:
    """The router of this process, if the command line (`run`, a routed command) installed one."""
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
def stage_log(name: str, log: str | None = None) -> Iterator[Path | None]:
    """`Router.stage` when a router is capturing; otherwise nothing (a library caller keeps its own streams)."""
    if _router is None or not _router._capturing:
        yield None
        return
    with _router.stage(name, log) as path:
        yield path


@contextlib.contextmanager
def command_log(run_dir: Path, name: str, log: str | None = None) -> Iterator[Path | None]:
    """A routed command's library output (Ray, vLLM, Serve, MLflow) to `<run_dir>/logs/<log or name>.log`, as a
    stage's: our lines stay on the console, a failure's names the log. Yields its path (None without a router).
    Entered once the command's arguments are checked, so that a refused command writes nothing."""
    with run_logs(run_dir), stage_log(name, log) as path:
        yield path


def capture_ray_logs() -> None:
    if _router is not None:
        _router.capture_ray_logs()
