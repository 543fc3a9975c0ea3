"""Fault drills: the one hook through which a run is made to fail on purpose.

Resume, restart and clean-up paths are only trusted once they have run, so the tests (and an operator
rehearsing a failure) inject faults with `PIPELINE_FAULT_<DRILL>` environment variables. Every drill
is named in `DRILLS`, read through `value`/`number`, raised through `inject` and handed to Ray
workers through `worker_env`, so a reader finds all of them here and a typo in a drill's name is a
loud `KeyError` in the code that reads it, not a drill that silently never fires.
"""

from __future__ import annotations

import os

PREFIX = "PIPELINE_FAULT_"

DRILLS = {
    "IN_STAGE": "<stage>: the stage raises before its run() (a failed rerun keeps the last good result)",
    "STRAY_WORKER": "<stage>: a Ray worker that exits as an aborted Train controller does and then hangs",
    "AFTER_STEP": "N: a Train stage raises once, after the checkpoint of step N (resume tests)",
    "AFTER_ITERATION": "N: the ppo stage raises once, after the checkpoint of iteration N (resume tests)",
    "KILL_ENGINE_AT": "K: the ppo stage kills rollout engine 0 (or a colocated rank) at iteration K",
}


def _variable(drill: str) -> str:
    if drill not in DRILLS:
        raise KeyError(f"no fault drill '{drill}'; the drills are {sorted(DRILLS)} (pipeline/faults.py)")
    return PREFIX + drill


def value(drill: str) -> str | None:
    """The drill's setting in this process's environment, or None when the drill is off."""
    return os.environ.get(_variable(drill)) or None


def number(drill: str, default: int) -> int:
    """A numeric drill's setting (a step, an iteration), `default` when it is off."""
    raw = value(drill)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{_variable(drill)}={raw!r} is not a whole number ({DRILLS[drill]})") from None


def inject(drill: str, where: str) -> None:
    """Raise the drill's fault: 'injected fault <where> (PIPELINE_FAULT_<DRILL>)'."""
    raise RuntimeError(f"injected fault {where} ({_variable(drill)})")


def worker_env() -> dict[str, str]:
    """The drills set in the driver, for a Ray worker's runtime env (the Train loop reads them there)."""
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
