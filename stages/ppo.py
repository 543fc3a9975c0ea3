"""PPO stage: improve the SFT policy with rollouts from vLLM engines and a reward to maximise.

Roles (each a `ModelGroup` of `PPOWorker` ranks with DeepSpeed inside, sized in the YAML):
policy (trainable, from the SFT model), critic (trainable, from the reward model; PPO only),
reference (frozen SFT model, for the KL penalty) and reward (the reward model; used when
`rewards.model_weight` is not 0). Rollouts come from `rollout.num_engines` vLLM engines, each a
Ray actor (`stages.common.rollout`); policy ranks send their share of the prompts to engines
themselves (any rank can call any engine). The score of a response mixes the reward model and a
rule reward (the task verifier, or your own `module:function`) by `rewards.*_weight`.

The driver is one loop, `run()`, reading top to bottom:

    sample prompts -> generate -> score -> reference/policy log-probs, values -> advantages
    -> PPO epochs (policy and critic) -> sync weights to the engines -> log -> checkpoint

After every update the policy's full weights go into the object store once and every engine
loads them from there (zero-copy on the same node), so rollouts always come from the current
policy. The critic-free algorithms drop the critic: `grpo`, `rloo` and `dr_grpo` use baselines
from the other `sampling.n` samples of each prompt (KL to the reference in the loss),
`reinforce_pp` whitens per-token returns over the batch (KL in the reward); `advantages()` picks
the estimator. The engines return the log-probs of the tokens they sample; their gap to the
trainer's (`logprob_mismatch_*`) is logged every iteration, and `tis` corrects for it. The math
is in `stages.common.rl`, tested against hand-computed values.

Held-out evaluation: greedy answers of the engines on every eval prompt (and `eval_samples`
sampled ones, same seed), before PPO (the SFT policy) and after, scored by the same reward;
MLflow gets both, and how many prompts changed either way (a paired sign test says whether the
gain is noise). `bench/learning.py` runs this per seed and algorithm.

Run alone: `python -m pipeline run configs/full.yaml --only ppo` (after `sft` and `reward`).
A rerun after an interruption resumes from the last checkpoint (`checkpoint_every`).
For fault drills, `PIPELINE_FAULT_KILL_ENGINE_AT=K` kills rollout engine 0 at iteration K (from
0); the stage restarts it, re-syncs its weights and carries on. `PIPELINE_FAULT_AFTER_ITERATION=N`
raises once after the checkpoint of iteration N (like PIPELINE_FAULT_AFTER_STEP in training).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.errors import UserError
from pipeline.schema import Section
from pipeline.stage import StageContext
from stages.common.deepspeed import DeepSpeedSection


# --------------------------------------------------------------------------- config


GROUPED = ("grpo", "rloo", "dr_grpo")  # baselines from the other samples of the same prompt


class TrainedRole(Section):
    """A trainable role (policy, critic): its ranks, optimizer and DeepSpeed settings."""

    num_ranks: int = Field(1, ge=1, description="Data-parallel ranks (Ray actors, one process group).")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clipping.")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="DeepSpeed ZeRO settings.")


class FrozenRole(Section):
    """A frozen role (reference, reward model): its ranks and DeepSpeed settings (ZeRO-3 shards it)."""

    num_ranks: int = Field(1, ge=1, description="Ranks (Ray actors) holding the model.")
    deepspeed: DeepSpeedSection = Field(default_factory=lambda: DeepSpeedSection(zero_stage=0),
                                        description="DeepSpeed settings (zero_stage 3 shards the frozen weights).")


class SamplingConfig(Section):
    """How the engines sample rollouts."""

    n: int = Field(4, ge=1, description="Samples per prompt (GRPO compares them; needs >= 2).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(16, ge=1, description="Longest response in tokens.")


class RolloutConfig(Section):
    """The vLLM rollout engines."""

    num_engines: int = Field(2, ge=1, description="vLLM engines, one Ray actor each.")
    cpus_per_engine: float = Field(1.0, gt=0, description="Logical CPUs each engine reserves.")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache per engine in GiB (VLLM_CPU_KVCACHE_SPACE on CPU).")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="vLLM's memory fraction (of CPU memory on CPU).")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "SPREAD", description="Ray placement strategy of the engines' bundles.")


class KLConfig(Section):
    """The KL penalty to the reference policy."""

    estimator: Literal["k1", "k2", "k3"] = Field("k1", description="Per-token KL estimator (Schulman's k1/k2/k3).")
    coef: float = Field(0.05, ge=0, description="KL coefficient (start value if adaptive).")
    controller: Literal["fixed", "adaptive"] = Field("fixed", description="Keep the coefficient, or steer KL to `target`.")
    target: float = Field(1.0, gt=0, description="Adaptive controller: target KL per sequence.")
    horizon: int = Field(10000, ge=1, description="Adaptive controller: horizon in sequences.")


class TISConfig(Section):
    """Truncated importance sampling: correct for the rollout engine sampling from a slightly
    different distribution than the trainer computes (kernels, precision)."""

    enabled: bool = Field(False, description="Weight each token's policy loss by min(pi_trainer / pi_rollout, cap). "
                          "Off by default: with fp32 weights on CPU the engines match the trainer (the "
                          "logprob_mismatch metrics stay ~1e-6), so the weights are all ~1.")
    cap: float = Field(2.0, gt=0, description="Truncation of the importance weight (bounds its variance).")


class RewardMix(Section):
    """What a response scores: reward model and rule reward, mixed by weight."""

    model_weight: float = Field(0.0, description="Weight of the reward model's score (0: the reward model is not loaded).")
    rule_weight: float = Field(1.0, description="Weight of the rule reward.")
    rule: str = Field("verifier", description="'verifier' (1 if the task verifier accepts the answer, else 0) or "
                      "'module:function' taking (prompt, response, answer) and returning a float.")

    @field_validator("rule")
    @classmethod
    def _rule_form(cls, v: str) -> str:
        if v != "verifier" and (":" not in v or not all(v.split(":", 1))):
            raise ValueError(f"must be 'verifier' or 'module:function', got {v!r}")
        return v

    @model_validator(mode="after")
    def _something_scores(self) -> "RewardMix":
        if self.model_weight == 0 and self.rule_weight == 0:
            raise ValueError("model_weight and rule_weight are both 0: nothing would reward the policy; set one")
        return self


class PPOConfig(Section):
    """The ppo stage: algorithm, rollouts, roles and schedule."""

    algorithm: Literal["ppo", "grpo", "rloo", "reinforce_pp", "dr_grpo"] = Field(
        "ppo", description="'ppo' (critic + GAE); critic-free: 'grpo' (group-normalised), 'rloo' (leave-one-out "
        "baseline), 'reinforce_pp' (REINFORCE++: batch-whitened returns, KL in the reward), 'dr_grpo' (no std or "
        "length normalisation).")
    iterations: int = Field(20, ge=1, description="Rollout + update iterations.")
    prompts_per_iteration: int = Field(32, ge=1, description="Prompts sampled per iteration (x sampling.n rollouts).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each iteration's rollouts.")
    mini_batch_size: int = Field(32, ge=1, description="Rollouts per optimizer step, over all ranks of a role.")
    micro_batch_size: int = Field(8, ge=1, description="Rollouts per rank per forward pass (the rest is accumulation).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip range.")
    value_clip: float | None = Field(0.2, gt=0, description="Value clip range (empty: no value clipping).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    whiten_advantages: bool = Field(True, description="Normalise advantages to mean 0, std 1 per batch (PPO).")
    critic_zero_init: bool = Field(True, description="Start the critic's value head at zero (its backbone from the "
                                   "reward model). The reward model's head outputs Bradley-Terry logits, several units "
                                   "off the 0-1 scale of the rewards; such values swamp the first advantages.")
    tis: TISConfig = Field(default_factory=TISConfig, description="Truncated importance-sampling correction.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty to the reference.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Rollout sampling.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="vLLM rollout engines.")
    rewards: RewardMix = Field(default_factory=RewardMix, description="Reward model and rule reward.")
    policy: TrainedRole = Field(default_factory=lambda: TrainedRole(num_ranks=2), description="The policy role.")
    critic: TrainedRole = Field(default_factory=lambda: TrainedRole(lr=1e-4), description="The critic role (PPO).")
    reference: FrozenRole = Field(default_factory=FrozenRole, description="The frozen reference role.")
    reward: FrozenRole = Field(default_factory=FrozenRole, description="The reward-model role.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement strategy of each role's ranks.")
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint policy and critic every N iterations (and at the end).")
    eval_prompts: int | None = Field(None, ge=0, description="Held-out prompts scored before and after PPO "
                                     "(empty: every held-out prompt; 0: skip).")
    log_samples: int = Field(4, ge=0, description="Sampled completions (with prompt, answer and reward) attached to "
                             "the MLflow run every iteration as samples/iter_NNNN.json (0: none).")
    eval_samples: int = Field(8, ge=0, description="Besides the greedy answer, sample this many responses per held-out "
                              "prompt (rollout sampling, fixed seed) and compare their mean scores too (0: greedy only).")
    use_tuned: bool = Field(False, description="Use the best values of the tune stage's sweep over ppo (needs "
                            "stages.tune with target: ppo).")

    @model_validator(mode="after")
    def _batches_fit(self) -> "PPOConfig":
        n, rollouts = self.sampling.n, self.prompts_per_iteration * self.sampling.n
        if self.algorithm in GROUPED and n < 2:
            raise ValueError(f"sampling.n: {self.algorithm} compares samples of the same prompt and needs n >= 2 "
                             f"(got {n}); set sampling.n: 4, or algorithm: ppo")
        if rollouts % self.mini_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must divide prompts_per_iteration x "
                             f"sampling.n ({self.prompts_per_iteration} x {n} = {rollouts}); e.g. mini_batch_size: "
                             f"{math.gcd(rollouts, self.mini_batch_size)}")
        roles = [("policy", self.policy)] + ([("critic", self.critic)] if self.algorithm == "ppo" else [])
        for name, role in roles:
            per_step = self.micro_batch_size * role.num_ranks
            if self.mini_batch_size % per_step:
                raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must be a multiple of micro_batch_size x "
                                 f"{name}.num_ranks ({self.micro_batch_size} x {role.num_ranks} = {per_step})")
        return self

    def cpus_needed(self) -> float:
        """Logical CPUs the stage reserves at once (every rank and engine holds one bundle)."""
        ranks = self.policy.num_ranks + self.reference.num_ranks
        ranks += self.critic.num_ranks if self.algorithm == "ppo" else 0
        ranks += self.reward.num_ranks if self.rewards.model_weight else 0
        return ranks + self.rollout.num_engines * self.rollout.cpus_per_engine


# --------------------------------------------------------------------------- pure helpers


def make_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict:
    """Rollouts -> tensors: prompts left-padded to width P, responses right-padded to width T.

    Every response token t then sits at column P + t in every row, so one slice of the logits
    serves the whole batch; position ids count real tokens only, as without padding.
    """
    import torch

    p = max(len(x) for x in prompts)
    t = max(1, max(len(r) for r in responses))
    b = len(prompts)
    ids = torch.full((b, p + t), pad_id, dtype=torch.long)
    attn = torch.zeros((b, p + t), dtype=torch.long)
    for i, (q, r) in enumerate(zip(prompts, responses)):
        ids[i, p - len(q) : p] = torch.tensor(q)
        attn[i, p - len(q) : p] = 1
        if r:
            ids[i, p : p + len(r)] = torch.tensor(r)
            attn[i, p : p + len(r)] = 1
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": position_ids, "prompt_width": p,
            "response_ids": ids[:, p:], "response_mask": attn[:, p:].float()}


def pad_rows(rows: list[list[float]], width: int):
    """Ragged per-token values (e.g. the engines' log-probs) -> (B, width) float tensor, 0-padded."""
    import torch

    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def advantages(cfg: "PPOConfig", scores, kl, mask, kl_coef: float, values=None):
    """(advantages (B, T), returns (B, T) or None, coefficient of the KL term in the policy loss).

    PPO and REINFORCE++ pay the KL to the reference per token inside the reward; the group
    estimators (GRPO, RLOO, Dr. GRPO) score whole responses against their prompt's other
    samples and pay the KL as a loss term instead, as their papers do.
    """
    from stages.common import rl

    if cfg.algorithm == "ppo":
        adv, returns = rl.gae(rl.token_rewards(scores, kl, mask, kl_coef), values, mask, cfg.gamma, cfg.lam)
        return (rl.masked_whiten(adv, mask) if cfg.whiten_advantages else adv), returns, 0.0
    if cfg.algorithm == "reinforce_pp":
        return rl.reinforce_pp_advantages(rl.token_rewards(scores, kl, mask, kl_coef), mask, cfg.gamma), None, 0.0
    per_response = {"grpo": rl.grpo_advantages, "rloo": rl.rloo_advantages,
                    "dr_grpo": rl.dr_grpo_advantages}[cfg.algorithm](scores, cfg.sampling.n)
    return per_response[:, None] * mask, None, kl_coef


def slope(values: list[float]) -> float:
    """Least-squares slope of a series against its index (the trend of the reward per iteration)."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def sign_test_p(improved: int, worsened: int) -> float:
    """Two-sided exact sign test: how likely this split of changed answers is under 'no effect'."""
    n = improved + worsened
    if n == 0:
        return 1.0
    k = min(improved, worsened)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, float]:
    """Held-out metrics before/after PPO, with a paired sign test per measure over the prompts.

    For each measure M: `eval_M_before`, `eval_M` (means over prompts), `eval_M_improved` /
    `eval_M_worsened` (prompts whose value rose / fell) and `eval_M_sign_test_p`.
    """
    out: dict[str, float] = {}
    for key, b in before.items():
        a = after[key]
        up, down = sum(x < y for x, y in zip(b, a)), sum(x > y for x, y in zip(b, a))
        out.update({f"eval_{key}_before": sum(b) / len(b), f"eval_{key}": sum(a) / len(a),
                    f"eval_{key}_improved": up, f"eval_{key}_worsened": down,
                    f"eval_{key}_sign_test_p": sign_test_p(up, down)})
    return out


def rule_reward(spec: str):
    """The rule reward as a function (prompt, response, answer) -> float."""
    if spec == "verifier":
        from stages.common.tasks import verify

        return lambda prompt, response, answer: float(verify(response, answer))
    module, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"stages.ppo.rewards.rule: cannot load {spec!r} ({exc}); give 'verifier' or an importable "
                        "'module:function'") from None
    return fn


def _samples(rows: list[dict], texts: list[str], scores: list[float], correct: list[float], k: int, n: int) -> list:
    """The first sample of the first `k` prompts of an iteration, for a person to read in MLflow."""
    return [{"prompt": rows[i]["prompt"], "answer": rows[i].get("answer"), "response": texts[i],
             "reward": round(scores[i], 4), "rule_reward": correct[i]} for i in range(0, min(k * n, len(rows)), n)]


def _read_prompts(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    files = sorted(path.glob("*.parquet"))
    return pq.ParquetDataset(files).read().to_pylist() if files else []


# --------------------------------------------------------------------------- role set-up


def _ds_config(role, mini: int, micro: int, bf16: bool, trainable: bool) -> dict:
    """DeepSpeed config of one role: AdamW at a constant lr for trainable roles, none for frozen ones."""
    from stages.common.deepspeed import merge, zero_section

    ds = role.deepspeed
    config = {"train_micro_batch_size_per_gpu": micro, "zero_optimization": zero_section(ds),
              "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if trainable:
        config.update({"train_batch_size": mini, "gradient_accumulation_steps": mini // (micro * role.num_ranks),
                       "gradient_clipping": role.grad_clip,
                       "optimizer": {"type": "AdamW", "params": {"lr": role.lr, "weight_decay": role.weight_decay,
                                                                 "betas": [0.9, 0.95], "eps": 1e-8}}})
    else:
        config["train_batch_size"] = micro * role.num_ranks
    return merge(config, ds.extra)


def _start_role(name: str, role, kind: str, model_dir: Path, cfg: PPOConfig, trainable: bool, gpu: bool,
                pad_id: int, seed: int, run_storage):
    """A ModelGroup of PPOWorker ranks holding `model_dir` as `kind`; returns (group, setup refs)."""
    from stages.common.deepspeed import device_env, use_bf16
    from stages.common.groups import ModelGroup
    from stages.common.ppo_worker import PPOWorker

    group = ModelGroup(name, PPOWorker, role.num_ranks, 1, gpu, cfg.placement_strategy, env=device_env(gpu))
    spec = {"role": name, "kind": kind, "model_dir": str(model_dir), "trainable": trainable, "pad_id": pad_id,
            "seed": seed, "storage": run_storage, "activation_checkpointing": role.deepspeed.activation_checkpointing,
            "zero_head": kind == "value" and cfg.critic_zero_init,
            "ds_config": _ds_config(role, cfg.mini_batch_size, cfg.micro_batch_size, use_bf16(role.deepspeed, gpu),
                                    trainable)}
    return group, group.run("setup", spec)


def _check_cluster(cfg: PPOConfig) -> None:
    """Fail before placing anything when the cluster cannot hold every rank and engine at once."""
    import ray

    have = ray.cluster_resources().get("CPU", 0)
    if cfg.cpus_needed() > have:
        raise UserError(f"stages.ppo.rollout.num_engines: the roles and {cfg.rollout.num_engines} engines need "
                        f"{cfg.cpus_needed():g} logical CPUs but the Ray cluster has {have:g}; use fewer engines or "
                        "ranks, or a larger cluster (ray.num_cpus for a local one)")


# --------------------------------------------------------------------------- rollouts and scoring


def _generate(pool, policy, prompt_ids: list[list[int]], sampling: dict, console) -> list[list[dict]]:
    """Policy ranks send their prompt shares to the engines; a dead engine is restarted and the step retried."""
    import ray

    from stages.common.groups import shard

    for attempt in range(3):
        try:
            refs = policy.run_each("generate", shard(prompt_ids, len(policy)), engines=pool.engines,
                                   sampling=sampling)
            return [s for part in ray.get(refs) for s in part]
        except ray.exceptions.RayError as exc:
            restarted = pool.revive()
            if not restarted or attempt == 2:
                raise
            console(f"rollout engine(s) {restarted} died ({type(exc).__name__}); restarted and re-synced, retrying")
    raise AssertionError("unreachable")


def _score(texts: list[str], rows: list[dict], reward_group, cfg: PPOConfig, rule) -> tuple[list[float], list[float]]:
    """(mixed score, verifier-style rule reward) per response."""
    import ray

    from stages.common.groups import shard

    rule_scores = [float(rule(r["prompt"], t, r.get("answer") or "")) for t, r in zip(texts, rows)]
    scores = [cfg.rewards.rule_weight * s for s in rule_scores]
    if reward_group is not None:
        pairs = [(r["prompt"], t) for t, r in zip(texts, rows)]
        parts = ray.get(reward_group.run_each("scores", shard(pairs, len(reward_group)), micro=cfg.micro_batch_size))
        scores = [s + cfg.rewards.model_weight * m for s, m in zip(scores, [x for p in parts for x in p])]
    return scores, rule_scores


def _evaluate(pool, rows: list[dict], tok, reward_group, cfg: PPOConfig, rule) -> dict[str, list[float]]:
    """Per held-out prompt: greedy answer's score and rule reward, and the means over `eval_samples` samples.

    The engines answer with their current weights; sampling uses a fixed seed, so the SFT policy
    (before) and the trained one (after) draw from the same random stream.
    """
    import ray

    from stages.common.groups import shard

    def answers(sampling: dict, k: int) -> tuple[list[float], list[float]]:
        parts = shard([r["prompt_ids"] for r in rows], len(pool.engines))
        outs = ray.get([e.generate.remote(p, sampling) for e, p in zip(pool.engines, parts) if p])
        texts = tok.batch_decode([s["ids"] for part in outs for group in part for s in group], skip_special_tokens=True)
        scores, correct = _score(texts, [r for r in rows for _ in range(k)], reward_group, cfg, rule)
        mean = lambda xs: [sum(xs[i * k:(i + 1) * k]) / k for i in range(len(rows))]  # noqa: E731
        return mean(scores), mean(correct)

    out = dict(zip(("reward", "accuracy"), answers({"temperature": 0.0, "max_tokens": cfg.sampling.max_new_tokens}, 1)))
    if cfg.eval_samples:
        k = cfg.eval_samples
        sampling = {"n": k, "temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
                    "max_tokens": cfg.sampling.max_new_tokens, "seed": 12345}
        out["sampled_reward"], out["sampled_accuracy"] = answers(sampling, k)
    return out


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


# --------------------------------------------------------------------------- the stage


def run(cfg: PPOConfig, ctx: StageContext) -> dict[str, Path]:
    import ray
    import torch

    from stages.common import rl
    from stages.common.deepspeed import use_gpu
    from stages.common.models import load_tokenizer
    from stages.common.ppo_worker import shard_batch
    from stages.common.rollout import EnginePool, EngineSpec

    sft, rm_dir, data = ctx.inputs["sft_model"], ctx.inputs["reward_model"], ctx.inputs["prompt_data"]
    train_rows, eval_rows = _read_prompts(data / "train"), _read_prompts(data / "eval")[: cfg.eval_prompts]
    if len(train_rows) < cfg.prompts_per_iteration:
        raise UserError(f"stages.ppo.prompts_per_iteration ({cfg.prompts_per_iteration}) exceeds the {len(train_rows)} "
                        "training prompts; lower it or generate more prompts (stages.data.generate.prompts)")
    rule, tok, gpu, seed = rule_reward(cfg.rewards.rule), load_tokenizer(sft), use_gpu(), ctx.pipeline.seed
    ppo = cfg.algorithm == "ppo"
    ctx.ray()
    _check_cluster(cfg)
    ctx.progress(f"starting {cfg.rollout.num_engines} vLLM engines and the roles (policy x{cfg.policy.num_ranks}"
                 f"{f', critic x{cfg.critic.num_ranks}' if ppo else ''}, reference x{cfg.reference.num_ranks}"
                 f"{f', reward x{cfg.reward.num_ranks}' if cfg.rewards.model_weight else ''})")
    longest = max(r["num_tokens"] for r in train_rows + eval_rows) + cfg.sampling.max_new_tokens
    spec = EngineSpec(max_model_len=longest, seed=seed, gpu=gpu, kv_cache_gb=cfg.rollout.kv_cache_gb,
                      gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, num_cpus=cfg.rollout.cpus_per_engine,
                      storage=ctx.storage)
    groups, pool = {}, None
    try:
        pad = tok.pad_token_id
        pending = {}
        roles = [("policy", cfg.policy, "causal", sft, True), ("reference", cfg.reference, "causal", sft, False)]
        roles += [("critic", cfg.critic, "value", rm_dir, True)] if ppo else []
        roles += [("reward", cfg.reward, "reward", rm_dir, False)] if cfg.rewards.model_weight else []
        for name, role, kind, model_dir, trainable in roles:
            groups[name], pending[name] = _start_role(name, role, kind, model_dir, cfg, trainable, gpu, pad, seed,
                                                          ctx.storage)
        trained = {name: groups[name] for name, *_, trainable in roles if trainable}
        policy, critic, ref, reward = (groups.get(k) for k in ("policy", "critic", "reference", "reward"))
        pool = EnginePool(str(sft), spec, cfg.rollout.num_engines, cfg.rollout.placement_strategy)
        params = {name: ray.get(refs)[0] for name, refs in pending.items()}
        ctx.progress("ready: " + ", ".join(f"{k} {v / 1e6:.2f}M params" for k, v in params.items()))

        before = _evaluate(pool, eval_rows, tok, reward, cfg, rule) if eval_rows else None
        kl_ctl = rl.kl_controller(cfg.kl.controller, cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
        start, latest = 0, _latest(ctx.checkpoint_dir, ctx.storage)
        if latest:  # resume: DeepSpeed states (optimizer included), KL coefficient, then engines to these weights
            d = ctx.checkpoint_dir / latest["dir"]
            ray.get([r for name, g in trained.items() for r in g.run("load", str(d / name))])
            state = json.loads((d / "state.json").read_text())
            start, kl_ctl.value = state["iteration"] + 1, state["kl_coef"]
            pool.sync(policy.get("export_weights")[0][0])
            ctx.progress(f"resumed from the checkpoint of iteration {state['iteration']}")

        # Fault drills and tests: kill engine 0 at iteration K; raise after the checkpoint of iteration N.
        fault_at = int(os.environ.get("PIPELINE_FAULT_KILL_ENGINE_AT", "-1"))
        fault_after = int(os.environ.get("PIPELINE_FAULT_AFTER_ITERATION", "0"))
        micro, n = cfg.micro_batch_size, cfg.sampling.n
        hp = {"epochs": cfg.ppo_epochs, "micro": micro, "clip_eps": cfg.clip_eps, "entropy_coef": cfg.entropy_coef,
              "value_clip": cfg.value_clip, "kl_loss_coef": 0.0,
              "agg": "seq_sum" if cfg.algorithm == "dr_grpo" else "token_mean", "max_len": cfg.sampling.max_new_tokens}
        metrics: dict[str, float] = {}
        trend = state.get("trend", {"reward": [], "kl": []}) if latest else {"reward": [], "kl": []}
        for it in range(start, cfg.iterations):
            t_iter = time.time()
            # 1. sample prompts (seeded per iteration, so a resumed run sees the same ones)
            rows = random.Random(f"ppo-{seed}-{it}").sample(train_rows, cfg.prompts_per_iteration)
            rows = [r for r in rows for _ in range(n)]  # one row per rollout; a prompt's samples adjacent
            # 2. generate with the current policy weights
            if it == fault_at:
                pool.kill(0)
            t0 = time.time()
            sampling = {"n": n, "temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
                        "max_tokens": cfg.sampling.max_new_tokens, "logprobs": 0,  # the sampled tokens' log-probs
                        # vLLM seeds sample i of a request with seed + i: draw far-apart seeds per iteration
                        "seed": random.Random(f"ppo-sampling-{seed}-{it}").randrange(2**31)}
            samples = _generate(pool, policy, [r["prompt_ids"] for r in rows[::n]], sampling, ctx.progress)
            responses = [s["ids"] for group in samples for s in group]
            rollout_lp = [s["logprobs"] for group in samples for s in group]
            t_gen = time.time() - t0
            # 3. score: reward model and/or rule reward
            t0 = time.time()
            texts = tok.batch_decode(responses, skip_special_tokens=True)
            scores, rule_scores = _score(texts, rows, reward, cfg, rule)
            batch = make_batch([r["prompt_ids"] for r in rows], responses, pad)
            shards = shard_batch(batch, len(policy))
            # 4. log-probs of the reference and the current (old) policy, values of the critic
            ref_lp = torch.cat(ray.get(ref.run_each("logprobs", shard_batch(batch, len(ref)), micro=micro)))
            old_lp = torch.cat(ray.get(policy.run_each("logprobs", shards, micro=micro)))
            mask, score_t = batch["response_mask"], torch.tensor(scores)
            kl = rl.kl_penalty(old_lp, ref_lp, cfg.kl.estimator)
            # the engines sampled these tokens; how far their log-probs are from the trainer's (same weights)
            rollout_lp = pad_rows(rollout_lp, mask.shape[1])
            mismatch = rl.logprob_mismatch(old_lp, rollout_lp, mask)
            if cfg.tis.enabled:
                batch["tis_weights"] = rl.tis_weights(old_lp, rollout_lp, cfg.tis.cap)
            # 5. advantages
            values = torch.cat(ray.get(critic.run_each("values", shard_batch(batch, len(critic)), micro=micro))) \
                if ppo else None
            adv, returns, hp["kl_loss_coef"] = advantages(cfg, score_t, kl, mask, kl_ctl.value, values)
            if ppo:
                batch.update(old_values=values, returns=returns)
            batch.update(advantages=adv, old_logprobs=old_lp, ref_logprobs=ref_lp)
            t_score = time.time() - t0
            # 6. PPO epochs: policy and critic train concurrently, each on its data-parallel shares
            t0 = time.time()
            refs = policy.run_each("train_policy", shard_batch(batch, len(policy)), hp=hp)
            crefs = critic.run_each("train_critic", shard_batch(batch, len(critic)), hp=hp) if ppo else []
            stats = ray.get(refs)[0] | (ray.get(crefs)[0] if ppo else {})
            t_train = time.time() - t0
            # 7. sync: one put of the new weights, every engine loads them
            t0 = time.time()
            weights_ref, sync_bytes = policy.get("export_weights")[0]
            load_s = pool.sync(weights_ref)
            t_sync = time.time() - t0
            # 8. log
            seq_kl = float(rl.masked_mean(kl, mask, dim=1).mul(mask.sum(1)).mean())
            kl_ctl.update(seq_kl, len(rows))
            gen_tokens = float(mask.sum())
            metrics = {
                "reward_mean": float(score_t.mean()), "rule_reward_mean": sum(rule_scores) / len(rule_scores),
                "kl": seq_kl, "kl_coef": kl_ctl.value, "response_length": gen_tokens / len(rows),
                **{k: v for k, v in stats.items()}, "generate_s": t_gen, "score_s": t_score, "train_s": t_train,
                "sync_s": t_sync, "sync_load_s": load_s, "sync_mb": sync_bytes / 2**20,
                "gen_tokens_per_s": gen_tokens / max(t_gen, 1e-9), "iteration_s": time.time() - t_iter,
                "engine_restarts": pool.restarts, **mismatch,
            }
            ctx.log_metrics(metrics, step=it + 1)
            trend["reward"].append(metrics["reward_mean"])
            trend["kl"].append(seq_kl)
            if cfg.log_samples:
                ctx.log_dict(_samples(rows, texts, scores, rule_scores, cfg.log_samples, n), f"samples/iter_{it + 1:04d}.json")
            ctx.progress(f"iter {it + 1}/{cfg.iterations} reward {metrics['reward_mean']:.3f} "
                         f"rule {metrics['rule_reward_mean']:.3f} kl {seq_kl:.3f} len {metrics['response_length']:.1f} "
                         f"| gen {t_gen:.1f}s score {t_score:.1f}s train {t_train:.1f}s sync {t_sync:.2f}s")
            # 9. checkpoint
            if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
                _save(ctx.checkpoint_dir, it, trained, {"iteration": it, "kl_coef": kl_ctl.value, "trend": trend}, ctx.storage)
                if fault_after and it + 1 >= fault_after > start:
                    raise RuntimeError(f"injected fault after iteration {it + 1} (PIPELINE_FAULT_AFTER_ITERATION)")

        out = ctx.out_dir / "model"
        ray.get(policy.run("save_hf", str(out)))
        ctx.storage.pull_path(out)  # with an object store: rank 0 may have written it on another node
        tok.save_pretrained(out)
        final = dict(metrics)
        if trend["reward"]:  # the run's learning curve in two numbers (over every iteration, resumed ones too)
            final.update(reward_slope=slope(trend["reward"]), kl_max=max(trend["kl"]))
        if before is not None:
            final.update(eval_prompts=len(eval_rows), **compare(before, _evaluate(pool, eval_rows, tok, reward, cfg, rule)))
            for key in before:
                ctx.progress(f"held-out {key.replace('_', ' ')} ({len(eval_rows)} prompts): "
                             f"{final[f'eval_{key}_before']:.3f} -> {final[f'eval_{key}']:.3f} "
                             f"({final[f'eval_{key}_improved']} prompts up, {final[f'eval_{key}_worsened']} down, "
                             f"sign test p {final[f'eval_{key}_sign_test_p']:.2g})")
        final["engine_restarts"] = pool.restarts
        ctx.log_metrics(final, step=cfg.iterations)
        return {"policy_model": out}
    finally:
        if pool is not None:
            pool.shutdown()
        for g in groups.values():
            g.shutdown()
