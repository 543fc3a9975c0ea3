"""Environments for tests: `stages.ppo.environment.name: helpers.environments:NAME` (tests/ is on sys.path)."""

from __future__ import annotations

import re
import time

from stages.ppo.environments import Step


class TwoTurns:
    """After the first answer the user asks again; the second answer ends the episode, rewarded by its share of
    digit characters (helpers.toy_rewards.digits' signal: a barely trained policy raises it in a few iterations).
    The user's turn is the environment's: masked out of the loss."""

    def reset(self, row: dict):
        self.asked = False
        return None

    def step(self, messages: list[dict], turn: dict) -> Step:
        if not self.asked:
            self.asked = True
            return Step([{"role": "user", "content": "And again?"}])
        text = turn.get("content") or ""
        return Step(reward=sum(c.isdigit() for c in text) / max(len(text), 1), done=True)


class Misbehaving:
    """Whatever the model says, the first step runs the row's `kind` of tool: one that raises, hangs (sleeping:
    its thread lets go of the interpreter), holds the interpreter (a regex in catastrophic backtracking, which
    never returns and which no thread can stop), prints megabytes, or answers; the second step ends the
    episode. For the engine's guarantees, not learning."""

    def reset(self, row: dict):
        self.kind, self.calls = row["kind"], 0
        return None

    def step(self, messages: list[dict], turn: dict):
        self.calls += 1
        if self.calls > 1:
            return [], 1.0, True
        if self.kind == "raise":
            raise ZeroDivisionError("division by zero")
        if self.kind == "hang":
            time.sleep(60)
        if self.kind == "hold":
            re.match(r"(a+)+$", "a" * 64 + "b")
        content = "x" * 5_000_000 if self.kind == "flood" else "42"
        return [{"role": "tool", "content": content}], 0.0, False
