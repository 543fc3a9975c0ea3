"""PPO stage: improve the SFT policy with rollouts from vLLM engines and a reward to maximise.

Roles (each a `ModelGroup` of `PPOWorker` ranks with DeepSpeed inside, sized in the YAML):
policy (trainable, from the SFT model), critic (trainable, from the reward model; PPO only),
reference (frozen SFT model, for the KL penalty; with `policy.lora` the policy itself with its
adapter switched off, so no second copy is started) and reward (the reward model; used when
`rewards.model_weight` is not 0). Rollouts come from `rollout.num_engines` vLLM engines, each a
Ray actor (`stages/common/engines.py`, shared with SFT's evaluation); policy ranks send their share of the prompts to
engines themselves (any rank can call any engine). The score of a response mixes the reward model and a
rule reward (the task verifier, or your own `module:function`) by `rewards.*_weight`.

The driver is one loop, `run()`, reading top to bottom on one screen:

    sample prompts -> generate -> score -> reference/policy log-probs, values -> advantages
    -> PPO epochs (policy and critic) -> sync weights to the engines -> log -> checkpoint

each step a named function after it (`_begin`, `_score`, `_train`, `_sync`, `_log`, `_checkpoint`).
What the loop stands on is in the package beside it, one concern per module:

    __init__.py    this loop and its checkpoints   config.py      the typed config (PPOConfig) and its hooks
    roles.py       set-up: every role and engine starts at once (`start`); `Session.close` ends them
    layouts/       where they run, one protocol (`Layout`): separate.py (a process per rank and engine),
                   colocated.py (one actor per policy rank holds every role and its own engine)
    rollouts.py    generation requests: `request` launches, `collect` waits (with `rollout.async` the next
                   iteration's request goes out before this one trains, one-step off-policy, and
                   `staleness` is checked and logged); `fill` is dynamic sampling
    evaluation.py  the over-optimisation curve (`curve_point`) and the end (`finish`: export, held-out scores)
    rl.py          the pure RL math (tested)       scoring.py     rewards, held-out evaluation, sign test
    groups.py      ModelGroup: a model on N actors worker.py      PPOWorker: a rank's model and math
    rewards.py     the rule reward and its workers sandbox/       model code sandboxed; code_tests
    environments.py, episodes.py                   multi-turn rollouts with tools (AgentEngine)

The scoring passes (reward model, reference, old policy, critic) are issued together.

After every update the policy's full weights go into the object store once and every engine
loads them from there (zero-copy on the same node), so rollouts always come from the current
policy; in the colocated layout each rank's engine loads its trainer's tensors in place. The
critic-free algorithms drop the critic: `grpo`, `rloo` and `dr_grpo` use baselines from the other
`sampling.n` samples of each prompt (KL to the reference in the loss),
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
`eval_every` iterations `curve_point` logs the over-optimisation curve (proxy, gold, KL on
held-out prompts). `bench/rlhf.py` runs that per seed and algorithm.

Run alone: `python -m pipeline run configs/full.yaml --only ppo` (after `sft` and `reward`).
A rerun after an interruption resumes from the last checkpoint (`checkpoint_every`).
Fault drills (pipeline/faults.py): `PIPELINE_FAULT_KILL_ENGINE_AT=K` kills rollout engine 0 (or a
colocated rank) at iteration K (from 0); the stage restarts it through the layout, re-syncs its
weights and carries on. `PIPELINE_FAULT_AFTER_ITERATION=N` raises once after the checkpoint of
iteration N (like PIPELINE_FAULT_AFTER_STEP in training).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import faults
from pipeline.events import timed
from stages.ppo.config import PPOConfig, check, wire  # noqa: F401  (the stage's config and hooks, for the registry)
from stages.ppo.evaluation import curve_point, finish
from stages.ppo.roles import Session, start
from stages.ppo.rollouts import Rollouts, collect, fill, request

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext


def raw_inputs(pcfg) -> list[Path]:
    """The teacher's files (stages.ppo.distill.teacher): a changed teacher reruns ppo."""
    section = pcfg.stages.ppo
    if section is None or section.distill is None:
        return []
    return sorted(p for p in section.distill.teacher.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- checkpoints


def _latest(ckpt: Path, run_storage) -> dict | None:
    """The last checkpoint's record; with an object store, the bucket's when this machine has none."""
    from pipeline.files import read_json

    run_storage.pull_path(ckpt / "latest.json")
    latest = read_json(ckpt / "latest.json")
    if latest:
        run_storage.pull_path(ckpt / latest["dir"] / "state.json")
    return latest


def _save(ckpt: Path, it: int, groups: dict, state: dict, run_storage) -> None:
    """Every trainable role's DeepSpeed state, then the driver state; `latest.json` last, atomically
    (and with an object store, pushed last)."""
    import ray

    from pipeline.files import write_json_atomic

    d = ckpt / f"iter_{it:05d}"
    ray.get([r for name, g in groups.items() for r in g.run("save", str(d / name))])
    (d / "state.json").write_text(json.dumps(state))
    run_storage.push_path(d / "state.json")
    write_json_atomic(ckpt / "latest.json", {"iteration": it, "dir": d.name})
    run_storage.push_path(ckpt / "latest.json")
    for old in sorted(ckpt.glob("iter_*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)
        run_storage.drop_path(old)


def _resume(s: Session, ctx: StageContext, kl_ctl) -> tuple[int, dict]:
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
    s.layout.sync_weights(state["iteration"] + 1)
    ctx.progress(f"resumed from the checkpoint of iteration {state['iteration']}")
    return state["iteration"] + 1, {"curve": []} | state.get("trend", {"reward": [], "kl": []})


# --------------------------------------------------------------------------- the stage


def configured_code(cfg: PPOConfig) -> list[str]:
    """A custom rule reward's module (`rewards.rule: module:function`, or code_tests' sandbox) and a custom
    environment's (`environment.name: module:Class`): editing them reruns ppo."""
    from stages.ppo.rewards import BUILTIN

    rule = BUILTIN.get(cfg.rewards.rule, cfg.rewards.rule)
    env = cfg.environment.name if cfg.environment else ""
    return [spec.split(":", 1)[0] for spec in (rule, env) if ":" in spec]


def run(cfg: PPOConfig, ctx: StageContext) -> dict[str, Path]:
    """PPO (or a critic-free estimator) from the SFT policy; returns the trained policy as an HF model.

    A process that dies beyond what the layout restarts in place takes training state with it (`layouts.lost`):
    every process is started again and the run resumes from the last checkpoint, up to MAX_RESTARTS times."""
    from stages.ppo.layouts import MAX_RESTARTS, lost

    for attempt in range(MAX_RESTARTS + 1):
        try:
            return _run(cfg, ctx, drills=attempt == 0)  # a fault drill fires once, not again after the restart
        except Exception as exc:
            if not lost(exc) or attempt == MAX_RESTARTS:
                raise
            ctx.log_metrics({"rank_restarts": attempt + 1})
            ctx.progress(f"a process of the stage died ({type(exc).__name__}): starting them again and resuming "
                         f"from the last checkpoint (restart {attempt + 1} of at most {MAX_RESTARTS})")
    raise AssertionError("unreachable")


def _run(cfg: PPOConfig, ctx: StageContext, drills: bool) -> dict[str, Path]:
    from pipeline.events import StartupClock

    clock = StartupClock()  # stage start -> the first iteration, and where it went
    s = start(cfg, ctx, clock)
    try:
        loop = _begin(s, cfg, ctx, clock, drills)  # the SFT policy's held-out answers, a resumed run's state
        nxt = request(s, cfg, loop.seed, loop.start, loop.fault_at)
        for it in range(loop.start, cfg.iterations):
            if cfg.eval_every and it % cfg.eval_every == 0:  # the over-optimisation curve, before update `it`
                curve_point(s, cfg, loop.ref, loop.ref_call, it, loop.trend, ctx)
            if it == loop.start:  # start-up ends: shown, and logged with the first iteration's metrics
                clock.mark("evaluation", counted=False)
                ctx.progress(clock.line("first iteration"))
            t_iter = time.time()
            # 1.-2. sample prompts and generate. Synchronous: each iteration's rollouts come from the weights of
            # the update before it. `rollout.async`: iteration it+1's are launched before iteration it trains, so
            # generation overlaps scoring and training, and they come from weights one update older (staleness 1).
            req = collect(s, nxt, cfg.sampling.n, ctx.progress)
            if cfg.dynamic_sampling.enabled:  # groups without a signal replaced by fresh prompts' groups
                req = fill(s, cfg, loop.seed, req, ctx.progress)
            if cfg.rollout.async_ and it + 1 < cfg.iterations:
                nxt = request(s, cfg, loop.seed, it + 1, loop.fault_at)
            scored = _score(s, cfg, loop, req, it)  # 3.-5. rewards, reference, old policy, values; advantages
            trained = _train(s, loop, scored.batch)  # 6. PPO epochs, policy and critic at once
            if nxt is not req:
                collect(s, nxt, cfg.sampling.n, ctx.progress)
            synced = _sync(s, it)  # 7. the new weights to every engine (async: once the next rollouts are in)
            if nxt is req and it + 1 < cfg.iterations:
                nxt = request(s, cfg, loop.seed, it + 1, loop.fault_at)
            loop.metrics = _log(s, cfg, ctx, loop, it, scored, trained, synced, t_iter)  # 8.
            _checkpoint(s, cfg, ctx, loop, it)  # 9.
        if cfg.eval_every and cfg.iterations % cfg.eval_every == 0:  # the curve's last point: the trained policy
            curve_point(s, cfg, loop.ref, loop.ref_call, cfg.iterations, loop.trend, ctx)
        out, final = finish(s, cfg, ctx, loop.before, loop.metrics | clock.metrics(), loop.trend)
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


def _begin(s: Session, cfg: PPOConfig, ctx: StageContext, clock, drills: bool = True) -> _Loop:
    """The SFT policy on the held-out prompts (with a gold preference, each sampled answer's gold
    score too), then the KL controller and the state of a resumed run."""
    from stages.ppo import rl
    from stages.ppo.scoring import evaluate

    policy, ref = s.role("policy"), s.role("reference")
    # A LoRA policy is its own reference (adapter off), a colocated one sits in the policy ranks; otherwise
    # the reference role's ranks.
    ref, ref_call = (policy, "ref_logprobs") if ref is None else (ref, "logprobs")
    before = evaluate(s.layout, s.eval_rows, s.tok, s.role("reward"), cfg, s.rule, s.gold, s.moments, s.verify,
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
                 faults.number("KILL_ENGINE_AT", -1) if drills else -1, faults.number("AFTER_ITERATION", 0), clock)


def _score(s: Session, cfg: PPOConfig, loop: _Loop, req: Rollouts, it: int) -> _Scored:
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
    loop.hp["tokens_per_row"] = mask.sum().item() / mask.shape[0]  # the dapo / cispo normalizer (losses.aggregate)
    if ppo:
        batch.update(old_values=values, returns=returns)
    batch.update(advantages=adv, old_logprobs=old_lp, ref_logprobs=ref_lp)
    return _Scored(req.rows, flat, texts, batch, scores, rule_scores, rm_scores, rm_spread, kl, mismatch, staleness,
                   req.wait_s, gen_span, time.time() - t0, req.dynamic)


def _train(s: Session, loop: _Loop, batch: dict) -> dict:
    """Step 6.: the PPO epochs; policy and critic train concurrently, each on its data-parallel shares.
    Their stats, and `train_s`."""
    import ray

    from stages.ppo.worker import shard_batch

    timing: dict[str, float] = {}
    with timed(timing, "train_s"):
        policy, critic = s.role("policy"), s.role("critic")
        refs = policy.run_each("train_policy", shard_batch(batch, len(policy)), hp=loop.hp)
        crefs = critic.run_each("train_critic", shard_batch(batch, len(critic)), hp=loop.hp) if critic else []
        stats = ray.get(refs)[0] | (ray.get(crefs)[0] if critic else {})
    return stats | timing


def _sync(s: Session, it: int) -> dict:
    """Step 7.: the new weights into every engine (the layout's `sync_weights`); the timings and size."""
    timing: dict[str, float] = {}
    with timed(timing, "sync_s"):
        load_s, sync_bytes = s.layout.sync_weights(it + 1)
    return timing | {"sync_load_s": load_s, "sync_mb": sync_bytes / 2**20}


def _log(s: Session, cfg: PPOConfig, ctx: StageContext, loop: _Loop, it: int, sc: _Scored, trained: dict,
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
        "reward_mean": float(torch.tensor(sc.scores).mean()),
        "rule_reward_mean": sum(sc.rule_scores) / len(sc.rule_scores),
        "kl": seq_kl, "kl_coef": loop.kl_ctl.value, "response_length": gen_tokens / n,
        # cut off by sampling.max_new_tokens (or environment max_turns / max_tokens)
        "truncated_frac": sum(not x["finished"] for x in sc.flat) / len(sc.flat),
        **episode_stats(sc.flat),  # with an environment: turns, tool calls, errors and time
        **trained, "generate_s": sc.wait_s, "score_s": sc.score_s, **synced, "staleness": sc.staleness,
        "gen_tokens_per_s": gen_tokens / max(sc.gen_span, 1e-9), "iteration_s": time.time() - t_iter,
        "engine_restarts": s.layout.restarts, **sc.mismatch, **(loop.clock.metrics() if it == loop.start else {}),
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


def _checkpoint(s: Session, cfg: PPOConfig, ctx: StageContext, loop: _Loop, it: int) -> None:
    """Step 9.: every `checkpoint_every` iterations and at the end (and the fault drill's raise after one)."""
    if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
        _save(ctx.checkpoint_dir, it, s.trained, {"iteration": it, "kl_coef": loop.kl_ctl.value, "trend": loop.trend,
              "moments": s.moments.state() if s.moments is not None else None}, ctx.storage)
        if loop.fault_after and it + 1 >= loop.fault_after > loop.start:
            faults.inject("AFTER_ITERATION", f"after iteration {it + 1}")
