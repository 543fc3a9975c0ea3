"""PPO stage: improve the SFT policy with rollouts from vLLM engines and a reward to maximise.

Roles (each a `ModelGroup` of `PPOWorker` ranks with DeepSpeed inside, sized in the YAML):
policy (trainable, from the SFT model), critic (trainable, from the reward model; PPO only),
reference (frozen SFT model, for the KL penalty; with `policy.lora` the policy itself with its
adapter switched off, so no second copy is started) and reward (the reward model; used when
`rewards.model_weight` is not 0). Rollouts come from `rollout.num_engines` vLLM engines, each a
Ray actor (`stages/common/engines.py`, shared with SFT's evaluation); policy ranks send their share of the prompts to engines
themselves (any rank can call any engine). The score of a response mixes the reward model and a
rule reward (the task verifier, or your own `module:function`) by `rewards.*_weight`.

The driver is one loop, `run()`, reading top to bottom on one screen:

    sample prompts -> generate -> score -> reference/policy log-probs, values -> advantages
    -> PPO epochs (policy and critic) -> sync weights to the engines -> log -> checkpoint

each step a named function after it (`_begin`, `_score`, `_train`, `_sync`, `_log`, `_checkpoint`),
with set-up (`_start`: every role and engine starts at once), generation requests (`_request`
launches, `_collect` waits; with `rollout.async` the next iteration's request is launched before
this one trains, one-step off-policy, and `staleness` is checked and logged), the held-out
evaluation (`scoring.evaluate`, `_finish`) and teardown (`_Session.close`) in named helpers beside
it. The scoring passes (reward model, reference, old policy, critic) are issued together. The package:

    __init__.py  this loop                        config.py   the typed config (PPOConfig)
    rl.py        the pure RL math (tested)        scoring.py  rewards, evaluation, sign test
    groups.py    ModelGroup: a model on N actors  worker.py   PPOWorker: one rank of a role
    rewards.py   the rule reward and its workers  sandbox.py  code_tests' sandboxed Python
    environments.py, episodes.py                  multi-turn rollouts with tools (AgentEngine)

After every update the policy's full weights go into the object store once and every engine
loads them from there (zero-copy on the same node), so rollouts always come from the current
policy. The critic-free algorithms drop the critic: `grpo`, `rloo` and `dr_grpo` use baselines
from the other `sampling.n` samples of each prompt (KL to the reference in the loss),
`reinforce_pp` whitens per-token returns over the batch (KL in the reward); `advantages()` picks
the estimator. The engines return the log-probs of the tokens they sample; their gap to the
trainer's (`logprob_mismatch_*`) is logged every iteration, and `tis` corrects for it. The math
is in `rl.py`, tested against hand-computed values.

Held-out evaluation: greedy answers of the engines on every eval prompt (and `eval_samples`
sampled ones, same seed), before PPO (the SFT policy) and after, scored by the same reward;
MLflow gets both, and how many prompts changed either way (a paired sign test says whether the
gain is noise). `bench/learning.py` runs this per seed and algorithm. With a gold preference
(`task.preference.gold`, docs/rlhf.md), the gold function, which trains nothing, also judges the
sampled answers of the trained policy against the SFT policy's (`gold_win_rate`), and every
`eval_every` iterations `_curve_point` logs the over-optimisation curve (proxy, gold, KL on
held-out prompts). `bench/rlhf.py` runs that per seed and algorithm.

Run alone: `python -m pipeline run configs/full.yaml --only ppo` (after `sft` and `reward`).
A rerun after an interruption resumes from the last checkpoint (`checkpoint_every`).
For fault drills, `PIPELINE_FAULT_KILL_ENGINE_AT=K` kills rollout engine 0 at iteration K (from
0); the stage restarts it, re-syncs its weights and carries on. `PIPELINE_FAULT_AFTER_ITERATION=N`
raises once after the checkpoint of iteration N (like PIPELINE_FAULT_AFTER_STEP in training).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline.errors import UserError
from stages.ppo.config import PPOConfig, check, wire  # noqa: F401  (the stage's config and hooks, for the registry)

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext

ROLES = ("policy", "critic", "reference", "reward")


# --------------------------------------------------------------------------- set-up and teardown


@dataclass
class _Session:
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

    def role(self, name: str):
        return self.groups.get(name)

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


def _check_teacher(teacher: Path, student: Path) -> None:
    """A teacher scores the student's token ids: it must read them as the student does (the same vocabulary)."""
    from stages.common.models import load_tokenizer

    theirs, ours = load_tokenizer(teacher).get_vocab(), load_tokenizer(student).get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise UserError(f"stages.ppo.distill.teacher: {teacher} has another tokenizer than the student ({student}): "
                        f"{len(theirs)} vs {len(ours)} tokens, e.g. {differ}; a teacher must share the student's "
                        "tokenizer (distil from a model trained from the same base)")


def raw_inputs(pcfg) -> list[Path]:
    """The teacher's files (stages.ppo.distill.teacher): a changed teacher reruns ppo."""
    section = pcfg.stages.ppo
    if section is None or section.distill is None:
        return []
    return sorted(p for p in section.distill.teacher.rglob("*") if p.is_file())


def _check_cluster(cfg: PPOConfig) -> None:
    """Fail before placing anything when the cluster cannot hold every rank and engine at once."""
    import ray

    have = ray.cluster_resources().get("CPU", 0)
    if cfg.cpus_needed() > have:
        raise UserError(f"stages.ppo.rollout.num_engines: the roles and {cfg.rollout.num_engines} engines need "
                        f"{cfg.cpus_needed():g} logical CPUs but the Ray cluster has {have:g}; use fewer engines or "
                        "ranks, or a larger cluster (ray.num_cpus for a local one)")


def _start_role(name: str, role, kind: str, model_dir: Path, cfg: PPOConfig, trainable: bool, gpu: bool,
                pad_id: int, seed: int, run_storage):
    """A ModelGroup of PPOWorker ranks holding `model_dir` as `kind`; returns (group, setup refs)."""
    from stages.common.deepspeed import device_env, engine_config, use_bf16
    from stages.ppo.groups import ModelGroup
    from stages.ppo.worker import PPOWorker

    bf16 = use_bf16(role.deepspeed, gpu)
    ds_config = engine_config(role.deepspeed, cfg.micro_batch_size, role.num_ranks, bf16, cfg.mini_batch_size,
                              role.lr, role.weight_decay, role.grad_clip) if trainable \
        else engine_config(role.deepspeed, cfg.micro_batch_size, role.num_ranks, bf16)  # no optimizer
    group = ModelGroup(name, PPOWorker, role.num_ranks, role.cpus_per_rank, gpu, cfg.placement_strategy,
                       env=device_env(gpu), wait=False)
    spec = {"role": name, "kind": kind, "model_dir": str(model_dir), "trainable": trainable, "pad_id": pad_id,
            "seed": seed, "storage": run_storage, "activation_checkpointing": role.deepspeed.activation_checkpointing,
            "zero_head": kind == "value" and cfg.critic_zero_init, "ds_config": ds_config,
            "lora": role.lora.model_dump(mode="json") if trainable and role.lora else None,
            # the policy's ranks also hold the frozen reference (reference.colocate, full fine-tuning)
            "reference_dir": str(model_dir) if name == "policy" and cfg.reference.colocate and not role.lora else None}
    return group, group.run("setup", spec)


def _start(cfg: PPOConfig, ctx: StageContext, clock) -> _Session:
    """Read the prompts, then start the roles (policy, reference, critic for PPO, reward model when
    it is weighted) and the vLLM engines; the roles load their models while the engines start.
    `clock` (events.StartupClock) gets the parts: driver, ray, processes, roles and engines."""
    import ray

    from stages.common.deepspeed import use_gpu
    from stages.common.lora import describe
    from stages.common.engines import EnginePool, EngineSpec
    from stages.common.models import load_tokenizer, saved_heads
    from stages.ppo.rewards import ErrorBudget
    from stages.ppo.sandbox import check_isolation, model_code_users
    from stages.ppo.scoring import rule_reward

    # The policy starts from the SFT model (the base model in a pipeline without sft); the critic from the
    # reward model's backbone, or from the policy's start in a pipeline without a reward stage.
    sft = ctx.inputs.get("sft_model") or ctx.inputs["base_model"]
    rm_dir, data = ctx.inputs.get("reward_model") or sft, ctx.inputs["prompt_data"]
    train_rows, eval_rows = _read_prompts(data / "train"), _read_prompts(data / "eval")[: cfg.eval_prompts]
    if cfg.distill:
        _check_teacher(cfg.distill.teacher, sft)
    if len(train_rows) < cfg.prompts_per_iteration:
        raise UserError(f"stages.ppo.prompts_per_iteration ({cfg.prompts_per_iteration}) exceeds the {len(train_rows)} "
                        "training prompts; lower it or generate more prompts (stages.data.generate.prompts)")
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
        s = _Session(tok.result(), rule, train_rows, eval_rows, verify=_verifier(cfg, ctx, rule))
    clock.mark("ray")  # the tokenizer loaded meanwhile
    if ctx.pipeline.task.preference.gold:
        from stages.common.tasks import gold_function

        s.gold = gold_function(ctx.pipeline.task.preference.gold)
    if cfg.rewards.normalize:
        from stages.ppo.scoring import RunningMoments

        s.moments = RunningMoments()
    gpu, seed, ppo = use_gpu(), ctx.pipeline.seed, cfg.algorithm == "ppo"
    _check_cluster(cfg)
    lora_ref = cfg.policy.lora is not None  # the reference is the LoRA policy with its adapter off
    in_policy = lora_ref or cfg.reference.colocate  # no reference ranks of its own
    critic_note = f", critic x{cfg.critic.num_ranks}{describe(cfg.critic.lora)}" if ppo else ""
    ref_note = "reference: the policy without its adapter" if lora_ref else \
        "reference: a copy in each policy rank" if in_policy else f"reference x{cfg.reference.num_ranks}"
    ctx.progress(f"starting {cfg.rollout.num_engines} vLLM engines and the roles (policy x{cfg.policy.num_ranks}"
                 f"{describe(cfg.policy.lora)}{critic_note}, {ref_note}"
                 f"{f', reward x{cfg.reward.num_ranks}' if cfg.rewards.model_weight else ''}"
                 f"{f', teacher x{cfg.distill.role.num_ranks}' if cfg.distill else ''})")
    heads = saved_heads(rm_dir) if cfg.rewards.model_weight else 1  # the driver holds its inputs
    if heads > 1 or cfg.rewards.ensemble != "mean" and cfg.rewards.model_weight:
        ctx.progress(f"reward model: {heads} score head(s), combined by {cfg.rewards.ensemble}"
                     + ("" if heads > 1 else " (one head: nothing to combine; set stages.reward.heads)"))
    if cfg.environment:
        s.episode = _episode_spec(cfg)
        s.env_budget = ErrorBudget(f"the environment {cfg.environment.name}", cfg.rewards.max_error_share, "episodes")
    longest = max(r["num_tokens"] for r in train_rows + eval_rows) + cfg.response_tokens()
    spec = EngineSpec(max_model_len=longest, seed=seed, gpu=gpu, kv_cache_gb=cfg.rollout.kv_cache_gb,
                      gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, num_cpus=cfg.rollout.cpus_per_engine,
                      storage=ctx.storage)
    try:
        roles = [("policy", cfg.policy, "causal", sft, True)]
        roles += [] if in_policy else [("reference", cfg.reference, "causal", sft, False)]
        roles += [("critic", cfg.critic, "value", rm_dir, True)] if ppo else []
        roles += [("reward", cfg.reward, "reward", rm_dir, False)] if cfg.rewards.model_weight else []
        roles += [("teacher", cfg.distill.role, "causal", cfg.distill.teacher, False)] if cfg.distill else []
        # Everything starts at once (roles and engines load their models concurrently): nothing blocks
        # until every placement group is requested and every actor created.
        requested = time.time()
        s.pool = EnginePool(str(sft), spec, cfg.rollout.num_engines, cfg.rollout.placement_strategy, wait=False,
                            **({"engine_cls": _agent_engine()} if s.episode else {}))
        pending = {}
        for name, role, kind, model_dir, trainable in roles:
            s.groups[name], pending[name] = _start_role(name, role, kind, model_dir, cfg, trainable, gpu,
                                                        s.tok.pad_token_id, seed, ctx.storage)
        s.trained = {name: s.groups[name] for name, *_, trainable in roles if trainable}
        ray.get([g.pg.ready() for g in s.groups.values()], timeout=300)  # a clear error if resources never come
        ray.get([r for g in s.groups.values() for r in g.ready_refs])  # process groups joined
        params = {name: ray.get(refs)[0] for name, refs in pending.items()}  # models loaded
        clock.mark("roles")
        s.pool.ready()
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


def _startup_details(s: _Session, clock, requested: float) -> None:
    """Where the roles' and engines' start went, slowest actor of each kind (they run side by side, so these
    overlap and are details, not parts): its process start (requested -> constructor), then what each
    reported (imports, model load, DeepSpeed or vLLM initialisation)."""
    import ray

    actors = {name: g.actors for name, g in s.groups.items()} | {"engine": s.pool.engines}
    clock.processes = sum(len(group) for group in actors.values())
    timings = {name: ray.get([a.timings.remote() for a in group]) for name, group in actors.items()}
    for name, ranks in timings.items():
        clock.detail(f"{name}_process", max(t["born"] for t in ranks) - requested)
        for part in ranks[0]:
            if part != "born":
                clock.detail(f"{name}_{part}", max(t.get(part, 0.0) for t in ranks))


# --------------------------------------------------------------------------- rollouts


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


def _agent_engine():
    from stages.ppo.episodes import AgentEngine

    return AgentEngine


@dataclass
class _Rollouts:
    """One iteration's generation request: launched on the engines (through the policy ranks),
    collected later; with `rollout.async` the next iteration's is launched before this one trains."""

    it: int
    rows: list[dict]  # one row per rollout; a prompt's samples adjacent
    sampling: dict
    refs: list  # one ref per policy rank
    launched: float = field(default_factory=time.time)
    restarts: int = 0  # the pool's engine restarts when it was launched: one restarted since gets it sent again
    generated: list[list[dict]] | None = None  # per prompt, its samples (once collected)
    wait_s: float = 0.0  # how long the loop waited for them
    scored: tuple | None = None  # scoring.training_rewards' columns, when dynamic sampling scored them already
    dynamic: dict = field(default_factory=dict)  # dynamic sampling's (and distillation's) metrics


def _sampling(cfg: PPOConfig, seed: int, it: int, refill: int = 0) -> dict:
    return {"n": cfg.sampling.n, "temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
            "max_tokens": cfg.sampling.max_new_tokens, "logprobs": 0,  # the sampled tokens' log-probs
            # vLLM seeds sample i of a request with seed + i: draw far-apart seeds per iteration (and refill)
            "seed": random.Random(f"ppo-sampling-{seed}-{it}" + (f"-{refill}" if refill else "")).randrange(2**31)}


def _launch(pool, policy, rows: list[dict], n: int, sampling: dict, episode=None):
    """Policy ranks send their prompt shares to the engines (the call returns at once: refs); with an
    environment, each rank's rows too (an environment's `reset` receives the whole row)."""
    from stages.ppo.groups import shard

    prompts = rows[::n]
    if episode is None:
        return policy.run_each("generate", shard([r["prompt_ids"] for r in prompts], len(policy)),
                               engines=pool.engines, sampling=sampling)
    return [policy.actors[i].generate.remote(ids, pool.engines, sampling, part, episode) for i, (ids, part) in
            enumerate(zip(shard([r["prompt_ids"] for r in prompts], len(policy)), shard(prompts, len(policy))))]


def _request(s: "_Session", cfg: PPOConfig, seed: int, it: int, fault_at: int, refill: int = 0) -> _Rollouts:
    """Sample iteration `it`'s prompts (seeded per iteration and dynamic sampling's refill round, so a resumed
    run sees the same ones) and launch their generation with the weights the engines hold now."""
    n = cfg.sampling.n
    key = f"ppo-{seed}-{it}" + (f"-refill{refill}" if refill else "")
    rows = random.Random(key).sample(s.train_rows, cfg.prompts_per_iteration)
    rows = [r for r in rows for _ in range(n)]
    if it == fault_at and not refill:
        s.pool.kill(0)
    sampling = _sampling(cfg, seed, it, refill)
    return _Rollouts(it, rows, sampling, _launch(s.pool, s.role("policy"), rows, n, sampling, s.episode),
                     restarts=s.pool.restarts)


def _collect(s: "_Session", req: _Rollouts, n: int, console) -> _Rollouts:
    """Wait for a request's samples; a dead engine, or one the environment stalled, is restarted (with the
    last synced weights) and the request sent again (stages/ppo/episodes.py `retrying`)."""
    import ray

    from stages.ppo.episodes import retrying

    if req.generated is not None:
        return req
    t0 = time.time()
    sent = [req.refs]

    def once() -> list[list[dict]]:
        if not sent:  # a retry: the engines were restarted
            req.refs = _launch(s.pool, s.role("policy"), req.rows, n, req.sampling, s.episode)
        sent.clear()
        return [g for part in ray.get(req.refs) for g in part]

    # With rollout.async the request went out before the last weight sync, which may have restarted an engine
    # it was sent to (one killed after the previous request): `since` makes that a reason to send it again.
    req.generated = retrying(s.pool, once, s.episode, console, since=req.restarts)
    req.wait_s = time.time() - t0
    return req


def _fill(s: "_Session", cfg: PPOConfig, loop: "_Loop", req: _Rollouts, console) -> _Rollouts:
    """DAPO's dynamic sampling: score the collected groups, and replace those whose samples all scored the same
    (no signal under a group baseline) by fresh prompts' groups, in up to `max_refills` rounds; still short,
    the batch is topped up with dropped groups. The request's rows and samples become the kept ones, with
    their scores (`req.scored`), so the batch keeps its size and nothing is scored twice."""
    import torch

    from stages.ppo import rl
    from stages.ppo.scoring import answers_of, joined_groups, keep_groups, training_rewards

    n, want = cfg.sampling.n, cfg.prompts_per_iteration
    kept: list = []
    dropped: list = []
    part, refills, share = req, 0, None
    while True:
        flat = [x for group in part.generated for x in group]
        scored = training_rewards(answers_of(s.tok, flat), part.rows, flat, s.role("reward"), cfg, s.rule,
                                  s.moments)
        keep = rl.dynamic_keep(torch.tensor(scored[0]), n).tolist()
        share = sum(keep) / len(keep) if share is None else share  # of the iteration's own prompts
        keep_groups(part.generated, part.rows, scored, keep, n, kept, dropped)
        if len(kept) >= want or refills == cfg.dynamic_sampling.max_refills:
            break
        refills += 1
        part = _collect(s, _request(s, cfg, loop.seed, req.it, -1, refill=refills), n, console)
    req.rows, req.generated, req.scored = joined_groups((kept + dropped)[:want])
    req.dynamic = {"dynamic_kept_share": share, "dynamic_refills": float(refills)}
    return req


# --------------------------------------------------------------------------- checkpoints


def _latest(ckpt: Path, run_storage) -> dict | None:
    """The last checkpoint's record; with an object store, the bucket's when this machine has none."""
    from pipeline.artifacts import read_json

    run_storage.pull_path(ckpt / "latest.json")
    latest = read_json(ckpt / "latest.json")
    if latest:
        run_storage.pull_path(ckpt / latest["dir"] / "state.json")
    return latest


def _save(ckpt: Path, it: int, groups: dict, state: dict, run_storage) -> None:
    """Every trainable role's DeepSpeed state, then the driver state; `latest.json` last, atomically
    (and with an object store, pushed last)."""
    import ray

    from pipeline.artifacts import write_json_atomic

    d = ckpt / f"iter_{it:05d}"
    ray.get([r for name, g in groups.items() for r in g.run("save", str(d / name))])
    (d / "state.json").write_text(json.dumps(state))
    run_storage.push_path(d / "state.json")
    write_json_atomic(ckpt / "latest.json", {"iteration": it, "dir": d.name})
    run_storage.push_path(ckpt / "latest.json")
    for old in sorted(ckpt.glob("iter_*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)
        run_storage.drop_path(old)


def _resume(s: _Session, ctx: StageContext, kl_ctl) -> tuple[int, dict]:
    """(first iteration to run, reward/KL trend so far): from the last checkpoint, if there is one.

    Restores every trainable role's DeepSpeed state (optimizer included) and the KL coefficient,
    then brings the engines to the restored policy weights."""
    import ray

    latest = _latest(ctx.checkpoint_dir, ctx.storage)
    if not latest:
        return 0, {"reward": [], "kl": [], "curve": []}
    d = ctx.checkpoint_dir / latest["dir"]
    ray.get([r for name, g in s.trained.items() for r in g.run("load", str(d / name))])
    state = json.loads((d / "state.json").read_text())
    kl_ctl.value = state["kl_coef"]
    if s.moments is not None and state.get("moments"):
        s.moments.count, s.moments.mean, s.moments.m2 = state["moments"]
    s.pool.sync(s.role("policy").get("export_weights")[0][0], version=state["iteration"] + 1)
    ctx.progress(f"resumed from the checkpoint of iteration {state['iteration']}")
    return state["iteration"] + 1, {"curve": []} | state.get("trend", {"reward": [], "kl": []})


# --------------------------------------------------------------------------- the over-optimisation curve


def _curve_point(s: _Session, cfg: PPOConfig, ref, ref_call: str, it: int, trend: dict, ctx: StageContext) -> None:
    """One point of the over-optimisation curve, on the first `curve_prompts` held-out prompts with
    `curve_samples` samples each from the engines' current weights: the reward model's mean score
    (the proxy), the mean training reward, the mean gold score and the KL to the reference per
    response (k1 summed over the response, from the engines' and the reference's log-probs of the
    sampled tokens). Logged as heldout_* at step `it` and kept in `trend['curve']` (checkpointed)."""
    import ray
    import torch

    from stages.ppo import rl
    from stages.ppo.scoring import accuracy_of, answers_of, generate, rollout_batch, score, with_env_reward
    from stages.ppo.worker import shard_batch

    rows = s.eval_rows[: cfg.curve_prompts]
    if not rows or any(p["iteration"] == it for p in trend["curve"]):
        return
    k = cfg.curve_samples
    sampling = {"n": k, "temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
                "max_tokens": cfg.sampling.max_new_tokens, "logprobs": 0, "seed": 54321}
    flat = generate(s.pool, rows, sampling, s.episode, ctx.progress)
    reps = [r for r in rows for _ in range(k)]
    texts = answers_of(s.tok, flat)
    batch = rollout_batch(reps, flat, s.tok.pad_token_id)
    ref_refs = ref.run_each(ref_call, shard_batch(batch, len(ref)), micro=cfg.micro_batch_size)
    scores, _, raw, spread = score(texts, reps, s.role("reward"), cfg, s.rule, moments=s.moments)
    scores = with_env_reward(scores, flat, cfg)
    mask = batch["response_mask"]
    policy_lp = rl.pad_rows([x["logprobs"] for x in flat], mask.shape[1])
    ref_lp = torch.cat(ray.get(ref_refs))
    kl = float(((policy_lp - ref_lp) * mask).sum(1).mean())
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    point = {"iteration": it, "kl": kl, "reward": mean(scores), "proxy": mean(raw) if raw else None,
             "gold": mean([float(s.gold(r["prompt"], t)) for t, r in zip(texts, reps)]) if s.gold else None,
             "rm_spread": mean(spread) if spread else None,
             "accuracy": mean(accuracy_of(s.verify, texts, reps)) if s.verify and any(r.get("answer") for r in rows)
             else None,
             "length": mean([float(len(x["ids"])) for x in flat])}
    trend["curve"].append(point)
    ctx.log_metrics({f"heldout_{k}": v for k, v in point.items() if k != "iteration" and v is not None}, step=it)
    ctx.progress(f"held-out curve at iteration {it}: kl {kl:.3f}, reward {point['reward']:.3f}"
                 + (f", accuracy {point['accuracy']:.3f}" if point["accuracy"] is not None else "")
                 + f", length {point['length']:.1f}"
                 + (f", proxy {point['proxy']:.3f}" if raw else "") + (f", gold {point['gold']:.3f}" if s.gold else ""))


# --------------------------------------------------------------------------- the end: export and evaluate


def _finish(s: _Session, cfg: PPOConfig, ctx: StageContext, before: dict | None, metrics: dict,
            trend: dict) -> tuple[Path, dict]:
    """Export the trained policy as an HF model, and score it on the held-out prompts against `before`."""
    import ray

    from stages.ppo.scoring import compare, curve_ends, evaluate, gold_win_rate, plot_curve, slope

    out = ctx.out_dir / "model"
    ray.get(s.role("policy").run("save_hf", str(out)))
    ctx.storage.pull_path(out)  # with an object store: rank 0 may have written it on another node
    s.tok.save_pretrained(out)
    if cfg.policy.lora:  # the adapter too, on the SFT model as its base: served as base + adapter
        from stages.common.lora import ADAPTER_DIR

        ray.get(s.role("policy").run("save_adapter", str(ctx.out_dir / ADAPTER_DIR)))
        ctx.storage.pull_path(ctx.out_dir / ADAPTER_DIR)
        s.tok.save_pretrained(ctx.out_dir / ADAPTER_DIR)
    final = dict(metrics)
    if trend["reward"]:  # the run's learning curve in two numbers (over every iteration, resumed ones too)
        final.update(reward_slope=slope(trend["reward"]), kl_max=max(trend["kl"]))
    if trend["curve"]:  # the over-optimisation curve as one picture on the stage's run
        final.update(curve_ends(trend["curve"]))
        plot = ctx.out_dir / "overoptimisation.png"
        plot_curve(trend["curve"], plot)
        ctx.log_artifact(plot)
        ctx.log_dict(trend["curve"], "overoptimisation.json")
    if before is not None:
        before, before_gold = before
        after, after_gold = evaluate(s.pool, s.eval_rows, s.tok, s.role("reward"), cfg, s.rule, s.gold, s.moments, s.verify,
                                     s.episode, s.env_budget, ctx.progress)
        final.update(eval_prompts=len(s.eval_rows), **compare(before, after))
        if before_gold is not None and after_gold is not None:  # sampled answers, judged by the gold preference
            final.update(gold_win_rate(before_gold, after_gold))
            ctx.progress(f"held-out gold win-rate against the SFT policy ({len(s.eval_rows)} prompts, "
                         f"{cfg.eval_samples} samples each): {final['gold_winrate']:.3f} ({final['gold_winrate_wins']} "
                         f"prompts won, {final['gold_winrate_losses']} lost, sign test p "
                         f"{final['gold_winrate_p']:.2g})")
        for key in (k for k in before if not k.endswith("truncated")):
            ctx.progress(f"held-out {key.replace('_', ' ')} ({len(s.eval_rows)} prompts): "
                         f"{final[f'eval_{key}_before']:.3f} -> {final[f'eval_{key}']:.3f} "
                         f"({final[f'eval_{key}_improved']} prompts up, {final[f'eval_{key}_worsened']} down, "
                         f"sign test p {final[f'eval_{key}_sign_test_p']:.2g})")
        cut = {k: (final[f"eval_{k}_before"], final[f"eval_{k}"]) for k in ("truncated", "sampled_truncated") if k in before}
        if any(v for pair in cut.values() for v in pair):
            ctx.progress("held-out answers cut off at sampling.max_new_tokens="
                         f"{cfg.sampling.max_new_tokens} (scored as given): " + ", ".join(
                             f"{k.replace('_', ' ')} {b:.1%} -> {a:.1%}" for k, (b, a) in cut.items()))
    final["engine_restarts"] = s.pool.restarts
    final.update(s.rule.totals() if hasattr(s.rule, "totals") else {})  # failed calls of your code, if any
    if s.env_budget is not None and s.env_budget.failed:
        final["env_errors_total"] = s.env_budget.failed
    return out, final


# --------------------------------------------------------------------------- the stage


def configured_code(cfg: PPOConfig) -> list[str]:
    """A custom rule reward's module (`rewards.rule: module:function`, or code_tests' sandbox) and a custom
    environment's (`environment.name: module:Class`): editing them reruns ppo."""
    from stages.ppo.rewards import BUILTIN

    rule = BUILTIN.get(cfg.rewards.rule, cfg.rewards.rule)
    env = cfg.environment.name if cfg.environment else ""
    return [spec.split(":", 1)[0] for spec in (rule, env) if ":" in spec]


def run(cfg: PPOConfig, ctx: StageContext) -> dict[str, Path]:
    """PPO (or a critic-free estimator) from the SFT policy; returns the trained policy as an HF model."""
    from pipeline.events import StartupClock

    clock = StartupClock()  # stage start -> the first iteration, and where it went
    s = _start(cfg, ctx, clock)
    try:
        loop = _begin(s, cfg, ctx, clock)  # the SFT policy's held-out answers, a resumed run's state
        nxt = _request(s, cfg, loop.seed, loop.start, loop.fault_at)
        for it in range(loop.start, cfg.iterations):
            if cfg.eval_every and it % cfg.eval_every == 0:  # the over-optimisation curve, before update `it`
                _curve_point(s, cfg, loop.ref, loop.ref_call, it, loop.trend, ctx)
            if it == loop.start:  # start-up ends: shown, and logged with the first iteration's metrics
                clock.mark("evaluation", counted=False)
                ctx.progress(clock.line("first iteration"))
            t_iter = time.time()
            # 1.-2. sample prompts and generate. Synchronous: each iteration's rollouts come from the weights of
            # the update before it. `rollout.async`: iteration it+1's are launched before iteration it trains, so
            # generation overlaps scoring and training, and they come from weights one update older (staleness 1).
            req = _collect(s, nxt, cfg.sampling.n, ctx.progress)
            if cfg.dynamic_sampling.enabled:  # groups without a signal replaced by fresh prompts' groups
                req = _fill(s, cfg, loop, req, ctx.progress)
            if cfg.rollout.async_ and it + 1 < cfg.iterations:
                nxt = _request(s, cfg, loop.seed, it + 1, loop.fault_at)
            scored = _score(s, cfg, loop, req, it)  # 3.-5. rewards, reference, old policy, values; advantages
            trained = _train(s, loop, scored.batch)  # 6. PPO epochs, policy and critic at once
            if nxt is not req:
                _collect(s, nxt, cfg.sampling.n, ctx.progress)
            synced = _sync(s, it)  # 7. the new weights to every engine (async: once the next rollouts are in)
            if nxt is req and it + 1 < cfg.iterations:
                nxt = _request(s, cfg, loop.seed, it + 1, loop.fault_at)
            loop.metrics = _log(s, cfg, ctx, loop, it, scored, trained, synced, t_iter)  # 8.
            _checkpoint(s, cfg, ctx, loop, it)  # 9.
        if cfg.eval_every and cfg.iterations % cfg.eval_every == 0:  # the curve's last point: the trained policy
            _curve_point(s, cfg, loop.ref, loop.ref_call, cfg.iterations, loop.trend, ctx)
        out, final = _finish(s, cfg, ctx, loop.before, loop.metrics | clock.metrics(), loop.trend)
        ctx.log_metrics(final, step=cfg.iterations)
        return {"policy_model": out}
    finally:
        s.close()


# --------------------------------------------------------------------------- the loop's steps


@dataclass
class _Loop:
    """What every iteration uses and carries on: the roles as called, the workers' hyper-parameters,
    the KL controller, the trends the checkpoint keeps, and the held-out answers from before."""

    ref: Any  # the reference's group: the policy itself (adapter off) with LoRA
    ref_call: str  # its method for reference log-probs
    hp: dict  # what the policy and critic ranks train with (kl_loss_coef set per iteration)
    kl_ctl: Any
    start: int  # the first iteration (after a resume)
    trend: dict
    before: tuple | None  # the SFT policy's held-out answers (scoring.evaluate)
    seed: int
    fault_at: int  # fault drills and tests: kill engine 0 at this iteration
    fault_after: int  # ... raise after the checkpoint of this one
    clock: Any  # events.StartupClock: stage start -> the first iteration
    metrics: dict = field(default_factory=dict)  # the last iteration's


@dataclass
class _Scored:
    """One iteration's rollouts, scored, as the trainer's batch (advantages in), and what the log reports."""

    rows: list[dict]
    flat: list[dict]  # every sample, a prompt's adjacent
    texts: list[str]
    batch: dict
    scores: list[float]
    rule_scores: list[float]
    rm_scores: list[float]
    rm_spread: list[float]
    kl: Any  # per token, (B, T)
    mismatch: dict
    staleness: int
    wait_s: float  # the loop waited this long for the rollouts
    gen_span: float  # launch -> scored
    score_s: float
    dynamic: dict  # dynamic sampling's and distillation's metrics (empty without them)


def _begin(s: _Session, cfg: PPOConfig, ctx: StageContext, clock) -> _Loop:
    """The SFT policy on the held-out prompts (with a gold preference, each sampled answer's gold
    score too), then the KL controller and the state of a resumed run."""
    from stages.ppo import rl
    from stages.ppo.scoring import evaluate

    policy, ref = s.role("policy"), s.role("reference")
    # A LoRA policy is its own reference (adapter off), a colocated one sits in the policy ranks; otherwise
    # the reference role's ranks.
    ref, ref_call = (policy, "ref_logprobs") if ref is None else (ref, "logprobs")
    before = evaluate(s.pool, s.eval_rows, s.tok, s.role("reward"), cfg, s.rule, s.gold, s.moments, s.verify,
                      s.episode, s.env_budget, ctx.progress) if s.eval_rows else None
    clock.mark("evaluation", counted=False)  # held-out work the config asks for, not start-up
    kl_ctl = rl.kl_controller(cfg.kl.controller, cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
    start, trend = _resume(s, ctx, kl_ctl)
    clock.mark("restore")
    hp = {"epochs": cfg.ppo_epochs, "micro": cfg.micro_batch_size, "entropy_coef": cfg.entropy_coef,
          "value_clip": cfg.value_clip, "kl_loss_coef": 0.0, "max_len": cfg.response_tokens(), "tokens_per_row": 0.0,
          **cfg.objective()}
    ctx.advance(start, cfg.iterations, "iter")  # the rate and ETA count from here
    return _Loop(ref, ref_call, hp, kl_ctl, start, trend, before, ctx.pipeline.seed,
                 int(os.environ.get("PIPELINE_FAULT_KILL_ENGINE_AT", "-1")),
                 int(os.environ.get("PIPELINE_FAULT_AFTER_ITERATION", "0")), clock)


def _score(s: _Session, cfg: PPOConfig, loop: _Loop, req: _Rollouts, it: int) -> _Scored:
    """Steps 3.-5.: score the rollouts and compute the advantages. The reward model, the reference, the
    old policy and the critic are independent: all four are issued at once and run concurrently on
    their own ranks; the rule reward meanwhile."""
    import ray
    import torch

    from stages.ppo import rl
    from stages.ppo.scoring import answers_of, request_model_scores, rollout_batch, training_rewards
    from stages.ppo.worker import shard_batch

    policy, critic, reward, micro = s.role("policy"), s.role("critic"), s.role("reward"), cfg.micro_batch_size
    ppo = cfg.algorithm == "ppo"
    flat = [x for group in req.generated for x in group]
    if s.env_budget is not None:
        s.env_budget.check_episodes(flat, req.rows)
    # policy updates made since the weights that generated these rollouts (0 synchronous, <= 1 async)
    staleness = it - min(x["version"] for x in flat)
    if staleness > cfg.rollout.max_staleness():
        raise AssertionError(f"iteration {it}: rollouts {staleness} updates old exceed the bound "
                             f"{cfg.rollout.max_staleness()}")
    gen_span = time.time() - req.launched
    t0 = time.time()
    texts = answers_of(s.tok, flat)  # a multi-turn sample's last turn: what the rewards judge
    batch = rollout_batch(req.rows, flat, s.tok.pad_token_id)  # the environment's tokens masked out
    rm_refs = request_model_scores(texts, req.rows, reward, cfg) if req.scored is None else None
    ref_refs = loop.ref.run_each(loop.ref_call, shard_batch(batch, len(loop.ref)), micro=micro)
    own = not cfg.rollout.engine_logprobs  # the old policy's log-probs from the policy ranks, not the engines
    old_refs = policy.run_each("logprobs", shard_batch(batch, len(policy)), micro=micro) if own else []
    value_refs = critic.run_each("values", shard_batch(batch, len(critic)), micro=micro) if ppo else []
    teacher = s.role("teacher")
    teacher_refs = teacher.run_each("logprobs", shard_batch(batch, len(teacher)), micro=micro) if teacher else []
    scores, rule_scores, rm_scores, rm_spread = req.scored or training_rewards(texts, req.rows, flat, reward, cfg,
                                                                               s.rule, s.moments, rm_refs)
    mask, score_t = batch["response_mask"], torch.tensor(scores)
    rollout_lp = rl.pad_rows([x["logprobs"] for x in flat], mask.shape[1])
    ref_lp, old_lp = torch.cat(ray.get(ref_refs)), torch.cat(ray.get(old_refs)) if own else rollout_lp
    values = torch.cat(ray.get(value_refs)) if ppo else None
    kl = rl.kl_penalty(old_lp, ref_lp, cfg.kl.estimator)
    # the engines sampled these tokens; how far their log-probs are from the trainer's (same weights when
    # synchronous; one update apart with rollout.async, which the importance weights then correct)
    mismatch = rl.logprob_mismatch(old_lp, rollout_lp, mask) if own else {}
    if own and (cfg.tis.enabled or cfg.rollout.async_):
        batch["tis_weights"] = rl.tis_weights(old_lp, rollout_lp, cfg.tis.cap)
    distill = None
    if teacher_refs:  # each sampled token's teacher log-prob against the student's (the sampler's)
        teacher_lp = torch.cat(ray.get(teacher_refs))
        distill = rl.distill_advantages(old_lp, teacher_lp, mask, cfg.distill.weight)
        req.dynamic["distill_reverse_kl"] = rl.masked_mean(old_lp - teacher_lp, mask).item()  # sampled estimate
    adv, returns, loop.hp["kl_loss_coef"] = rl.advantages(cfg, score_t, kl, mask, loop.kl_ctl.value, values, distill)
    loop.hp["tokens_per_row"] = mask.sum().item() / mask.shape[0]  # the dapo / cispo normalizer (rl.aggregate)
    if ppo:
        batch.update(old_values=values, returns=returns)
    batch.update(advantages=adv, old_logprobs=old_lp, ref_logprobs=ref_lp)
    return _Scored(req.rows, flat, texts, batch, scores, rule_scores, rm_scores, rm_spread, kl, mismatch, staleness,
                   req.wait_s, gen_span, time.time() - t0, req.dynamic)


def _train(s: _Session, loop: _Loop, batch: dict) -> dict:
    """Step 6.: the PPO epochs; policy and critic train concurrently, each on its data-parallel shares.
    Their stats, and `train_s`."""
    import ray

    from stages.ppo.worker import shard_batch

    t0 = time.time()
    policy, critic = s.role("policy"), s.role("critic")
    refs = policy.run_each("train_policy", shard_batch(batch, len(policy)), hp=loop.hp)
    crefs = critic.run_each("train_critic", shard_batch(batch, len(critic)), hp=loop.hp) if critic else []
    return ray.get(refs)[0] | (ray.get(crefs)[0] if critic else {}) | {"train_s": time.time() - t0}


def _sync(s: _Session, it: int) -> dict:
    """Step 7.: one put of the new weights, every engine loads them; the timings and size."""
    t0 = time.time()
    weights_ref, sync_bytes = s.role("policy").get("export_weights")[0]
    load_s = s.pool.sync(weights_ref, version=it + 1)
    return {"sync_s": time.time() - t0, "sync_load_s": load_s, "sync_mb": sync_bytes / 2**20}


def _log(s: _Session, cfg: PPOConfig, ctx: StageContext, loop: _Loop, it: int, sc: _Scored, trained: dict,
         synced: dict, t_iter: float) -> dict:
    """Step 8.: update the KL controller, log the iteration's metrics (and samples, trajectories), report progress."""
    import torch

    from stages.ppo import rl
    from stages.ppo.scoring import episode_stats, failures_note, samples, trajectories

    mask, n = sc.batch["response_mask"], len(sc.rows)
    seq_kl = float(rl.masked_mean(sc.kl, mask, dim=1).mul(mask.sum(1)).mean())
    loop.kl_ctl.update(seq_kl, n)
    gen_tokens = float(mask.sum())
    rm, spread = sc.rm_scores, sc.rm_spread
    metrics = {
        "reward_mean": float(torch.tensor(sc.scores).mean()), "rule_reward_mean": sum(sc.rule_scores) / len(sc.rule_scores),
        "kl": seq_kl, "kl_coef": loop.kl_ctl.value, "response_length": gen_tokens / n,
        # cut off by sampling.max_new_tokens (or environment max_turns / max_tokens)
        "truncated_frac": sum(not x["finished"] for x in sc.flat) / len(sc.flat),
        **episode_stats(sc.flat),  # with an environment: turns, tool calls, errors and time
        **trained, "generate_s": sc.wait_s, "score_s": sc.score_s, **synced, "staleness": sc.staleness,
        "gen_tokens_per_s": gen_tokens / max(sc.gen_span, 1e-9), "iteration_s": time.time() - t_iter,
        "engine_restarts": s.pool.restarts, **sc.mismatch, **(loop.clock.metrics() if it == loop.start else {}),
        **({"rm_score_mean": sum(rm) / len(rm)} if rm else {}),
        **({"rm_spread_mean": sum(spread) / len(spread)} if spread else {}),  # heads' disagreement
        **({"gold_mean": sum(s.gold(r["prompt"], t) for t, r in zip(sc.texts, sc.rows)) / n} if s.gold else {}),
        **s.rule.counts(),  # rule_timeouts, rule_errors: calls of the rule reward that scored timeout_score
        **sc.dynamic,  # dynamic sampling (kept share, refill rounds); distillation (the sampled reverse KL)
    }
    ctx.log_metrics(metrics, step=it + 1)
    loop.trend["reward"].append(metrics["reward_mean"])
    loop.trend["kl"].append(seq_kl)
    if cfg.log_samples:
        ctx.log_dict(samples(sc.rows, sc.texts, sc.scores, sc.rule_scores, cfg.log_samples, cfg.sampling.n),
                     f"samples/iter_{it + 1:04d}.json")
    if cfg.environment and cfg.environment.log_trajectories:
        ctx.log_dict(trajectories(sc.rows, sc.flat, sc.scores, cfg.environment.log_trajectories, cfg.sampling.n),
                     f"trajectories/iter_{it + 1:04d}.json")
    ctx.advance(it + 1, cfg.iterations, "iter",
                f"reward {metrics['reward_mean']:.3f} rule {metrics['rule_reward_mean']:.3f} kl {seq_kl:.3f} "
                f"len {metrics['response_length']:.1f}"
                + (f" calls {metrics['tool_calls_per_sample']:.2f}" if "tool_calls_per_sample" in metrics else "")
                + failures_note(metrics)
                + f" | gen {sc.wait_s:.1f}s score {sc.score_s:.1f}s train {trained['train_s']:.1f}s "
                f"sync {synced['sync_s']:.2f}s")
    return metrics


def _checkpoint(s: _Session, cfg: PPOConfig, ctx: StageContext, loop: _Loop, it: int) -> None:
    """Step 9.: every `checkpoint_every` iterations and at the end (and the fault drill's raise after one)."""
    if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
        _save(ctx.checkpoint_dir, it, s.trained, {"iteration": it, "kl_coef": loop.kl_ctl.value, "trend": loop.trend,
              "moments": s.moments.state() if s.moments is not None else None}, ctx.storage)
        if loop.fault_after and it + 1 >= loop.fault_after > loop.start:
            raise RuntimeError(f"injected fault after iteration {it + 1} (PIPELINE_FAULT_AFTER_ITERATION)")
