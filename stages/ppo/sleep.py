"""A colocated rank's vLLM engine giving its GPU memory to the trainer between generations (vLLM's sleep mode).

In layout colocated a rank's engine and its trainer share the rank's GPU and take turns. Asleep, the engine holds no
KV cache, and its weights either move to CPU memory (level 1) or are discarded (level 2). The order of the calls is
what costs or saves copies; per iteration, with the weights changed by every update:

- **level 2** (the default, TRL's colocate order): generate, then sleep(level=2) (nothing is copied out); at the
  sync, wake_up(tags=["weights"]) (memory allocated, nothing copied in), load the new weights, and stay so; at the
  next generation, wake_up(tags=["kv_cache"]). The weights cross host to device once, as the sync's own load.
- **level 1**: sleep(level=1) copies the weights to CPU memory and wake_up() copies them back, at the generation and
  at the sync alike, and the sync then overwrites them: three copies of the weights per iteration.

A generation that finds its weights discarded (level 2: a second generation with no sync between, such as the
held-out evaluation) loads the policy's current weights first (`reload`: the rank is the policy), so no generation
ever runs on discarded memory. The engine starts asleep at level 1: its first weights came from disk and are kept.
On a CPU there is nothing to release (vLLM's CPU worker has no sleep mode): every call is then a no-op.
"""

from __future__ import annotations

from typing import Any, Callable

BOTH = ("kv_cache", "weights")


class SleepCycle:
    """The sleep and wake calls around a rank's engine (`llm`: vLLM's `LLM`, or anything with its `sleep` and
    `wake_up`), at `level` 1 or 2, when `enabled` (sleep mode on a GPU)."""

    def __init__(self, llm: Any, level: int, enabled: bool) -> None:
        self.llm, self.level, self.enabled = llm, level, enabled
        self.asleep: set[str] = set()  # the memory vLLM has released: "weights", "kv_cache"
        self.weights_kept = True  # False after a level-2 sleep, until weights are loaded again

    def start(self) -> None:
        """After the engine is built: asleep until the first generation, its weights from disk kept."""
        if self.enabled:
            self.llm.sleep(level=1)
            self.asleep = set(BOTH)

    def generate(self, run: Callable[[], Any], reload: Callable[[], Any]) -> Any:
        """`run()` (the generation) on an awake engine, asleep again after; `reload()` first when the weights were
        discarded (it loads the policy's current weights through `load`)."""
        if not self.enabled:
            return run()
        if not self.weights_kept:
            reload()
        self._wake(set(BOTH))
        try:
            return run()
        finally:
            self.llm.sleep(level=self.level)
            self.asleep, self.weights_kept = set(BOTH), self.level == 1

    def load(self, run: Callable[[], Any]) -> Any:
        """`run()` (loading new weights into the engine) with the weights' memory awake; at level 1 asleep again
        after (its weights to CPU memory), at level 2 awake until the next generation wakes the KV cache."""
        if not self.enabled:
            return run()
        self._wake({"weights"})
        try:
            return run()
        finally:
            self.weights_kept = True
            if self.level == 1:
                self.llm.sleep(level=1)
                self.asleep = set(BOTH)

    def _wake(self, tags: set[str]) -> None:
        """Wake what of `tags` is asleep: everything at once when that is all of it (vLLM's `wake_up()`)."""
        todo = self.asleep & tags
        if not todo:
            return
        if todo == set(BOTH):
            self.llm.wake_up()
        else:
            self.llm.wake_up(tags=sorted(todo))
        self.asleep -= todo
