"""The sandbox tiers that can be built on this machine (each probed once), for the sandbox tests."""

from __future__ import annotations

import os

from stages.ppo import sandbox


def works(tier: str) -> bool:
    """Whether `tier` can be built on this machine (its one-off probe)."""
    old = os.environ.get(sandbox.ENV_VAR)
    os.environ[sandbox.ENV_VAR] = tier
    try:
        sandbox.isolation()
        return True
    except RuntimeError:
        return False
    finally:
        os.environ.pop(sandbox.ENV_VAR) if old is None else os.environ.__setitem__(sandbox.ENV_VAR, old)


WORKING = [t for t in sandbox.TIERS if works(t)]
