"""The colocated layout (`stages.ppo.layout: colocated`): one Ray actor per policy rank, holding every role.

    rank r (one process) = policy (DeepSpeed) + critic (DeepSpeed, PPO) + reference, reward model, teacher
                           (plain modules) + a vLLM engine (in process) generating rank r's share of the batch

Why: in the separate layout the stage starts a process per rank of every role and one per engine, and on a
small machine each pays for importing torch, DeepSpeed and vLLM before any work (docs/startup.md). The peers
that run RL at scale keep one process per rank: TRL's GRPOTrainer builds its engine inside the training process
(`vllm_mode="colocate"`, `distributed_executor_backend="external_launcher"`), verl fuses the roles sharing a
device into one actor per device. Here the engine joins the rank's own torch process group as TRL's does, and
new weights reach it in place (`ColocatedRank.sync_engine`, colocated_rank.py): the trainer's tensors are handed
to the engine's `load_weights` in the same process, with no serialisation and no Ray object between them.

What the layout cannot do it refuses at validation (`refuse`): `rollout.async` (one process cannot generate
while it trains), environments (a stalled environment is ended by killing the engine's process, here a policy
rank), a weight transport and tensor parallelism (the engine lives in the rank's process, on its GPU).

A rank that dies takes its engine and its training state with it; nothing is restarted in place (`retrying`
makes the call once), so the stage starts its ranks again from the last checkpoint (`layouts.lost`).
"""

from __future__ import annotations

from dataclasses import replace


class Colocated:
    """`Layout` (stages/ppo/layouts/__init__.py) with one process per policy rank and nothing else."""

    name = "colocated"
    gpu_memory_share = 0.3  # the engine shares its GPU with every role of the rank

    @classmethod
    def refuse(cls, cfg) -> None:
        fix, tp = "or set stages.ppo.layout: separate", cfg.rollout.tensor_parallel_size
        if cfg.rollout.sync_transport == "nccl":
            raise ValueError("rollout.sync_transport nccl: in layout colocated each rank's engine takes its trainer's "
                             f"tensors in the same process, with no transport; remove rollout.sync_transport, {fix}")
        if tp > 1:
            raise ValueError(f"rollout.tensor_parallel_size {tp}: in layout colocated each rank's engine runs in the "
                             f"rank's process on the rank's one GPU; set rollout.tensor_parallel_size: 1, {fix}")
        if cfg.rollout.async_:
            raise ValueError("rollout.async: in layout colocated a rank's engine and trainer share one process and "
                             f"take turns, so generation cannot overlap training; set rollout.async: false, {fix}")
        if cfg.environment:
            raise ValueError("environment: an environment runs your code beside the engine, and one that holds the "
                             "interpreter is ended by killing the engine's process, which in layout colocated is a "
                             f"policy rank (its training state with it); {fix}")
        n = cfg.policy.num_ranks
        given = [("rollout.num_engines", cfg.rollout.num_engines)] \
            if "num_engines" in cfg.rollout.model_fields_set else []
        used = [("critic", cfg.critic)] * (cfg.algorithm == "ppo") + [("reference", cfg.reference)] \
            + [("reward", cfg.reward)] * bool(cfg.rewards.model_weight) \
            + ([("distill.role", cfg.distill.role)] if cfg.distill else [])
        given += [(f"{name}.num_ranks", role.num_ranks) for name, role in used if "num_ranks" in role.model_fields_set]
        for key, value in given:
            if value != n:
                raise ValueError(f"{key}: {value}, but in layout colocated every role and one engine sit in each of "
                                 f"the policy's {n} ranks; remove {key} (or set it to {n}), {fix}")

    @classmethod
    def ranks(cls, cfg, role) -> int:
        return cfg.policy.num_ranks  # every role sits in each policy rank

    @classmethod
    def reference_in_ranks(cls, cfg) -> bool:
        return not cfg.policy.lora  # a LoRA policy is its own reference (adapter off)

    @classmethod
    def bundles(cls, cfg, gpu: bool) -> dict[str, list[dict[str, float]]]:
        share = {"GPU": cfg.gpus_per_process} if gpu else {}
        return {"policy": [{"CPU": cfg.policy.cpus_per_rank, **share}] * cfg.policy.num_ranks}

    @classmethod
    def describe(cls, cfg, roles_note: str) -> str:
        return (f"starting {cfg.policy.num_ranks} colocated ranks, each with its vLLM engine and every role "
                f"({roles_note})")

    # ------------------------------------------------------------------ running

    restarts = 0  # nothing is restarted in place

    def __init__(self, cfg):
        self.cfg, self.ranks_group, self.pending = cfg, None, []

    def start(self, s, roles: list[tuple], engine, gpu: bool, seed: int, run_storage) -> None:
        """One actor per policy rank, set up with every role's spec (their DeepSpeed configs for the policy's rank
        count) and the engine's; `s.groups`: the policy is the ranks themselves, every other role a `RoleView`."""
        from stages.ppo.groups import ModelGroup
        from stages.ppo.layouts.colocated_rank import ColocatedRank, RoleView
        from stages.ppo.layouts.rank_spec import role_spec

        cfg, n = self.cfg, self.cfg.policy.num_ranks
        specs = {name: role_spec(Colocated, name, role.model_copy(update={"num_ranks": n}), kind, path, cfg,
                                 trainable, gpu, s.tok.pad_token_id, seed, run_storage)
                 for name, role, kind, path, trainable in roles}
        policy_dir = next(model_dir for name, _, _, model_dir, _ in roles if name == "policy")
        engine = replace(engine, backend="external_launcher", sleep_mode=cfg.rollout.sleep_mode,
                         sleep_level=cfg.rollout.sleep_level)
        # Ray starts each rank with the engine's environment (VLLM_ENABLE_V1_MULTIPROCESSING=0, tcmalloc on CPU):
        # vLLM reads it at import, in the rank's process.
        self.ranks_group = ModelGroup("policy", ColocatedRank, n, cfg.policy.cpus_per_rank,
                                      gpu and cfg.gpus_per_process, cfg.placement_strategy,
                                      runtime_env=engine.runtime_env(), wait=False)
        s.groups = {name: self.ranks_group if name == "policy" else RoleView(self.ranks_group, name)
                    for name in specs}
        self.pending = self.ranks_group.run("setup_rank", specs, str(policy_dir), engine)

    def ready(self, clock) -> dict[str, int]:
        import ray

        ray.get(self.ranks_group.pg.ready(), timeout=300)  # a clear error if resources never come
        ray.get(self.ranks_group.ready_refs)  # process group joined
        params = ray.get(self.pending)[0]  # every role's, and the engines built in the ranks
        clock.mark("roles")
        clock.mark("engines")
        return params

    def processes(self) -> dict[str, list]:
        return {"rank": self.ranks_group.actors}  # the policy's ranks are the only processes

    def rollouts(self, prompts: list[dict], sampling: dict, episode=None) -> list:
        """Rank r generates its share on its own engine."""
        from stages.ppo.groups import shard

        actors = self.ranks_group.actors
        return [a.engine_generate.remote(p, sampling)
                for a, p in zip(actors, shard([r["prompt_ids"] for r in prompts], len(actors)))]

    def generate(self, rows: list[dict], sampling: dict, episode=None, say=print) -> list[list[dict]]:
        import ray

        from stages.ppo.groups import shard

        actors = self.ranks_group.actors
        parts = shard([r["prompt_ids"] for r in rows], len(actors))
        return [g for part in ray.get([a.engine_generate.remote(p, sampling) for a, p in zip(actors, parts) if p])
                for g in part]

    def retrying(self, call, say=print, since: int | None = None):
        """`call()` once: an engine dies with its rank, and with the rank its training state, so there is nothing
        to restart in place; the error ends the attempt and the stage starts again (`layouts.lost`)."""
        return call()

    def kill_engine(self, index: int) -> None:
        """Kill rank `index` (its engine lives in it) and return once Ray reports it dead."""
        from stages.common.followed import kill_engine

        kill_engine(self.ranks_group.actors[index])

    def sync_weights(self, version: int) -> tuple[float, int]:
        """Every rank loads its policy's weights into its engine in place; (the slowest rank's seconds, bytes
        per rank)."""
        import ray

        done = ray.get([a.sync_engine.remote(version) for a in self.ranks_group.actors])
        return max(t for t, _ in done), done[0][1]

    def close(self) -> None:
        if self.ranks_group is not None:
            self.ranks_group.shutdown()
