"""The base class every config section derives from.

Kept apart from `pipeline.config` so stage modules can define their config classes without
importing the whole pipeline config (which imports every stage).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, defaults are validated, values are immutable.

    `extra="forbid"` is what turns a typo (`max_lenn: 256`) into an error naming the key instead
    of a silently ignored setting.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)
