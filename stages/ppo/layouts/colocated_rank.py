"""`ColocatedRank`: one policy rank of the colocated layout (stages/ppo/layouts/colocated.py) holding every role
and its own vLLM engine; `RoleView`: one role of those ranks, called as a `ModelGroup` is.
"""

from __future__ import annotations

import time
from typing import Any

from stages.ppo.sleep import SleepCycle
from stages.ppo.worker import PPOWorker


class ColocatedRank(PPOWorker):
    """One policy rank holding every role of the stage and its own vLLM engine (see the module docstring).

    The policy is this worker itself; the other roles are `PPOWorker` objects in the same process (`call`). One
    call queue: the roles and the engine take turns, in the order the driver sends their calls, so collectives
    under ZeRO-3 meet in the same order on every rank."""

    def setup_rank(self, specs: dict[str, dict], model_dir: str, engine) -> dict[str, int]:
        """Build the roles (`specs`: role -> PPOWorker.setup spec, the policy's first), then the engine
        (`engine`: an EngineSpec with backend external_launcher). Returns each role's parameter count."""
        from stages.common.engines import RolloutEngine

        params = {"policy": self.setup(specs["policy"])}
        self.roles: dict[str, PPOWorker] = {"policy": self}
        t0 = time.time()
        for name, spec in specs.items():
            if name != "policy":
                self.roles[name] = PPOWorker(name, self.rank, self.world, {})
                params[name] = self.roles[name].setup(spec)
        t1 = time.time()
        self.rollout = RolloutEngine(model_dir, engine, self.rank)
        # vLLM's CPU worker has no sleep mode; asleep until the first generation (the roles train meanwhile)
        self.cycle = SleepCycle(self.rollout.llm, engine.sleep_level, engine.gpu and engine.sleep_mode)
        self.cycle.start()
        self.version = 0  # of the weights last loaded into the engine (a level-2 cycle reloads them)
        self.startup.update(roles=t1 - t0, engine=time.time() - t1)
        return params

    def ping(self) -> int:
        """What `kill_engine` waits on (it answers while the rank, and so its engine, lives)."""
        import os

        return os.getpid()

    def call(self, role: str, method: str, *args: Any, **kwargs: Any):
        """`method` of this rank's `role` (RoleView's calls)."""
        return getattr(self.roles[role], method)(*args, **kwargs)

    # --------------------------------------------------------------- the rank's engine

    def engine_generate(self, prompt_ids: list[list[int]], sampling: dict) -> list[list[dict]]:
        """RolloutEngine.generate on this rank's engine (woken for it with sleep mode: stages/ppo/sleep.py)."""
        return self.cycle.generate(lambda: self.rollout.generate(prompt_ids, sampling),
                                   reload=lambda: self.sync_engine(self.version))

    def sync_engine(self, version: int) -> tuple[float, int]:
        """The policy's current weights into this rank's engine, in place; (seconds, bytes handed over).

        Chunk by chunk (stages/ppo/weight_chunks.py): under ZeRO-3 every rank gathers a chunk (a collective)
        and loads it into its own engine before the next; otherwise each rank already holds the weights. A
        LoRA policy's adapted layers are merged a chunk at a time, base untouched."""
        from stages.ppo.weight_chunks import weight_chunks

        t0, handed = time.time(), 0

        def chunks():
            nonlocal handed
            for chunk in weight_chunks(self.engine.module, self.engine.zero_optimization_stage() == 3):
                handed += sum(t.numel() * t.element_size() for t in chunk.values())
                yield chunk

        self.cycle.load(lambda: self.rollout.load_weights(chunks(), version))
        self.version = version
        return time.time() - t0, handed


class RoleView:
    """One role of the colocated ranks, called as a `ModelGroup` is: rank r's call goes to its `role` object."""

    def __init__(self, ranks, role: str):
        self.ranks, self.name = ranks, role

    @property
    def actors(self) -> list:
        return self.ranks.actors

    def __len__(self) -> int:
        return len(self.ranks)

    def run(self, method: str, *args: Any, **kwargs: Any) -> list:
        return [a.call.remote(self.name, method, *args, **kwargs) for a in self.actors]

    def run_each(self, method: str, per_rank: list, **kwargs: Any) -> list:
        if len(per_rank) != len(self.actors):
            raise ValueError(f"{self.name}: {len(per_rank)} shards for {len(self.actors)} ranks")
        return [a.call.remote(self.name, method, x, **kwargs) for a, x in zip(self.actors, per_rank)]

    def get(self, method: str, *args: Any, **kwargs: Any) -> list:
        import ray

        return ray.get(self.run(method, *args, **kwargs))
