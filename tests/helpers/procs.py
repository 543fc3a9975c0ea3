"""Which processes a command started, and which of them outlived it (issue 48, item 8).

`watched(cmd, ...)` runs a command while a thread reads its process tree from /proc every 0.2 s: every
descendant seen (Ray's daemons, its workers under the raylet, vLLM's engine processes under those) is
recorded with its start time, so a PID reused later is not mistaken for it. A process that is still a
descendant for less than one poll can be missed; what a run leaves behind has lived far longer. After
the command returns, `left_running` lists the recorded processes still running (a zombie, ended but not
yet reaped, counts as gone), wherever they were reparented to (init, for an orphaned Ray worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from helpers.cluster import process_tree


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return "?"


class Watched:
    """A finished command: args, returncode, output (stdout, and stderr unless kept apart in `stderr`),
    seen {pid: (start time, command line)}."""

    def __init__(self, args: list[str], returncode: int, output: str, stderr: str | None,
                 seen: dict[int, tuple[int, str]]):
        self.args, self.returncode, self.output, self.stderr, self.seen = args, returncode, output, stderr, seen

    def left_running(self) -> dict[int, str]:
        """{pid: name} of the recorded processes that still run: the same process (start time), not a zombie.
        The name is its command line now (a Ray worker's ray::Class) or, if unreadable, as first seen."""
        out = {}
        for pid, (start, first) in self.seen.items():
            now = _stat(pid)
            if now is not None and now[1] == start and now[0] != "Z":
                out[pid] = _cmdline(pid) or first
        return out

    def end_left_running(self) -> None:
        """SIGKILL what the command left behind: processes this test started, by PID."""
        for pid in self.left_running():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


def watched(cmd: list[str], cwd: Path, env: dict, timeout: float, interrupt_on: str | None = None,
            interrupt: int = signal.SIGINT, separate_stderr: bool = False) -> Watched:
    """Run `cmd`, recording its descendants; with `interrupt_on`, send `interrupt` to the command alone
    once a line of its output contains that text."""
    # As a terminal starts it: with SIGINT's default action. A suite started in the background (`make test &`,
    # nohup, some CI runners) has SIGINT ignored, children inherit that, and Python then leaves it ignored: the
    # drill's Ctrl-C did nothing and the run trained to its end (2026-12-01). SIG_DFL, unlike a handler,
    # survives exec; a one-line trampoline sets it without preexec_fn, which is unsafe in a threaded process.
    proc = subprocess.Popen([sys.executable, "-c", _DEFAULT_SIGINT, *cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if separate_stderr else subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen: dict[int, tuple[int, str]] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for pid in process_tree(proc.pid)[1:]:
                st = _stat(pid)
                if st is not None and st[0] != "Z" and (pid not in seen or seen[pid][0] == st[1]):
                    # read again: a Ray worker renames itself ray::Class. A process caught while exiting
                    # (not yet a zombie) reads as "" or "?": it keeps the name it had.
                    name = _cmdline(pid)
                    if name in ("", "?") and pid in seen:
                        name = seen[pid][1]
                    seen[pid] = (st[1], name)
            done.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if interrupt_on is not None and interrupt_on in line and proc.poll() is None:
                os.kill(proc.pid, interrupt)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    errors: list[str] = []
    if separate_stderr:
        err_reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
        err_reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        done.set()
        watcher.join()
        reader.join(timeout=10)
        if separate_stderr:
            err_reader.join(timeout=10)
    return Watched(cmd, proc.returncode, "".join(lines), "".join(errors) if separate_stderr else None, seen)
