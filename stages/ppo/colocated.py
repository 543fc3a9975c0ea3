"""The colocated layout (`stages.ppo.layout: colocated`): one Ray actor per policy rank, holding every role.

    rank r (one process) = policy (DeepSpeed) + critic (DeepSpeed, PPO) + reference, reward model, teacher
                           (plain modules) + a vLLM engine (in process) generating rank r's share of the batch

Why: in the separate layout the stage starts a process per rank of every role and one per engine, and on a
small machine each pays for importing torch, DeepSpeed and vLLM before any work (docs/startup.md). The peers
that run RL at scale keep one process per rank: TRL's GRPOTrainer builds its engine inside the training process
(`vllm_mode="colocate"`, `distributed_executor_backend="external_launcher"`), verl fuses the roles sharing a
device into one actor per device. Here the engine joins the rank's own torch process group as TRL's does, and
new weights reach it in place (`ColocatedRank.sync_engine`): the trainer's tensors are handed to the engine's
`load_weights` in the same process, with no serialisation and no Ray object between them.

The loop in `stages/ppo/__init__.py` does not know which layout it drives: `RoleView` makes each role of the
ranks answer as a `ModelGroup` does (`run`, `run_each`, `get`), and `RankEngines` makes the ranks' engines
answer as an `EnginePool` does (`engines`, `sync`, `kill`, `retrying`). What the layout cannot do it refuses
at validation (`placement.fits_layout`): `rollout.async` (one process cannot generate while it trains) and
environments (a stalled environment is ended by killing the engine's process, here a policy rank).

A rank that dies takes its engine and its training state with it; nothing can be restarted in place, so a
call on a dead rank ends the attempt (`rank_lost`) and the stage starts its ranks again from the last
checkpoint (`run`'s retry).
"""

from __future__ import annotations

import time
from typing import Any

from stages.ppo.sleep import SleepCycle
from stages.ppo.worker import PPOWorker

MAX_RANK_RESTARTS = 2  # a rank that dies again and again is a bug to report, not to retry forever


def rank_lost(layout: str, exc: BaseException) -> bool:
    """Whether `exc` means a colocated rank died: any call on a dead rank (generating, scoring, a weight sync,
    a checkpoint's save) raises RayActorError. In the separate layout a dead role rank stays an error."""
    import ray

    return layout == "colocated" and isinstance(exc, ray.exceptions.RayActorError)


class ColocatedRank(PPOWorker):
    """One policy rank holding every role of the stage and its own vLLM engine (see the module docstring).

    The policy is this worker itself; the other roles are `PPOWorker` objects in the same process (`call`). One
    call queue: the roles and the engine take turns, in the order the driver sends their calls, so collectives
    under ZeRO-3 meet in the same order on every rank."""

    CONCURRENCY_GROUPS = None  # PPOWorker's generate group would let generation run beside training

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

    def generate(self, prompt_ids: list[list[int]], engines: list, sampling: dict, rows: list[dict] | None = None,
                 episode=None) -> list[list[dict]]:
        """This rank's share of the prompts, on its own engine (`engines`, the separate layout's, are unused)."""
        return self.engine_generate(prompt_ids, sampling)

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
        self.ranks, self.name, self.pg, self.ready_refs = ranks, role, ranks.pg, []

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

    def shutdown(self) -> None:
        """Nothing of its own: the ranks' group ends the actors."""


class _RankEngine:
    """A rank's engine addressed as an engine actor is (`generate.remote(prompt_ids, sampling)`, `ping.remote()`),
    for the held-out evaluation, which shards its prompts over `pool.engines`."""

    def __init__(self, actor):
        self.actor = actor

    @property
    def generate(self):
        return self.actor.engine_generate

    @property
    def ping(self):
        return self.actor.ping


class RankEngines:
    """The engines inside the colocated ranks, as the loop and the evaluation use an `EnginePool`."""

    def __init__(self, ranks):
        self.ranks, self.restarts = ranks, 0
        self.engines = [_RankEngine(a) for a in ranks.actors]

    def ready(self) -> None:
        """Nothing to wait for: the engines were built in the ranks' setup."""

    def sync_in_place(self, version: int) -> tuple[float, int]:
        """Every rank loads its policy's weights into its engine; (the slowest rank's seconds, bytes per rank)."""
        import ray

        done = ray.get([a.sync_engine.remote(version) for a in self.ranks.actors])
        return max(s for s, _ in done), done[0][1]

    def kill(self, index: int, timeout: float = 60) -> None:
        """Fault drills: kill rank `index` (its engine lives in it) and return once Ray reports it dead."""
        from stages.common.engines import kill_engine

        kill_engine(self.ranks.actors[index], timeout)

    def retrying(self, call, say=print, attempts: int = 3, since: int | None = None):
        """`call()` once: nothing here can restart a dead rank (its training state went with it), so its error
        ends the attempt and `run` starts the ranks again (`rank_lost`)."""
        return call()

    def shutdown(self) -> None:
        """Nothing of its own: the ranks' group ends the actors."""


def start_ranks(s, cfg, specs: dict[str, dict], model_dir, engine, gpu: bool):
    """The colocated ranks: one actor per policy rank, set up with every role's spec (`specs`: role ->
    `roles.role_spec`, their DeepSpeed configs for the policy's rank count) and the engine's; fills the session's
    groups (the policy: the ranks themselves; the others: `RoleView`s) and pool. Returns the ranks' setup refs."""
    from dataclasses import replace

    from stages.ppo.groups import ModelGroup

    engine = replace(engine, backend="external_launcher", sleep_mode=cfg.rollout.sleep_mode,
                     sleep_level=cfg.rollout.sleep_level)
    # Ray starts each rank with the engine's environment (VLLM_ENABLE_V1_MULTIPROCESSING=0, tcmalloc on CPU):
    # vLLM reads it at import, in the rank's process.
    ranks = ModelGroup("policy", ColocatedRank, cfg.policy.num_ranks, cfg.policy.cpus_per_rank,
                       gpu and cfg.gpus_per_process, cfg.placement_strategy, runtime_env=engine.runtime_env(), wait=False)
    s.groups = {name: ranks if name == "policy" else RoleView(ranks, name) for name in specs}
    s.pool = RankEngines(ranks)
    return ranks.run("setup_rank", specs, str(model_dir), engine)
