"""PPO's set-up: read the prompts, check what the config points at, then have the layout (stages/ppo/layouts/)
start every role and the vLLM engines at once; `Session` holds them and `close()` ends them all.

The roles: policy (trainable, from the SFT model), critic (trainable, from the reward model; PPO only),
reference (frozen SFT model, for the KL penalty; the policy itself with its adapter off under LoRA, or a
copy in each policy rank with `reference.colocate`), reward (the reward model, when `rewards.model_weight`
is not 0) and teacher (`distill`). Start-up is timed part by part for the stage's start-up line
(`events.StartupClock`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
    groups: dict[str, Any] = field(default_factory=dict)  # role -> ModelGroup (or what answers as one)
    trained: dict[str, Any] = field(default_factory=dict)  # the trainable roles among them
    layout: Any = None  # stages.ppo.layouts.Layout: where the roles and engines run, and how they are reached

    def role(self, name: str):
        return self.groups.get(name)

    def close(self) -> None:
        for scorer in {id(x): x for x in (self.rule, self.verify)}.values():  # their Ray workers, if any
            if hasattr(scorer, "close"):
                scorer.close()
        if self.layout is not None:
            self.layout.close()


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


def memory_share(rollout, layout, gpu: bool) -> float:
    """An engine's `gpu_memory_utilization`: the configured one, else its layout's share on GPUs (rollout's field
    doc); 0.3 on the CPU, where vLLM takes a KV cache size instead."""
    if rollout.gpu_memory_utilization is not None:
        return rollout.gpu_memory_utilization
    return layout.gpu_memory_share if gpu else 0.3


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


def start(cfg: PPOConfig, ctx: StageContext, clock) -> Session:
    """Read the prompts, then start the roles (policy, reference, critic for PPO, reward model when
    it is weighted) and the vLLM engines; the roles load their models while the engines start.
    `clock` (events.StartupClock) gets the parts: driver, ray, processes, roles and engines."""
    from stages.common.devices import cluster_gpus
    from stages.common.lora import describe
    from stages.common.engines import EngineSpec
    from stages.common.models import load_tokenizer, saved_heads
    from stages.ppo.layouts import layout_of
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
    layout = layout_of(cfg)
    lora_ref = cfg.policy.lora is not None  # the reference is the LoRA policy with its adapter off
    in_policy = lora_ref or layout.reference_in_ranks(cfg)  # no reference ranks of its own
    critic_note = f", critic x{cfg.ranks(cfg.critic)}{describe(cfg.critic.lora)}" if ppo else ""
    ref_note = "reference: the policy without its adapter" if lora_ref else \
        "reference: a copy in each policy rank" if in_policy else f"reference x{cfg.reference.num_ranks}"
    roles_note = (f"policy x{cfg.policy.num_ranks}{describe(cfg.policy.lora)}{critic_note}, {ref_note}"
                  f"{f', reward x{cfg.ranks(cfg.reward)}' if cfg.rewards.model_weight else ''}"
                  f"{f', teacher x{cfg.ranks(cfg.distill.role)}' if cfg.distill else ''}")
    ctx.progress(layout.describe(cfg, roles_note))
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
                      gpu_memory_utilization=memory_share(cfg.rollout, layout, gpu),
                      num_cpus=cfg.rollout.cpus_per_engine,
                      max_num_batched_tokens=batched_tokens(cfg.rollout, longest, gpu),
                      tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                      storage=ctx.storage, env=allowance_env())  # the python tool's run_python
    s.layout = layout(cfg)
    try:
        roles = [("policy", cfg.policy, "causal", sft, True)]
        roles += [] if in_policy else [("reference", cfg.reference, "causal", sft, False)]
        roles += [("critic", cfg.critic, "value", rm_dir, True)] if ppo else []
        roles += [("reward", cfg.reward, "reward", rm_dir, False)] if cfg.rewards.model_weight else []
        roles += [("teacher", cfg.distill.role, "causal", cfg.distill.teacher, False)] if cfg.distill else []
        # Everything starts at once (roles and engines load their models concurrently): nothing blocks
        # until every placement group is requested and every actor created.
        requested = time.time()
        s.layout.start(s, roles, spec, gpu, seed, ctx.storage)
        s.trained = {name: s.groups[name] for name, *_, trainable in roles if trainable}
        params = s.layout.ready(clock)  # clock parts: roles, engines
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

    actors = s.layout.processes()
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

