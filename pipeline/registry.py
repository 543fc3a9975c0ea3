"""The stage registry: plain data. Which stages exist, what they read and what they produce.

Stages meet only through the artifacts named here. The runner orders stages by these
inputs/outputs, and a stage's cache key covers exactly the config sections listed in `config`
and `reads` (plus its code, upstream keys and raw input files): a stage that starts reading
another config section must list it in `reads`, or changes to it would not invalidate the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: str  # has run(cfg, ctx) -> {output name: path}; may have raw_inputs(pipeline_cfg)
    config: str  # dotted path of the section passed to run() as `cfg`
    reads: tuple[str, ...]  # other config paths the stage reads through ctx.pipeline
    inputs: tuple[str, ...]  # artifacts it consumes
    outputs: tuple[str, ...]  # artifacts it produces
    about: str
    code: tuple[str, ...] = ()  # further modules whose source is part of this stage's code (tune runs its target)
    # What the run summary, `--json` and the parent MLflow run show of it: templates over its
    # manifest's metrics (`pipeline.outcomes`); one whose metrics are missing is left out.
    outcomes: tuple[str, ...] = ()
    # Settings inside what it reads that cannot change its outputs (the model and data stages read all of
    # `task` to generate it, but how answers are scored is not theirs): left out of its cache key.
    ignores: tuple[str, ...] = ()


# A training stage's fixed cost: stage start -> its first optimizer step (ppo: its first iteration), held-out
# evaluations before it not counted (pipeline.events.StartupClock).
STARTUP = "start-up {startup_s:.1f}s"
PPO_OUTCOME = ("accuracy {eval_accuracy_before:.3f} -> {eval_accuracy:.3f} on {eval_prompts:.0f} held-out prompts "
               "(sign test p={eval_accuracy_sign_test_p:.3g})")


STAGES: tuple[StageSpec, ...] = (
    StageSpec("model", "stages.model", "model", ("seed", "task"), (), ("base_model",),
              "build the embedded base model + tokenizer, or check a local checkpoint",
              outcomes=("{num_parameters:,.0f} parameters",), ignores=("task.verifier",)),
    StageSpec("data", "stages.data", "stages.data", ("seed", "task"), ("base_model",),
              ("sft_data", "preference_data", "prompt_data"),
              "Ray Data: validate, dedupe, template, tokenize, mask, split, write Parquet",
              outcomes=("{sft_train_rows:.0f} SFT rows", "{preference_train_rows:.0f} preference pairs",
                        "{prompts_train_rows:.0f} RL prompts"), ignores=("task.verifier",)),
    StageSpec("sft", "stages.sft", "stages.sft", ("seed", "task.verifier"), ("base_model", "sft_data", "prompt_data"), ("sft_model",),
              "Ray Train + DeepSpeed ZeRO: supervised fine-tuning on assistant tokens",
              outcomes=("eval loss {eval_loss:.3f}",
                        "accuracy {base_accuracy:.3f} -> {accuracy:.3f} on {accuracy_prompts:.0f} prompts", STARTUP)),
    StageSpec("reward", "stages.reward", "stages.reward", ("seed", "task.preference"), ("base_model", "sft_model", "preference_data"),
              ("reward_model",), "Ray Train + DeepSpeed ZeRO: Bradley-Terry reward model on preference pairs",
              outcomes=("pairwise accuracy {eval_accuracy:.3f}", "against gold {eval_accuracy_gold:.3f}", STARTUP)),
    StageSpec("dpo", "stages.dpo", "stages.dpo", ("seed", "task.verifier"), ("base_model", "sft_model", "preference_data", "prompt_data"),
              ("dpo_model",), "Ray Train + DeepSpeed ZeRO: DPO / IPO / SimPO / KTO on the preference pairs, no reward model",
              outcomes=("implicit-reward accuracy {eval_reward_accuracy:.3f}",
                        "accuracy {eval_accuracy_before:.3f} -> {eval_accuracy:.3f} on {eval_prompts:.0f} held-out prompts "
                        "(sign test p={eval_accuracy_sign_test_p:.3g})", STARTUP)),
    StageSpec("ppo", "stages.ppo", "stages.ppo", ("seed", "task.preference", "task.verifier"), ("sft_model", "reward_model", "prompt_data"),
              ("policy_model",), "vLLM rollout engines + DeepSpeed roles: PPO/GRPO on the reward, weights synced",
              outcomes=(PPO_OUTCOME, "gold win-rate {gold_winrate:.3f} against SFT (p={gold_winrate_p:.3g})",
                        # the eval_every curve, first point -> last (a template whose metrics are missing is left out)
                        "curve accuracy {curve_accuracy_first:.3f} -> {curve_accuracy_last:.3f}",
                        "reward {curve_reward_first:.3f} -> {curve_reward_last:.3f}, "
                        "length {curve_length_first:.1f} -> {curve_length_last:.1f}", STARTUP,
                        # failed calls of the user's code (shown only when there were any: the metrics exist then)
                        "reward errors {rule_errors_total:.0f}", "reward timeouts {rule_timeouts_total:.0f}",
                        "environment errors {env_errors_total:.0f}")),
    # serve registers in the tracking server's model registry: another registry is another result.
    # `tracking_uri` is PipelineConfig's, without the password: another password is the same registry.
    StageSpec("serve", "stages.serve", "stages.serve", ("seed", "tracking_uri"), ("policy_model",), ("served_model",),
              "MLflow Model Registry + Ray Serve LLM: register the model, serve an OpenAI-compatible API",
              outcomes=("version {registered_version:.0f}", "p50 {smoke_latency_p50_s:.2f}s",
                        "{smoke_tokens_per_s:.0f} tokens/s")),
)


def _wired(spec: StageSpec, cfg: Any) -> StageSpec:
    """A stage's inputs in this pipeline: serve reads its source model; without an sft stage RL starts from
    the base model (so do the reward model and DPO); without a reward stage PPO's critic starts from the policy's own start."""
    stages = cfg.stages
    if spec.name == "serve":
        return replace(spec, inputs=(stages.serve.source,))
    if spec.name == "ppo":
        start = "sft_model" if stages.sft is not None else "base_model"
        return replace(spec, inputs=(start, *(("reward_model",) if stages.reward is not None else ()), "prompt_data"))
    if spec.name in ("reward", "dpo") and stages.sft is None:
        return replace(spec, inputs=tuple(i for i in spec.inputs if i != "sft_model"))
    return spec


def stages_for(cfg: Any) -> tuple[StageSpec, ...]:
    """The stages of a pipeline config: STAGES without those set to null (their consumers rewired, `_wired`;
    serve too may be null, and nothing reads its output), with serve reading its configured source model, plus
    the batch_infer stage when `stages.batch_infer` is set and the tune stage when `stages.tune` is.

    The tune stage reads what its target reads (it runs the target's code on the same artifacts)
    and the target's config section. A target with `use_tuned: true` also consumes the sweep's
    `best_config`, which places the sweep before it.
    """
    stages = tuple(_wired(s, cfg) for s in STAGES if s.name in ("model", "data") or getattr(cfg.stages, s.name) is not None)
    batch = cfg.stages.batch_infer
    if batch is not None:
        inputs = (batch.source, *(("prompt_data",) if batch.prompts is None else ()),
                  *(("reward_model",) if batch.score.reward_model else ()))
        stages += (StageSpec("batch_infer", "stages.batch_infer", "stages.batch_infer", ("seed", "task.verifier"), inputs,
                             ("predictions",), "Ray Data LLM: completions for a prompts dataset, scored, as Parquet",
                             outcomes=("{rows:.0f} rows", "{rows_failed:.0f} failed")),)
    tune = cfg.stages.tune
    if tune is None:
        return stages
    target = next(s for s in STAGES if s.name == tune.target)
    sweep = StageSpec("tune", "stages.tune", "stages.tune", ("seed", target.config), target.inputs, ("best_config",),
                      f"Ray Tune: sweep {tune.target}'s config, every trial its real training, tracked in MLflow",
                      code=(target.module,), outcomes=("{trials:.0f} trials",))
    uses = getattr(cfg.stages, tune.target).use_tuned
    return tuple(replace(s, inputs=(*s.inputs, "best_config")) if s is target and uses else s for s in stages) + (sweep,)
