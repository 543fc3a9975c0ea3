"""The separate layout (`stages.ppo.layout: separate`, the default): every role on ranks of its own, engines apart.

    policy ranks, critic ranks, reference ranks, reward ranks, teacher ranks: a `ModelGroup` of `PPOWorker`s each
    rollout.num_engines engine actors (`EnginePool`): the policy ranks send their prompt shares to them

Any process can be placed on any node, the engines generate while the trainers train (`rollout.async`) and run
environments (a stalled one is ended by killing its engine, which the pool restarts with the last weights).
The weights reach the engines once per update: one put into Ray's object store that every engine loads, or an
NCCL broadcast from policy rank 0 (`rollout.sync_transport`, stages/ppo/nccl_sync.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
# cfg is a PPOConfig throughout; it is not imported here, not even for annotations: config.py asks the
# layouts (a light class method) at validation, and an import back would close a circle of imports.


def own_roles(cfg) -> dict:
    """The roles with ranks of their own: name -> its role config (the reference has none when it is the LoRA
    policy's adapter switched off or a copy in each policy rank)."""
    out = {"policy": cfg.policy}
    if not (cfg.policy.lora or cfg.reference.colocate):
        out["reference"] = cfg.reference
    if cfg.algorithm == "ppo":
        out["critic"] = cfg.critic
    if cfg.rewards.model_weight:
        out["reward"] = cfg.reward
    if cfg.distill:
        out["distill"] = cfg.distill.role
    return out


class Separate:
    """`Layout` (stages/ppo/layouts/__init__.py) with a process per rank of every role and one per engine."""

    name = "separate"
    gpu_memory_share = 0.9  # an engine has its GPU to itself

    @classmethod
    def refuse(cls, cfg) -> None:
        if cfg.rollout.sleep_mode:
            raise ValueError("rollout.sleep_mode: an engine of its own (layout separate) has no trainer to give its "
                             "memory to; set stages.ppo.layout: colocated, or remove rollout.sleep_mode")

    @classmethod
    def ranks(cls, cfg, role) -> int:
        return role.num_ranks

    @classmethod
    def reference_in_ranks(cls, cfg) -> bool:
        return cfg.reference.colocate and not cfg.policy.lora

    @classmethod
    def bundles(cls, cfg, gpu: bool) -> dict[str, list[dict[str, float]]]:
        share = {"GPU": cfg.gpus_per_process} if gpu else {}
        out = {name: [{"CPU": role.cpus_per_rank, **share}] * role.num_ranks for name, role in own_roles(cfg).items()}
        engine = {"GPU": cfg.gpus_per_process * cfg.rollout.tensor_parallel_size} if gpu else {}
        out["engines"] = [{"CPU": cfg.rollout.cpus_per_engine, **engine}] * cfg.rollout.num_engines
        return out

    @classmethod
    def describe(cls, cfg, roles_note: str) -> str:
        return f"starting {cfg.rollout.num_engines} vLLM engines and the roles ({roles_note})"

    # ------------------------------------------------------------------ running

    def __init__(self, cfg):
        self.cfg, self.groups, self.pool, self.transport, self.pending = cfg, {}, None, None, {}

    @property
    def restarts(self) -> int:
        return self.pool.restarts if self.pool is not None else 0

    def start(self, s, roles: list[tuple], engine, gpu: bool, seed: int, run_storage) -> None:
        from stages.common.engines import EnginePool

        cfg, nccl = self.cfg, self.cfg.rollout.sync_transport == "nccl"
        engine_cls = _engine_class(s.episode is not None, nccl)
        policy_dir = next(model_dir for name, _, _, model_dir, _ in roles if name == "policy")
        self.pool = EnginePool(str(policy_dir), replace(engine, weight_transfer="nccl") if nccl else engine,
                               cfg.rollout.num_engines, cfg.rollout.placement_strategy, wait=False,
                               **({"engine_cls": engine_cls} if engine_cls else {}))
        for name, role, kind, model_dir, trainable in roles:
            self.groups[name], self.pending[name] = start_role(name, role, kind, model_dir, cfg, trainable, gpu,
                                                               s.tok.pad_token_id, seed, run_storage)
        s.groups = self.groups

    def ready(self, clock) -> dict[str, int]:
        import ray

        ray.get([g.pg.ready() for g in self.groups.values()], timeout=300)  # a clear error if resources never come
        ray.get([r for g in self.groups.values() for r in g.ready_refs])  # process groups joined
        params = {name: ray.get(refs)[0] for name, refs in self.pending.items()}  # models loaded
        clock.mark("roles")
        self.pool.ready()
        if self.cfg.rollout.sync_transport == "nccl":
            from stages.ppo.nccl_sync import NcclSync

            self.transport = NcclSync(self.groups["policy"], self.pool, 1 + self.cfg.rollout.tensor_parallel_size)
        clock.mark("engines")  # what the engines took beyond the roles (they started together)
        return params

    def processes(self) -> dict[str, list]:
        return {name: g.actors for name, g in self.groups.items()} | {"engine": self.pool.engines}

    def rollouts(self, prompts: list[dict], sampling: dict, episode=None) -> list:
        """Each policy rank sends its share to its engines (`PPOWorker.generate`); with an environment, the rows
        too (an environment's `reset` receives the whole row)."""
        from stages.ppo.groups import shard

        policy = self.groups["policy"]
        ids = shard([r["prompt_ids"] for r in prompts], len(policy))
        if episode is None:
            return policy.run_each("generate", ids, engines=self.pool.engines, sampling=sampling)
        return [a.generate.remote(p, self.pool.engines, sampling, part, episode)
                for a, p, part in zip(policy.actors, ids, shard(prompts, len(policy)))]

    def generate(self, rows: list[dict], sampling: dict, episode=None, say=print) -> list[list[dict]]:
        """The rows spread over the engines; with an environment, followed (stages/ppo/episodes.py)."""
        import ray

        from stages.ppo.episodes import run_episodes
        from stages.ppo.groups import shard

        engines = self.pool.engines
        parts = shard([r["prompt_ids"] for r in rows], len(engines))
        if episode is None:
            return [g for part in ray.get([e.generate.remote(p, sampling) for e, p in zip(engines, parts) if p])
                    for g in part]
        return run_episodes(engines, parts, shard(rows, len(engines)), sampling, episode, say)

    def retrying(self, call, say=print, since: int | None = None):
        """Dead or stalled engines are restarted with the last synced weights and `call` made again
        (`EnginePool.retrying`)."""
        return self.pool.retrying(call, say, since=since)

    def kill_engine(self, index: int) -> None:
        self.pool.kill(index)

    def sync_weights(self, version: int) -> tuple[float, int]:
        """One put into the object store that every engine loads in place, or over NCCL from policy rank 0."""
        if self.transport is not None:
            return self.transport.sync(version)
        weights_ref, nbytes = self.groups["policy"].get("export_weights")[0]
        return self.pool.sync(weights_ref, version=version), nbytes

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        for g in self.groups.values():
            g.shutdown()


def start_role(name: str, role, kind: str, model_dir: Path, cfg, trainable: bool, gpu: bool,
               pad_id: int, seed: int, run_storage):
    """A ModelGroup of SeparateRank ranks holding `model_dir` as `kind`; returns (group, setup refs)."""
    from stages.ppo.groups import ModelGroup
    from stages.ppo.layouts.separate_rank import SeparateRank
    from stages.ppo.layouts.rank_spec import role_spec

    group = ModelGroup(name, SeparateRank, role.num_ranks, role.cpus_per_rank, gpu and cfg.gpus_per_process,
                       cfg.placement_strategy, wait=False)  # the bundles placement.bundles counts
    spec = role_spec(Separate, name, role, kind, model_dir, cfg, trainable, gpu, pad_id, seed, run_storage)
    return group, group.run("setup", spec)


def _engine_class(agent: bool, nccl: bool) -> type | None:
    """The rollout engine's class when it is not `RolloutEngine` (None): one running episodes (an environment),
    one taking weights over NCCL, or both."""
    from stages.common.engines import RolloutEngine

    base = RolloutEngine
    if agent:
        from stages.ppo.episodes import AgentEngine

        base = AgentEngine
    if nccl:
        from stages.ppo.nccl_sync import engine_class

        base = engine_class(base)
    return None if base is RolloutEngine else base
