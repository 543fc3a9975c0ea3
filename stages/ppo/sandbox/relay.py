"""Sandboxed runs in conversation through the caller: each run is started as `process.run` starts one (the same
launcher, tier, rlimits and cleanup), all at once so they boot side by side; the caller reads the lines each writes
on stdout and hands them to a referee, which answers with lines to write to the runs' stdin, or concludes. No run
can reach another: every byte between them passes the referee, which forwards only what it rebuilt.

    converse(cfg, {"response": code, "judge": code}, limits, referee) -> Conversation

One wall clock (`limits.wall_s`) bounds the whole conversation, and `limits.output_bytes` each line a run writes
on stdout (a conversation's total is bounded by its questions and the clock); stderr is kept up to the cap and
otherwise dropped. Everything is killed when the
referee concludes, at the deadline, past a cap, or when a run ends first (the referee's `closed`).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import stages.ppo.sandbox.process as process
from stages.ppo.sandbox.process import Config, SandboxLimits


class Concluded(Exception):
    """Raised by a referee with what the conversation came to."""

    def __init__(self, outcome: Any):
        super().__init__(outcome)
        self.outcome = outcome


class Referee(Protocol):
    def line(self, who: str, line: bytes) -> list[tuple[str, bytes]]:
        """What to write where in answer to a line `who` wrote (without its newline); may raise Concluded."""

    def closed(self, who: str) -> None:
        """`who`'s output ended (it exited): raise Concluded, or return to let the others go on."""


@dataclass
class Conversation:
    outcome: Any  # what the referee concluded; None when it did not (see reason)
    reason: str  # "" when concluded, else: timeout, output limit (<who>), sandbox
    wall_s: float
    stderr: dict[str, str] = field(default_factory=dict)


def converse(cfg: Config, programs: dict[str, str], limits: SandboxLimits, referee: Referee) -> Conversation:
    """Run `programs` (name -> code) at once in `cfg`'s tier and relay their lines through `referee`."""
    started_at = time.monotonic()
    deadline = started_at + limits.wall_s
    with contextlib.ExitStack() as stack:
        try:
            runs = {who: stack.enter_context(process.started(cfg, code, limits, subprocess.PIPE))
                    for who, code in programs.items()}
        except OSError as exc:
            return Conversation(None, f"sandbox: {exc}", time.monotonic() - started_at)
        outcome, why, errs = _relay(runs, deadline, limits.output_bytes, referee)
    stderr = {who: e.decode("utf-8", errors="replace") for who, e in errs.items()}
    return Conversation(outcome, why, time.monotonic() - started_at, stderr)


def _relay(runs: dict, deadline: float, cap: int, referee: Referee) -> tuple[Any, str, dict[str, bytearray]]:
    owner, pending, partial = {}, {}, {}
    errs = {who: bytearray() for who in runs}
    with selectors.DefaultSelector() as sel:
        for who, (proc, _) in runs.items():
            for stream, kind in ((proc.stdout, "out"), (proc.stderr, "err")):
                os.set_blocking(stream.fileno(), False)
                sel.register(stream.fileno(), selectors.EVENT_READ)
                owner[stream.fileno()] = (who, kind)
            os.set_blocking(proc.stdin.fileno(), False)
            owner[proc.stdin.fileno()] = (who, "in")
            pending[who], partial[who] = b"", b""
        open_out, reaped = set(runs), set()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None, "timeout", errs
                for key, events in sel.select(min(remaining, 0.1)):
                    who, kind = owner[key.fd]
                    if kind == "in":
                        _flush(sel, runs[who][0], pending, who)
                        continue
                    try:
                        chunk = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(key.fd)
                        if kind == "out":
                            open_out.discard(who)
                            referee.closed(who)
                        continue
                    if kind == "err":
                        errs[who] += chunk[:max(0, cap - len(errs[who]))]
                        continue
                    partial[who] += chunk
                    *lines, partial[who] = partial[who].split(b"\n")
                    if len(partial[who]) > cap or any(len(line) > cap for line in lines):
                        return None, f"output limit ({who})", errs
                    for line in lines:
                        for target, data in referee.line(who, line):
                            pending[target] += data
                            _flush(sel, runs[target][0], pending, target)
                for who in list(open_out):  # a run that exited while a child of it holds its pipes
                    proc, uid = runs[who]
                    if who not in reaped and process.exited(proc):
                        reaped.add(who)
                        process.kill_rest(proc, uid)
        except Concluded as done:
            return done.outcome, "", errs


def _flush(sel: selectors.BaseSelector, proc: subprocess.Popen, pending: dict, who: str) -> None:
    """Write what is pending for `who` as far as its pipe takes it; wait for it to be writable for the rest."""
    fd = proc.stdin.fileno()
    try:
        while pending[who]:
            pending[who] = pending[who][os.write(fd, pending[who]):]
    except BlockingIOError:
        pass
    except (BrokenPipeError, OSError):
        pending[who] = b""  # it is gone; its output's end tells the referee
    want = selectors.EVENT_WRITE if pending[who] else 0
    try:
        registered = sel.get_key(fd).events
    except KeyError:
        registered = 0
    if want and not registered:
        sel.register(fd, selectors.EVENT_WRITE)
    elif registered and not want:
        sel.unregister(fd)
