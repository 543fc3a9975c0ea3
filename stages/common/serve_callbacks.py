"""Ray Serve LLM start-up callbacks (`LLMConfig.callback_config`), loaded by path in each LLM replica."""

from __future__ import annotations

# Ray 2.60 documents `callback_config` but exports no public name for its base class.
from ray.llm._internal.common.callbacks.base import CallbackBase


class LocalModel(CallbackBase):
    """For a model that is a directory on the replica's machine.

    Before its engine starts, each LLM replica runs a task per node to download the model from cloud
    storage; for a local path with no mirror configured that task returns the path unchanged, after
    starting a process that imports vLLM (~10 s of every deployment on 2 cores). This skips that step
    (`run_init_node`) and nothing else: every other hook is the base class's no-op."""

    async def on_before_node_init(self) -> None:
        self.ctx.run_init_node = False
