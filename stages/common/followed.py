"""Followed engine calls: a call that runs the user's code on an engine, ended with its engine when it goes silent.

Calls that run the user's code on an engine (multi-turn episodes: stages/ppo/episodes.py) are *followed* (`follow`):
the engine streams heartbeats, each promising when the next comes, and a call silent past its promise is killed with
its engine (`EngineStalled`). Why a process and not a thread: a thread cannot stop code that holds the interpreter
(C code, a regex in catastrophic backtracking); only ending the process does, and Ray can end an actor whatever it
runs. `EnginePool.retrying` (stages/common/engines.py) restarts the killed engine.
"""

from __future__ import annotations

import time
from typing import Any

HEARTBEAT_S = 1.0  # a followed call reports at least this often while its loop runs


class EngineStalled(RuntimeError):
    """A followed call went silent past what its last heartbeat promised: its engine was killed."""


def follow(calls: list[tuple[Any, Any]], what: str, log=print) -> list:
    """The results of streaming engine calls, in order: `calls` is [(engine, ObjectRefGenerator)].

    Each call yields heartbeats `{"within": s}` (its next item comes within s seconds unless it is
    stuck) and ends with `{"result": r, "retire": reason}`. A call silent past its last promise is
    stuck in code it cannot interrupt: its engine is killed and `EngineStalled` names `what` ran there.
    A non-empty `retire` (threads of the user's code it abandoned still run in it) kills the engine
    after its result is taken, so they end too. A call that has not beaten yet is queued behind
    another on the same engine (ranks sharing engines), which is itself followed: no deadline yet.
    Either way `EnginePool.revive` (through `retrying`, or the next weight sync) restarts the engine.
    """
    import ray

    results: list = [None] * len(calls)
    deadline: list[float | None] = [None] * len(calls)
    pending = list(range(len(calls)))
    while pending:
        ray.wait([calls[i][1] for i in pending], num_returns=1, timeout=HEARTBEAT_S)
        for i in list(pending):
            engine, gen = calls[i]
            while ray.wait([gen], timeout=0)[0]:
                item = ray.get(next(gen))
                if "result" in item:
                    results[i] = item["result"]
                    pending.remove(i)
                    if item.get("retire"):
                        log(f"rollout engine replaced after this call: {item['retire']}")
                        kill_engine(engine)
                    break
                deadline[i] = time.time() + float(item["within"])
            if i in pending and deadline[i] is not None and time.time() > deadline[i]:
                kill_engine(engine)
                raise EngineStalled(
                    f"a rollout engine stopped answering while {what} ran: a call held the interpreter past its "
                    f"timeout (C code such as a regex in catastrophic backtracking, which no thread can stop), "
                    f"so the engine was killed")
    return results


def kill_engine(engine, timeout: float = 60) -> None:
    """Kill an engine actor and return once Ray reports it dead.

    `ray.kill` is asynchronous; without the wait a call sent right after it may still be answered, and
    `EnginePool.revive` would take the engine for alive (a drill, a test or a retry would depend on timing)."""
    import ray

    ray.kill(engine, no_restart=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            ray.get(engine.ping.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.2)
    raise TimeoutError(f"a rollout engine still answers {timeout:.0f} s after ray.kill")


def stalled(exc: BaseException) -> EngineStalled | None:
    """The EngineStalled behind `exc`: itself, or raised in a Ray task (a policy rank following its engines)."""
    cause = exc if isinstance(exc, EngineStalled) else getattr(exc, "cause", None)
    return cause if isinstance(cause, EngineStalled) else None


def trouble(exc: BaseException) -> str:
    """A short account of why engines were restarted, for the console."""
    stall = stalled(exc)
    return str(stall) if stall is not None else f"an engine died ({type(exc).__name__})"
