"""The log file the console router writes library output to: opened per stage, never raising nor blocking.

Why a class of its own: a log that cannot be opened or written (a full disk, a read-only or vanished directory) must
not fail or block the run, so every open and write is guarded, its output is dropped with one warning on the console,
and it is tried again at the next open and every `LOG_RETRY_S`. faulthandler follows the current log's descriptor
(a fatal signal kills the pipe's reader with the process). The router (pipeline/console.py) owns one and shares its
lock with it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from pipeline.progress import _escape

LOG_RETRY_S = 60.0  # a log that could not be written is tried again this often (and at each stage)


def shown(path: Path | None) -> str:
    if path is None:
        return "the log"
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def why(exc: BaseException) -> str:
    """An OSError without its file name (the message names the file): '[Errno 28] No space left on device'."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else exc.strerror
    return str(exc) or type(exc).__name__


class LogFile:
    """`logs/<name>.log` under `directory` (set when the capture starts); `fd` None while there is none to write."""

    def __init__(self, lock: threading.RLock, warn: Callable[[str], None], fallback_fd: Callable[[], int],
                 capturing: Callable[[], bool]):
        self._lock, self._warn, self._fallback_fd, self._capturing = lock, warn, fallback_fd, capturing
        self.directory: Path | None = None
        self.name = "run"
        self.path: Path | None = None
        self.fd: int | None = None
        self.error: str | None = None  # why library output is being dropped (None: it is not)
        self._dropped_since = ""
        self._retry_at = 0.0
        self._warned = False
        self.faulthandler_was = False  # faulthandler's state before the capture, put back by `close`

    def open(self, name: str, mode: str) -> None:
        """Make `logs/<name>.log` the log ("w": a new one, the previous kept as `.log.1`; "a": append).

        Never raises: a log that cannot be opened is reported like one that cannot be written
        (`_failed`), and the next `open` tries again."""
        path = self.directory / f"{name}.log" if self.directory is not None else None
        with self._lock:
            self.name, self.path = name, path
            try:
                if path is None:
                    raise FileNotFoundError("no run directory")
                path.parent.mkdir(parents=True, exist_ok=True)
                if mode == "w" and path.exists():
                    path.replace(path.with_suffix(".log.1"))
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if mode == "w" else os.O_APPEND), 0o666)
            except OSError as exc:
                self._failed(exc)
                return
            self._use_fd(fd)
            header = f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {name}\n"
            if self.error is not None:
                header += f"===== library output since {self._dropped_since} was dropped ({self.error})\n"
            self.write(header)

    def _use_fd(self, fd: int | None) -> None:
        """Switch the log to `fd` (None: no log), pointing `faulthandler` at it before the old one closes.

        A fatal signal in this process (a segfault in C++, an abort) kills the pump thread with it,
        so the stacks faulthandler dumps must go to the log file directly, not through the pipe; with
        no log file they go to the console."""
        old, self.fd = self.fd, fd
        with contextlib.suppress(Exception):
            faulthandler.enable(file=fd if fd is not None else self._fallback_fd(), all_threads=True)
        if old is not None:
            with contextlib.suppress(OSError):
                os.close(old)

    def close(self) -> None:
        """At the end of the capture: faulthandler back as it was before, then the log closed."""
        with self._lock:
            with contextlib.suppress(Exception):
                if self.faulthandler_was and sys.stderr is not None:
                    faulthandler.enable(file=sys.stderr, all_threads=True)
                else:
                    faulthandler.disable()
            if self.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
                self.fd = None

    def write(self, text: str) -> None:
        """Append `text` to the log. Never raises nor waits on a broken log: its output is dropped
        (see `_failed`), and every `LOG_RETRY_S` the log is reopened to append."""
        with self._lock:
            if self.fd is None:
                if self.error is None or time.monotonic() < self._retry_at or not self._capturing():
                    return
                self.open(self.name, mode="a")  # writes a header, and the text after it if that worked
                if self.fd is None:
                    return
            data = text.encode("utf-8", errors="replace")
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except OSError as exc:
                self._failed(exc)
                return
            self.error = None

    def _failed(self, exc: OSError) -> None:
        """The log could not be opened or written (a full disk, a read-only directory): drop its
        output from now on rather than fail or block, and tell the person once per run."""
        with self._lock:
            self._use_fd(None)
            if self.error is None:
                self.error, self._dropped_since = why(exc), time.strftime("%H:%M:%S")
            self._retry_at = time.monotonic() + LOG_RETRY_S
            if self._warned:
                return
            self._warned = True
        self._warn(f"  [yellow]! could not write {_escape(shown(self.path))} ({_escape(why(exc))}); library "
                   f"output is dropped until it can be (tried again at each stage and every {LOG_RETRY_S:.0f}s)[/]")
