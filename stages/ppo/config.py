"""The PPO stage's typed config: algorithm, schedule, rollouts, rewards and the four roles.

Kept apart from the stage's code so `pipeline.config` can validate a pipeline YAML without
importing anything heavy; every field's description is in the configuration reference, docs/configuration.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from pipeline.schema import Section
from stages.common.deepspeed import DeepSpeedSection, LoraSection, zero3_problem
from stages.ppo.placement import fits_layout, needed, on_cpu, shortfall

GROUPED = ("grpo", "rloo", "dr_grpo")  # baselines from the other samples of the same prompt


class TrainedRole(Section):
    """A trainable role (policy, critic): its ranks, optimizer and DeepSpeed settings."""

    num_ranks: int = Field(1, ge=1, description="Data-parallel ranks (Ray actors, one process group).")
    cpus_per_rank: int = Field(1, ge=1, description="Logical CPUs each rank reserves; on CPU also its torch threads.")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clipping.")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="DeepSpeed ZeRO settings.")
    lora: LoraSection | None = Field(None, description="Train LoRA adapters instead of every weight (empty: full "
                                     "fine-tuning). On the policy, the reference becomes the same model with its "
                                     "adapter switched off (no reference ranks are started).")

    @model_validator(mode="after")
    def _lora_fits_zero(self) -> "TrainedRole":
        problem = zero3_problem(self.lora, self.deepspeed.zero_stage, "lora")
        if problem:
            raise ValueError(problem)
        return self


class FrozenRole(Section):
    """A frozen role (reference, reward model): its ranks and DeepSpeed settings (ZeRO-3 shards it)."""

    num_ranks: int = Field(1, ge=1, description="Ranks (Ray actors) holding the model.")
    cpus_per_rank: int = Field(1, ge=1, description="Logical CPUs each rank reserves; on CPU also its torch threads. "
                               "A role that computes while the others wait (the reward model scores rollouts and "
                               "held-out answers alone) runs faster with the cores they leave idle.")
    deepspeed: DeepSpeedSection = Field(default_factory=lambda: DeepSpeedSection(zero_stage=0),
                                        description="DeepSpeed settings (zero_stage 3 shards the frozen weights).")


class ReferenceRole(FrozenRole):
    """The frozen reference: ranks of its own, or a copy inside each policy rank (`colocate`)."""

    colocate: bool = Field(False, description="Hold the reference inside the policy ranks (a frozen copy beside "
                           "each rank's policy, plain torch) instead of ranks of its own: one role fewer to start, "
                           "and its log-probs are computed on the policy's data-parallel shares, on every policy "
                           "rank at once. Costs one model copy per policy rank; not with zero_stage 3 (nothing "
                           "shards the copy). With policy.lora the policy is its own reference either way.")

    @model_validator(mode="after")
    def _colocated_is_unsharded(self) -> "ReferenceRole":
        if self.colocate and self.deepspeed.zero_stage == 3:
            raise ValueError("colocate: a colocated reference is a plain copy in each policy rank and cannot be "
                             "sharded; set deepspeed.zero_stage below 3, or colocate: false")
        return self


class SamplingConfig(Section):
    """How the engines sample rollouts."""

    n: int = Field(4, ge=1, description="Samples per prompt (GRPO compares them; needs >= 2).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(16, ge=1, description="Longest response in tokens.")


class RolloutConfig(Section):
    """The vLLM rollout engines."""

    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True, populate_by_name=True)

    async_: bool = Field(False, alias="async", description="One-step off-policy: the engines generate iteration i+1's "
                         "rollouts (with the weights before update i) while the policy scores and trains on iteration "
                         "i's. Rollouts are then at most one policy update old (checked every iteration, logged as "
                         "`staleness`); the policy loss is corrected by truncated importance weights min(pi_old / "
                         "pi_rollout, tis.cap) per token. PPO and the critic-free algorithms alike.")
    engine_logprobs: bool = Field(False, description="Take the old policy's log-probs from the engines (those of "
        "the tokens they sampled) instead of a forward pass of the policy ranks over every rollout: one pass less per "
        "iteration. Exact when the engines compute as the trainer (fp32 on CPU: logprob_mismatch ~1e-6; check it "
        "before turning this on with bf16 engines). With `async` the PPO ratio is then taken against the policy that "
        "sampled, one update old, which needs no importance weights. `logprob_mismatch_*` is not measured.")
    num_engines: int = Field(2, ge=1, description="vLLM engines, one Ray actor each.")
    cpus_per_engine: float = Field(1.0, gt=0, description="Logical CPUs each engine reserves.")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache per engine in GiB (VLLM_CPU_KVCACHE_SPACE on CPU).")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM's memory fraction (of RAM on "
                                                 "CPU). Empty: 0.9 of a separate engine's own GPU, else 0.3.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "SPREAD", description="Ray placement strategy of the engines' bundles.")
    sleep_mode: bool = Field(False, description="layout colocated on GPUs: each rank's engine releases its GPU "
                             "memory while the rank trains (vLLM's sleep mode), gpu_memory_utilization its share while "
                             "awake. Nothing to release on CPU (vLLM's CPU worker has no sleep mode).")
    sleep_level: Literal[1, 2] = Field(2, description="With sleep_mode: 2 discards the weights asleep, the sync loads "
                                       "them (TRL's order); 1 copies them to CPU memory and back "
                                       "(stages/ppo/sleep.py).")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens each engine schedules per step (vLLM's "
        "key; empty: its default; set, at most min(it, 256) sequences run at once, as vLLM requires). On CPU (no "
        "chunked prefill) at least the longest prompt plus max_new_tokens.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs each engine shards its model over (vLLM's key, its "
        "multiprocessing executor inside the engine's actor). Layout separate on GPUs, with gpus_per_process 1.")
    sync_transport: Literal["object_store", "nccl"] = Field("object_store", description="How a weight sync reaches "
        "engines of their own (layout separate): object_store puts the merged weights into Ray's object store once "
        "for every engine to load; nccl broadcasts them from policy rank 0's GPU into each engine's GPUs over vLLM's "
        "own weight transfer (stages/ppo/nccl_sync.py). nccl: GPUs, gpus_per_process 1.")

    def max_staleness(self) -> int:
        """Policy updates a rollout may lag the policy that trains on it."""
        return 1 if self.async_ else 0


class KLConfig(Section):
    """The KL penalty to the reference policy."""

    estimator: Literal["k1", "k2", "k3"] = Field("k1", description="Per-token KL estimator (Schulman's k1/k2/k3).")
    coef: float = Field(0.05, ge=0, description="KL coefficient (start value if adaptive).")
    controller: Literal["fixed", "adaptive"] = Field("fixed",
                                                     description="Keep the coefficient, or steer KL to `target`.")
    target: float = Field(1.0, gt=0, description="Adaptive controller: target KL per sequence.")
    horizon: int = Field(10000, ge=1, description="Adaptive controller: horizon in sequences.")
    importance_weighted: bool = Field(False, description="Group algorithms (KL in the loss, k3): multiply each "
                                      "token's KL by the importance ratio pi / pi_old, which makes its gradient the "
                                      "unbiased reverse-KL gradient once the policy has moved within an iteration "
                                      "(DeepSeek-V3.2; TRL's use_bias_correction_kl, on there by default). Off: the "
                                      "plain k3 term, as before.")


class TISConfig(Section):
    """Truncated importance sampling: correct for the rollout engine sampling from a slightly
    different distribution than the trainer computes (kernels, precision)."""

    enabled: bool = Field(False, description="Weight each token's policy loss by min(pi_trainer / pi_rollout, cap). "
                          "Off by default: with fp32 weights on CPU the engines match the trainer (the "
                          "logprob_mismatch metrics stay ~1e-6), so the weights are all ~1.")
    cap: float = Field(2.0, gt=0, description="Truncation of the importance weight (bounds its variance).")


class DistillConfig(Section):
    """On-policy distillation: a teacher scores every token the student (the policy) samples."""

    teacher: Path = Field(description="The teacher, with the student's tokenizer: a local HF checkpoint directory, "
                          "a policy stage's artifact directory (<run_dir>/artifacts/ppo/<key>), or another run's "
                          "directory (its newest finished ppo, dpo or sft policy; DIR:STAGE picks the stage), resolved "
                          "to the checkpoint when the config loads. The checkpoint's files are part of the stage's "
                          "cache key.")
    weight: float = Field(1.0, gt=0, description="Each sampled token's reward is weight x (log p_teacher - log "
                          "p_student): a one-sample estimate of minus the reverse KL, KL(student || teacher), "
                          "added to the advantage of that token (group algorithms) or to its reward (ppo, "
                          "reinforce_pp). With rewards.rule_weight > 0 the verifier's advantage is mixed in.")
    role: FrozenRole = Field(default_factory=FrozenRole, description="The teacher's ranks (frozen, like the "
                             "reference): they compute the log-probs of the student's samples.")

    @field_validator("teacher", mode="before")
    @classmethod
    def _a_model(cls, v) -> Path:
        """A checkpoint as given, or the policy a run or stage artifact holds (stages/common/runs.py, as
        `pipeline compare` finds A and B), refused as `model.source` is when it could run code on load
        (pickle weights, `auto_map` code: `models.checkpoint_safety_problem`, the same check)."""
        from pipeline.errors import UserError
        from stages.common.models import checkpoint_safety_problem
        from stages.common.runs import find_policy

        given = str(v)
        path = Path(given).expanduser().absolute()
        if (path / "config.json").is_file():
            model = path
        else:
            try:
                model = find_policy(given).model_dir
            except UserError as exc:
                raise ValueError(f"{given}: not a model directory (no config.json) nor a run's policy ({exc}); give "
                                 "a local HF checkpoint, a policy stage's artifact directory or a run "
                                 "directory") from None
            if not (model / "config.json").is_file():
                raise ValueError(f"{given}: its policy {model} has no config.json (a half-written artifact?)")
        problem = checkpoint_safety_problem(model)
        if problem:
            raise ValueError(problem)
        return model


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling: replace the groups that carry no learning signal (group algorithms)."""

    enabled: bool = Field(False, description="After scoring, a prompt whose samples all scored the same (all right "
                          "or all wrong: zero advantage under a group baseline) is replaced by a fresh prompt's "
                          "group, sampled and scored in up to max_refills extra rounds. Still short after them: the "
                          "batch is filled with the dropped groups (zero advantage), so its size never changes. "
                          "Logged as dynamic_kept_share (before refills) and dynamic_refills.")
    max_refills: int = Field(2, ge=1, description="Extra rounds of prompts (prompts_per_iteration each) at most "
                             "per iteration: bounds the cost of an iteration whose prompts are nearly all solved "
                             "or all failed.")


class OverlongConfig(Section):
    """DAPO's soft overlong punishment, added to each response's reward."""

    cache: int | None = Field(None, ge=1, description="Tokens before the response limit (sampling.max_new_tokens, "
                              "or environment.max_tokens) where the penalty starts: 0 up to limit - cache tokens, "
                              "then falling linearly to -penalty at the limit (TRL's "
                              "get_soft_overlong_punishment(limit, cache) times penalty). Empty: off.")
    penalty: float = Field(1.0, gt=0, description="The penalty at the limit, in the reward's units.")


class RewardMix(Section):
    """What a response scores: reward model and rule reward, mixed by weight."""

    model_weight: float = Field(0.0,
                                description="Weight of the reward model's score (0: the reward model is not loaded).")
    rule_weight: float = Field(1.0, description="Weight of the rule reward.")
    rule: str = Field("verifier", description="'verifier' (1 if task.verifier accepts the answer, else 0), "
                      "'code_tests' (the response's Python judged by the row's MBPP or HumanEval tests in a sandbox: 1 "
                      "if every check passes; docs/security.md) or 'module:function' naming any of prompt, response, "
                      "answer, row or your prompt columns as parameters (may be async), returning a float.")
    workers: int = Field(2, ge=1, description="Ray actors that run a 'module:function' or code_tests rule reward, "
                         "or a 'module:function' task.verifier, in parallel (a built-in verifier runs in the driver).")
    timeout_s: float = Field(30.0, gt=0, description="Per call of a 'module:function' or code_tests rule reward: "
                             "a call still running after this scores timeout_score, is counted (rule_timeouts) and its "
                             "worker is killed "
                             "and replaced, whatever the code is doing.")
    timeout_score: float = Field(0.0, description="The rule reward of a call that timed out, raised or returned "
                                 "no finite number (rule_timeouts / rule_errors per iteration in MLflow, on the "
                                 "progress line and in the run summary).")
    max_error_share: float = Field(0.5, ge=0, le=1, description="Stop the stage (exit 1, naming the function, "
                                   "the exception and a row) when more than this share of one batch's calls of a "
                                   "'module:function' or code_tests rule reward, a 'module:function' task.verifier, "
                                   "or of an iteration's environment episodes fail (raise, time out, return no "
                                   "finite number). Every call of the first batch failing always stops it; 1: "
                                   "otherwise never stop.")
    normalize: bool = Field(False, description="Standardise the reward model's scores by the running mean and std "
                            "of every training batch's scores so far (then weighted by model_weight): the proxy's "
                            "scale no longer depends on how far Bradley-Terry training spread its logits.")
    clip: float | None = Field(None, gt=0, description="Clip the reward model's (normalised, if normalize) scores "
                               "to [-clip, clip]: the policy gains nothing by pushing the proxy past it, a standard "
                               "guard against reward over-optimisation (empty: no clipping).")
    ensemble: Literal["mean", "min", "lcb"] = Field("mean", description="How the heads of a reward model trained "
                                                    "with stages.reward.heads > 1 make one score: their mean, their "
                                                    "min (worst case), or lcb, mean - ensemble_coef x their std "
                                                    "(uncertainty-weighted). The conservative two penalise answers "
                                                    "the heads disagree on, which is where the policy has drifted "
                                                    "from the preference data (one head: its score).")
    ensemble_coef: float = Field(1.0, ge=0, description="lcb: how many of the heads' standard deviations to take "
                                 "off their mean.")

    @field_validator("rule")
    @classmethod
    def _rule_form(cls, v: str) -> str:
        if v not in ("verifier", "code_tests") and (":" not in v or not all(v.split(":", 1))):
            raise ValueError(f"must be 'verifier', 'code_tests' or 'module:function', got {v!r}")
        return v



class EnvironmentConfig(Section):
    """Multi-turn rollouts: each sample talks with an environment (tools, a user) until it is done
    (docs/tools.md; the protocol is in stages/ppo/environments.py)."""

    name: str = Field(..., description="'calculator' (one tool, calculator(expression): + - * / // % ** and "
                      "parentheses), 'python' (one tool, python(code): run in the code_tests sandbox, its output "
                      "returned) or 'module:Class' with reset(row) -> messages | None and step(messages, turn) -> "
                      "(messages, reward, done), built once per sample with `options`.")
    options: dict = Field(default_factory=dict, description="Keyword arguments for the environment's class.")
    max_turns: int = Field(4, ge=1, description="Assistant turns per sample at most; a sample still calling tools "
                           "then ends (counted in truncated_frac).")
    max_tokens: int = Field(64, ge=2, description="Tokens of the whole response at most: the model's turns and "
                            "what the environment adds (sampling.max_new_tokens caps each turn). The trainer's "
                            "sequence width.")
    tool_timeout_s: float = Field(10.0, gt=0, description="An environment call (a tool) still running after this: the "
                                  "model is told the tool timed out and the sample goes on without it (tool_errors); "
                                  "a call holding the interpreter (C code) gets its engine killed and restarted 10 s "
                                  "later, and the stage stops after 3 such stalls in a row.")
    max_output_chars: int = Field(1000, ge=16, description="A tool's output is cut to this many characters (saying so) "
                                  "before it is rendered into the context.")
    tool_parser: str = Field("hermes", description="vLLM tool-call parser reading the model's calls (vllm serve "
                             "--tool-call-parser): hermes (<tool_call>{...}</tool_call>: Qwen, Hermes, SmolLM3 and the "
                             "built-in model's template), llama3_json, mistral, ...")
    tool_workers: int = Field(8, ge=1, description="Threads per engine running environment calls, so one slow tool "
                              "call never holds up the other samples' turns.")
    reward_weight: float = Field(1.0, description="Weight of the environment's reward (summed over the episode) "
                                 "added to the score; the built-in tools give 0 and leave the score to rewards.")
    log_trajectories: int = Field(2, ge=0, description="Whole conversations (tool calls and outputs) attached to the "
                                  "MLflow run every iteration as trajectories/iter_NNNN.json.")

    @field_validator("name")
    @classmethod
    def _name_form(cls, v: str) -> str:
        if v not in ("calculator", "python") and (":" not in v or not all(v.split(":", 1))):
            raise ValueError(f"must be 'calculator', 'python' or 'module:Class', got {v!r}")
        return v


class SandboxConfig(Section):
    """The sandbox model-written code runs in: the code_tests reward and the python tool (docs/security.md)."""

    allow_weak: bool = Field(False, description="Run model-written code (rewards.rule: code_tests, environment.name: "
                             "python) even where only a weak sandbox tier works (unshare+rlimits+uid, "
                             "userns-net+rlimits, rlimits: they cannot hide the filesystem, and the weakest neither "
                             "the network nor the parent's environment). Off: the stage refuses to start there, "
                             "naming the tier and how to get bubblewrap working (docs/security.md).")


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
    gpus_per_process: float = Field(1.0, gt=0, le=1, description="On GPUs, the share of one each rank and engine asks "
                                    "Ray for: 1 a GPU each, 0.25 four processes a GPU (stages/ppo/placement.py).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip range: the ratio stays within "
                            "[1 - clip_eps, 1 + clip_eps_high] (TRL's epsilon).")
    clip_eps_high: float | None = Field(None, gt=0, description="The upper clip range, DAPO's clip-higher (0.28 in "
                                        "the paper; TRL's epsilon_high). Empty: clip_eps, or 5.0 with loss_type "
                                        "cispo, where it is the cap on the importance weight itself (ScaleRL's "
                                        "value).")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] | None = Field(
        None, description="How the policy loss averages its tokens, by TRL's GRPOConfig.loss_type names and "
        "formulas (docs/objectives.md): 'bnpo' token mean of each micro-batch; 'grpo' each response's token mean, "
        "then the mean over responses; 'dr_grpo' token sum / (responses x the response limit); 'dapo' token mean "
        "over the optimizer step; 'cispo' dapo's average of MiniMax-M1's loss (the importance weight clipped at "
        "clip_eps_high, no gradient through it, every token's gradient kept). Empty: 'bnpo' ('dr_grpo' with "
        "algorithm: dr_grpo).")
    importance_sampling: Literal["token", "sequence"] = Field(
        "token", description="'token': one ratio per token (PPO, GRPO); 'sequence': one per response, the mean of "
        "its tokens' log-ratios (GSPO; TRL's importance_sampling_level), with the GSPO paper's small clip ranges "
        "(clip_eps: 0.0003, clip_eps_high: 0.0004) and loss_type: grpo.")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig,
                                                    description="DAPO's dynamic sampling (group algorithms).")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="DAPO's soft overlong penalty.")
    distill: DistillConfig | None = Field(None, description="On-policy distillation from a teacher model "
                                          "(docs/distillation.md); empty: off.")
    value_clip: float | None = Field(0.2, gt=0, description="Value clip range (empty: no value clipping).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    whiten_advantages: bool = Field(True, description="Normalise advantages to mean 0, std 1 per batch (PPO).")
    group_std_floor: float = Field(0.1, ge=0, description="GRPO: a prompt's group whose scores spread (std) less "
                                   "than this is divided by it instead of its own spread, so nearly equal scores "
                                   "(a reward model's small differences between equally wrong answers) do not become "
                                   "unit advantages. In the reward's units; the verifier's 0/1 groups of n >= 2 "
                                   "spread at least 0.33 when they differ, so it leaves them alone.")
    critic_zero_init: bool = Field(True, description="Start the critic's value head at zero (its backbone from the "
                                   "reward model). The reward model's head outputs Bradley-Terry logits, several units "
                                   "off the 0-1 scale of the rewards; such values swamp the first advantages.")
    tis: TISConfig = Field(default_factory=TISConfig, description="Truncated importance-sampling correction.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty to the reference.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Rollout sampling.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="vLLM rollout engines.")
    rewards: RewardMix = Field(default_factory=RewardMix, description="Reward model and rule reward.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="The sandbox of model-written code "
                                   "(code_tests, the python tool).")
    environment: EnvironmentConfig | None = Field(None, description="Multi-turn rollouts with tools or an "
                                                  "environment (empty: one prompt -> one completion). The rule "
                                                  "reward and the held-out evaluation read the last assistant turn.")
    layout: Literal["colocated", "separate"] = Field(
        "separate", description="'colocated': one Ray actor per policy rank holds the policy, its own vLLM engine "
        "(in process; weights loaded in place), the frozen roles and the critic; the roles take turns and follow "
        "policy.num_ranks, one engine per rank (rollout.sleep_mode on GPUs); not with rollout.async or an "
        "environment. 'separate': every role on ranks of its own, engines as actors of their own (docs/rl.md, "
        "Layouts).")
    policy: TrainedRole = Field(default_factory=lambda: TrainedRole(num_ranks=2), description="The policy role.")
    critic: TrainedRole = Field(default_factory=lambda: TrainedRole(lr=1e-4), description="The critic role (PPO).")
    reference: ReferenceRole = Field(default_factory=ReferenceRole, description="The frozen reference role.")
    reward: FrozenRole = Field(default_factory=FrozenRole, description="The reward-model role.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement strategy of each role's ranks.")
    checkpoint_every: int = Field(5, ge=1,
                                  description="Checkpoint policy and critic every N iterations (and at the end).")
    eval_prompts: int | None = Field(None, ge=0, description="Held-out prompts scored before and after PPO "
                                     "(empty: every held-out prompt; 0: skip).")
    eval_every: int | None = Field(None, ge=1, description="Every N iterations (and before the first): the "
                                   "held-out curve on `curve_prompts` held-out prompts (your own with "
                                   "stages.data.sources.eval): accuracy (task.verifier), mean training reward, "
                                   "response length, mean reward-model score (the proxy), mean gold score (with "
                                   "task.preference.gold) and KL to the reference per response, logged as heldout_* "
                                   "metrics, first -> last in the run summary and, at the end, as the plot "
                                   "overoptimisation.png (gold and proxy against KL). Empty: off.")
    curve_prompts: int = Field(64, ge=1, description="Held-out prompts each point of the eval_every curve samples.")
    curve_samples: int = Field(4, ge=1, description="Samples per prompt at each point of the eval_every curve.")
    log_samples: int = Field(4, ge=0, description="Sampled completions (with prompt, answer and reward) attached to "
                             "the MLflow run every iteration as samples/iter_NNNN.json (0: none).")
    eval_samples: int = Field(8, ge=0, description="Besides the greedy answer, sample this many responses per held-out "
                              "prompt (rollout sampling, fixed seed) and compare their mean scores too (0: greedy "
                              "only).")
    use_tuned: bool = Field(False, description="Use the best values of the tune stage's sweep over ppo (needs "
                            "stages.tune with target: ppo).")

    @model_validator(mode="after")
    def _batches_fit(self) -> "PPOConfig":
        n, rollouts = self.sampling.n, self.prompts_per_iteration * self.sampling.n
        if self.algorithm in GROUPED and n < 2:
            raise ValueError(f"sampling.n: {self.algorithm} compares samples of the same prompt and needs n >= 2 "
                             f"(got {n}); set sampling.n: 4, or algorithm: ppo")
        if self.dynamic_sampling.enabled and self.algorithm not in GROUPED:
            raise ValueError(f"dynamic_sampling: {self.algorithm} has no group baseline, so no group is without a "
                             f"signal; use it with {', '.join(GROUPED)}, or set dynamic_sampling.enabled: false")
        if self.overlong.cache is not None and self.overlong.cache > self.response_tokens():
            raise ValueError(f"overlong.cache ({self.overlong.cache}) exceeds the response limit "
                             f"({self.response_tokens()} tokens); set it below, e.g. {self.response_tokens() // 4}")
        if rollouts % self.mini_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must divide prompts_per_iteration x "
                             f"sampling.n ({self.prompts_per_iteration} x {n} = {rollouts}); e.g. mini_batch_size: "
                             f"{math.gcd(rollouts, self.mini_batch_size)}")
        if self.rewards.model_weight == 0 and self.rewards.rule_weight == 0 and not self.distill and not (
                self.environment and self.environment.reward_weight):
            raise ValueError("rewards.model_weight and rewards.rule_weight are both 0 (and no environment reward or "
                             "distill teacher): nothing would reward the policy; set one")
        if self.distill and self.environment:
            raise ValueError("distill: a teacher scores single-turn samples; with an environment the tokens it adds "
                             "are not the student's. Use one or the other")
        if self.environment and self.environment.max_tokens < self.sampling.max_new_tokens:
            raise ValueError(f"environment.max_tokens ({self.environment.max_tokens}) is the whole multi-turn "
                             f"response and must be >= sampling.max_new_tokens ({self.sampling.max_new_tokens}), "
                             "one turn's cap; raise it")
        roles = [("policy", self.policy)] + ([("critic", self.critic)] if self.algorithm == "ppo" else [])
        for name, role in roles:
            per_step = self.micro_batch_size * self.ranks(role)
            if self.mini_batch_size % per_step:
                raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must be a multiple of micro_batch_size x "
                                 f"{name}.num_ranks ({self.micro_batch_size} x {self.ranks(role)} = {per_step})")
        fits_layout(self)
        return self

    def ranks(self, role) -> int:
        """A role's ranks: its own, or the policy's in the colocated layout (every role sits in each policy rank)."""
        from stages.ppo.layouts import layout_of

        return layout_of(self).ranks(self, role)

    def objective(self) -> dict:
        """The policy loss's settings (`losses.policy_loss`'s keywords), defaults resolved."""
        agg = self.loss_type or ("dr_grpo" if self.algorithm == "dr_grpo" else "bnpo")
        high = self.clip_eps_high if self.clip_eps_high is not None else 5.0 if agg == "cispo" else self.clip_eps
        return {"agg": agg, "clip_eps": self.clip_eps, "clip_eps_high": high, "level": self.importance_sampling,
                "kl_weighted": self.kl.importance_weighted}

    def response_tokens(self) -> int:
        """The longest response the trainer sees: one turn, or a whole multi-turn episode."""
        return self.environment.max_tokens if self.environment else self.sampling.max_new_tokens

    def cpus_needed(self) -> float:
        """Logical CPUs the stage reserves at once (every rank and engine holds a bundle: placement.bundles)."""
        return needed(self, "CPU")


def check(pipeline_cfg) -> None:
    """The stage's `check` hook: a reward model to score with, and room on a local Ray for the roles and engines."""
    ppo, reward = pipeline_cfg.stages.ppo, pipeline_cfg.stages.reward
    if ppo is None:
        return
    if reward is None and ppo.rewards.model_weight:
        raise ValueError(f"stages.ppo.rewards.model_weight is {ppo.rewards.model_weight:g} but stages.reward is "
                         "null: there is no reward model to score with; set stages.ppo.rewards.model_weight: 0 "
                         "(the rule reward alone) or configure stages.reward")
    have = pipeline_cfg.ray.local_cpus()
    if have is not None and ppo.cpus_needed() > have:
        raise ValueError(f"stages.ppo.rollout.num_engines: the roles and {ppo.rollout.num_engines} engines need "
                         f"{ppo.cpus_needed():g} logical CPUs but the local Ray has {have} (ray.num_cpus); use "
                         "fewer engines or ranks, or raise ray.num_cpus")
    gpus = pipeline_cfg.ray.local_gpus()  # a local Ray's (a cluster's are counted at the stage's start)
    if gpus:
        shortfall(ppo, gpus, ValueError)
    elif gpus == 0:
        on_cpu(ppo, ValueError)


def wire(spec, pipeline_cfg, stages: tuple) -> tuple:
    """The stage's `wire` hook: RL starts from the SFT model, or the base model without an sft stage; without a
    reward stage there is no reward model (the critic starts from the policy's own start)."""
    from dataclasses import replace

    start = "sft_model" if pipeline_cfg.stages.sft is not None else "base_model"
    reward = ("reward_model",) if pipeline_cfg.stages.reward is not None else ()
    return (*stages, replace(spec, inputs=(start, *reward, "prompt_data")))
