"""PPO's set-up: read the prompts, check what the config points at, then start every role (a `ModelGroup`
of `PPOWorker` ranks each) and the vLLM engines at once; `Session` holds them and `close()` ends them all.

The roles: policy (trainable, from the SFT model), critic (trainable, from the reward model; PPO only),
reference (frozen SFT model, for the KL penalty; the policy itself with its adapter off under LoRA, or a
copy in each policy rank with `reference.colocate`), reward (the reward model, when `rewards.model_weight`
is not 0) and teacher (`distill`). Start-up is timed part by part for the stage's start-up line
(`events.StartupClock`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline.errors import UserError
from stages.ppo.config import PPOConfig

if TYPE_CHECKING:  # annotations only
    from pipeline.stage import StageContext


@dataclass
class Session:
    """What `run` starts and works with: the prompts, the roles' actor groups and the engines.

    `close()` ends every actor it holds, whatever happened (the stage calls it in `finally`)."""

    tok: Any
    rule: Any  # stages.ppo.rewards.RuleReward: .scores(texts, rows), .counts(), .close()
    train_rows: list[dict]
    eval_rows: list[dict]
    gold: Callable[[str, str], float] | None = None  # task.preference.gold: the judge no stage trains on
    verify: Any = None  # task.verifier: what held-out accuracy counts (scoring.accuracy_of)
    moments: Any = None  # rewards.normalize: running statistics of the reward model's scores
    episode: Any = None  # stages.ppo.episodes.EpisodeSpec with an environment: samples are multi-turn episodes
    env_budget: Any = None  # with an environment: rewards.ErrorBudget over its broken episodes
    groups: dict[str, Any] = field(default_factory=dict)  # role -> ModelGroup
    trained: dict[str, Any] = field(default_factory=dict)  # the trainable roles among them
    pool: Any = None  # the EnginePool
    transport: Any = None  # rollout.sync_transport nccl: stages.ppo.nccl_sync.NcclSync

    def role(self, name: str):
        return self.groups.get(name)

    def sync_weights(self, version: int) -> tuple[float, int]:
        """The policy's current weights into every engine, tagged `version`: (the slowest load's seconds, bytes).
        Separate layout: one put into the object store that every engine loads (or NCCL broadcasts,
        stages/ppo/nccl_sync.py); colocated: each rank's engine loads its trainer's tensors in place
        (stages/ppo/colocated.py)."""
        if hasattr(self.pool, "sync_in_place"):
            return self.pool.sync_in_place(version)
        if self.transport is not None:  # over NCCL from policy rank 0 into each engine
            return self.transport.sync(version)
        weights_ref, nbytes = self.role("policy").get("export_weights")[0]
        return self.pool.sync(weights_ref, version=version), nbytes

    def close(self) -> None:
        for scorer in {id(x): x for x in (self.rule, self.verify)}.values():  # their Ray workers, if any
            if hasattr(scorer, "close"):
                scorer.close()
        if self.pool is not None:
            self.pool.shutdown()
        for g in self.groups.values():
            g.shutdown()


def _read_prompts(path: Path) -> list[dict]:
    from stages.common.parquet import read_rows

    return read_rows(path)


def check_teacher(teacher: Path, student: Path) -> None:
    """A teacher scores the student's token ids: it must read them as the student does (the same vocabulary)."""
    from stages.common.models import load_tokenizer

    theirs, ours = load_tokenizer(teacher).get_vocab(), load_tokenizer(student).get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise UserError(f"stages.ppo.distill.teacher: {teacher} has another tokenizer than the student ({student}): "
                        f"{len(theirs)} vs {len(ours)} tokens, e.g. {differ}; a teacher must share the student's "
                        "tokenizer (distil from a model trained from the same base)")


def _check_cluster(cfg: PPOConfig, gpu: bool) -> None:
    """Fail before placing anything when the cluster cannot hold every rank and engine at once (CPUs, and on GPUs
    their shares of the cluster's GPUs: a placement group Ray can never fill would wait for the start-up's timeout)."""
    import ray

    from stages.ppo.placement import on_cpu, shortfall

    if gpu:
        shortfall(cfg, ray.cluster_resources().get("GPU", 0))
    else:
        on_cpu(cfg)
    have = ray.cluster_resources().get("CPU", 0)
    if cfg.cpus_needed() > have:
        raise UserError(f"stages.ppo.rollout.num_engines: the roles and {cfg.rollout.num_engines} engines need "
                        f"{cfg.cpus_needed():g} logical CPUs but the Ray cluster has {have:g}; use fewer engines or "
                        "ranks, or a larger cluster (ray.num_cpus for a local one)")


def memory_share(rollout, layout: str, gpu: bool) -> float:
    """An engine's `gpu_memory_utilization`: the configured one, else by where it runs (rollout's field doc)."""
    if rollout.gpu_memory_utilization is not None:
        return rollout.gpu_memory_utilization
    return 0.9 if gpu and layout == "separate" else 0.3


def batched_tokens(rollout, longest: int, gpu: bool) -> int | None:
    """`rollout.max_num_batched_tokens`, refused before any engine starts where vLLM would refuse it: on the CPU
    (no chunked prefill, stages/common/engines.py) a step must hold the longest prompt and its response."""
    budget = rollout.max_num_batched_tokens
    if budget is not None and not gpu and budget < longest:
        raise UserError(f"stages.ppo.rollout.max_num_batched_tokens is {budget}, but the longest prompt plus "
                        f"max_new_tokens is {longest} tokens and the CPU engines cannot split a prompt: set it to "
                        f"at least {longest}, or leave it empty")
    return budget


def engine_dtype(policy, gpu: bool) -> str:
    """The rollout engines' dtype: the policy's training precision on GPUs (`policy.deepspeed.precision`; 'auto' is
    bf16 there), so that sampler and trainer compute alike and vLLM's flash attention backends (fp16/bf16 only)
    serve them; float32 on the CPU, as the CPU trainer computes (each role keeps its own precision)."""
    from stages.common.deepspeed import use_bf16

    return "bfloat16" if gpu and use_bf16(policy.deepspeed, gpu) else "float32"


def role_spec(name: str, role, kind: str, model_dir: Path, cfg: PPOConfig, trainable: bool, gpu: bool, pad_id: int,
              seed: int, run_storage) -> dict:
    """What a PPOWorker rank of `role` sets up with (`PPOWorker.setup`): its model, DeepSpeed config and LoRA."""
    from stages.common.deepspeed import engine_config, use_bf16

    bf16 = use_bf16(role.deepspeed, gpu)
    ds_config = engine_config(role.deepspeed, cfg.micro_batch_size, role.num_ranks, bf16, cfg.mini_batch_size,
                              role.lr, role.weight_decay, role.grad_clip) if trainable \
        else engine_config(role.deepspeed, cfg.micro_batch_size, role.num_ranks, bf16)  # no optimizer
    # the policy's ranks also hold the frozen reference (reference.colocate, or the colocated layout; not LoRA's)
    in_rank = name == "policy" and (cfg.reference.colocate or cfg.layout == "colocated") and not role.lora
    return {"role": name, "kind": kind, "model_dir": str(model_dir), "trainable": trainable, "pad_id": pad_id,
            "seed": seed, "storage": run_storage, "activation_checkpointing": role.deepspeed.activation_checkpointing,
            "zero_head": kind == "value" and cfg.critic_zero_init, "ds_config": ds_config,
            "lora": role.lora.model_dump(mode="json") if trainable and role.lora else None,
            "reference_dir": str(model_dir) if in_rank else None}


def start_role(name: str, role, kind: str, model_dir: Path, cfg: PPOConfig, trainable: bool, gpu: bool,
               pad_id: int, seed: int, run_storage):
    """A ModelGroup of PPOWorker ranks holding `model_dir` as `kind`; returns (group, setup refs)."""
    from stages.ppo.groups import ModelGroup
    from stages.ppo.worker import PPOWorker

    group = ModelGroup(name, PPOWorker, role.num_ranks, role.cpus_per_rank, gpu and cfg.gpus_per_process,
                       cfg.placement_strategy, wait=False)  # the bundles placement.bundles counts
    spec = role_spec(name, role, kind, model_dir, cfg, trainable, gpu, pad_id, seed, run_storage)
    return group, group.run("setup", spec)


def start(cfg: PPOConfig, ctx: StageContext, clock) -> Session:
    """Read the prompts, then start the roles (policy, reference, critic for PPO, reward model when
    it is weighted) and the vLLM engines; the roles load their models while the engines start.
    `clock` (events.StartupClock) gets the parts: driver, ray, processes, roles and engines."""
    import ray

    from stages.common.devices import cluster_gpus
    from stages.common.lora import describe
    from stages.common.engines import EnginePool, EngineSpec
    from stages.common.models import load_tokenizer, saved_heads
    from stages.ppo.rewards import ErrorBudget
    from stages.ppo.sandbox import allowance_env, check_isolation, model_code_users, permit
    from stages.ppo.scoring import rule_reward

    # The policy starts from the SFT model (the base model in a pipeline without sft); the critic from the
    # reward model's backbone, or from the policy's start in a pipeline without a reward stage.
    sft = ctx.inputs.get("sft_model") or ctx.inputs["base_model"]
    rm_dir, data = ctx.inputs.get("reward_model") or sft, ctx.inputs["prompt_data"]
    train_rows, eval_rows = _read_prompts(data / "train"), _read_prompts(data / "eval")[: cfg.eval_prompts]
    if cfg.distill:
        check_teacher(cfg.distill.teacher, sft)
    if len(train_rows) < cfg.prompts_per_iteration:
        raise UserError(f"stages.ppo.prompts_per_iteration ({cfg.prompts_per_iteration}) exceeds the {len(train_rows)} "
                        "training prompts; lower it or generate more prompts (stages.data.generate.prompts)")
    permit(cfg.sandbox.allow_weak)  # run_python's own refusal, here and (allowance_env) in the workers
    users = model_code_users(cfg.rewards.rule, cfg.environment.name if cfg.environment else None)
    if users:  # model-written code runs in this stage: a weak sandbox is refused now; the tier goes on the run
        ctx.set_tags(check_isolation(cfg.sandbox.allow_weak, users, ctx.progress))
    rule = rule_reward(cfg.rewards.rule, ctx.pipeline.task.verifier, cfg.rewards, ctx.progress)
    clock.mark("driver")
    # Loading the tokenizer (importing transformers, ~4 s of CPU) overlaps Ray's start-up, which mostly
    # waits on the daemons it spawns. ctx.ray() stays on the main thread (it installs a signal handler).
    with ThreadPoolExecutor(1) as loader:
        tok = loader.submit(load_tokenizer, sft)
        ctx.ray()
        s = Session(tok.result(), rule, train_rows, eval_rows, verify=_verifier(cfg, ctx, rule))
    clock.mark("ray")  # the tokenizer loaded meanwhile
    if ctx.pipeline.task.preference.gold:
        from stages.common.tasks import gold_function

        s.gold = gold_function(ctx.pipeline.task.preference.gold)
    if cfg.rewards.normalize:
        from stages.ppo.scoring import RunningMoments

        s.moments = RunningMoments()
    gpu, seed, ppo = cluster_gpus() > 0, ctx.pipeline.seed, cfg.algorithm == "ppo"  # the cluster's GPUs, not ours
    _check_cluster(cfg, gpu)
    lora_ref = cfg.policy.lora is not None  # the reference is the LoRA policy with its adapter off
    colocated = cfg.layout == "colocated"
    in_policy = lora_ref or cfg.reference.colocate or colocated  # no reference ranks of its own
    critic_note = f", critic x{cfg.ranks(cfg.critic)}{describe(cfg.critic.lora)}" if ppo else ""
    ref_note = "reference: the policy without its adapter" if lora_ref else \
        "reference: a copy in each policy rank" if in_policy else f"reference x{cfg.reference.num_ranks}"
    roles_note = (f"policy x{cfg.policy.num_ranks}{describe(cfg.policy.lora)}{critic_note}, {ref_note}"
                  f"{f', reward x{cfg.ranks(cfg.reward)}' if cfg.rewards.model_weight else ''}"
                  f"{f', teacher x{cfg.ranks(cfg.distill.role)}' if cfg.distill else ''}")
    ctx.progress(f"starting {cfg.policy.num_ranks} colocated ranks, each with its vLLM engine and every role "
                 f"({roles_note})" if colocated else
                 f"starting {cfg.rollout.num_engines} vLLM engines and the roles ({roles_note})")
    heads = saved_heads(rm_dir) if cfg.rewards.model_weight else 1  # the driver holds its inputs
    if heads > 1 or cfg.rewards.ensemble != "mean" and cfg.rewards.model_weight:
        ctx.progress(f"reward model: {heads} score head(s), combined by {cfg.rewards.ensemble}"
                     + ("" if heads > 1 else " (one head: nothing to combine; set stages.reward.heads)"))
    if cfg.environment:
        s.episode = _episode_spec(cfg)
        s.env_budget = ErrorBudget(f"the environment {cfg.environment.name}", cfg.rewards.max_error_share, "episodes")
    longest = max(r["num_tokens"] for r in train_rows + eval_rows) + cfg.response_tokens()
    spec = EngineSpec(max_model_len=longest, seed=seed, gpu=gpu, gpu_share=cfg.gpus_per_process,
                      kv_cache_gb=cfg.rollout.kv_cache_gb, dtype=engine_dtype(cfg.policy, gpu),
                      gpu_memory_utilization=memory_share(cfg.rollout, cfg.layout, gpu),
                      num_cpus=cfg.rollout.cpus_per_engine,
                      max_num_batched_tokens=batched_tokens(cfg.rollout, longest, gpu),
                      tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                      storage=ctx.storage, env=allowance_env())  # the python tool's run_python
    try:
        roles = [("policy", cfg.policy, "causal", sft, True)]
        roles += [] if in_policy else [("reference", cfg.reference, "causal", sft, False)]
        roles += [("critic", cfg.critic, "value", rm_dir, True)] if ppo else []
        roles += [("reward", cfg.reward, "reward", rm_dir, False)] if cfg.rewards.model_weight else []
        roles += [("teacher", cfg.distill.role, "causal", cfg.distill.teacher, False)] if cfg.distill else []
        # Everything starts at once (roles and engines load their models concurrently): nothing blocks
        # until every placement group is requested and every actor created.
        requested = time.time()
        nccl = cfg.rollout.sync_transport == "nccl"  # engines of their own take the weights over vLLM's NCCL transfer
        if colocated:  # one actor per policy rank holds every role and an engine (stages/ppo/colocated.py)
            from stages.ppo.colocated import start_ranks

            n = cfg.policy.num_ranks  # every role on the policy's ranks: their DeepSpeed configs for that many
            specs = {name: role_spec(name, role.model_copy(update={"num_ranks": n}), kind, path, cfg, trainable, gpu,
                                     s.tok.pad_token_id, seed, ctx.storage)
                     for name, role, kind, path, trainable in roles}
            pending = {"ranks": start_ranks(s, cfg, specs, sft, spec, gpu)}
        else:
            engine_cls = _engine_class(s.episode is not None, nccl)
            s.pool = EnginePool(str(sft), replace(spec, weight_transfer="nccl") if nccl else spec,
                                cfg.rollout.num_engines, cfg.rollout.placement_strategy, wait=False,
                                **({"engine_cls": engine_cls} if engine_cls else {}))
            pending = {}
            for name, role, kind, model_dir, trainable in roles:
                s.groups[name], pending[name] = start_role(name, role, kind, model_dir, cfg, trainable, gpu,
                                                            s.tok.pad_token_id, seed, ctx.storage)
        s.trained = {name: s.groups[name] for name, *_, trainable in roles if trainable}
        ray.get([g.pg.ready() for g in s.groups.values()], timeout=300)  # a clear error if resources never come
        ray.get([r for g in s.groups.values() for r in g.ready_refs])  # process groups joined
        params = {name: ray.get(refs)[0] for name, refs in pending.items()}  # models loaded
        params = params.pop("ranks", params)  # the colocated ranks report every role's
        clock.mark("roles")  # with the colocated layout, the engines too (they are built in the ranks)
        s.pool.ready()
        if nccl:
            from stages.ppo.nccl_sync import NcclSync

            s.transport = NcclSync(s.role("policy"), s.pool, 1 + cfg.rollout.tensor_parallel_size)
        clock.mark("engines")  # what the engines took beyond the roles (they started together)
        _startup_details(s, clock, requested)
    except BaseException:
        s.close()
        raise
    ctx.progress("ready: " + ", ".join(f"{k} {v / 1e6:.2f}M params" for k, v in params.items()))
    return s


def _verifier(cfg: PPOConfig, ctx: StageContext, rule):
    """What held-out accuracy counts (task.verifier): a built-in verifier in this process; a 'module:function'
    one is the user's code, run on reward workers with their timeout and error budget (the rule reward itself
    when that is the verifier)."""
    from stages.common.verifiers import BUILTINS, verifier_function
    from stages.ppo.scoring import rule_reward

    spec = ctx.pipeline.task.verifier
    if spec in BUILTINS:
        return verifier_function(spec)
    return rule if cfg.rewards.rule == "verifier" else rule_reward("verifier", spec, cfg.rewards, ctx.progress)


def _startup_details(s: Session, clock, requested: float) -> None:
    """Where the roles' and engines' start went, slowest actor of each kind (they run side by side, so these
    overlap and are details, not parts): its process start (requested -> constructor), then what each
    reported (imports, model load, DeepSpeed or vLLM initialisation)."""
    import ray

    from stages.ppo.colocated import RankEngines

    if isinstance(s.pool, RankEngines):  # the policy's ranks are the only processes
        actors = {"rank": s.role("policy").actors}
    else:
        actors = {name: g.actors for name, g in s.groups.items()} | {"engine": s.pool.engines}
    clock.processes = sum(len(group) for group in actors.values())
    timings = {name: ray.get([a.timings.remote() for a in group]) for name, group in actors.items()}
    for name, ranks in timings.items():
        clock.detail(f"{name}_process", max(t["born"] for t in ranks) - requested)
        for part in ranks[0]:
            if part != "born":
                clock.detail(f"{name}_{part}", max(t.get(part, 0.0) for t in ranks))


def _episode_spec(cfg: PPOConfig):
    """The environment's settings for the engines; fails here, before anything starts, when the
    environment class or the tool parser cannot be found."""
    from stages.ppo.environments import environment_factory
    from stages.ppo.episodes import EpisodeSpec

    env = cfg.environment
    environment_factory(env.name, env.options)()  # one instance: a wrong class or option fails now
    try:
        from vllm.tool_parsers import ToolParserManager

        ToolParserManager.get_tool_parser(env.tool_parser)
    except KeyError:
        raise UserError(f"stages.ppo.environment.tool_parser: vLLM has no tool parser {env.tool_parser!r}; use the "
                        "one `vllm serve --tool-call-parser` takes for your model (hermes for Qwen, Hermes, SmolLM3 "
                        "and the built-in model)") from None
    from stages.ppo.rewards import import_root

    return EpisodeSpec(env.name, dict(env.options), env.max_turns, env.max_tokens, env.tool_timeout_s,
                       env.max_output_chars, env.tool_parser, env.tool_workers,
                       import_root(env.name) if ":" in env.name else None)


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
