"""The stage registry: plain data. Which stages exist, what they read and what they produce; and `load`, which
imports a stage module by the name given here, with its optional hooks (`pipeline.stage` documents them).

The framework names no stage: `PipelineConfig` is composed from `STAGES` and `SECTIONS` (`pipeline.config
.compose`), a stage's rules about the rest of the config and its place in a pipeline are its own hooks
(`check`, `wire`), and the CLI takes the commands stages provide from `COMMANDS`. Adding a stage is one module
and one line here (docs/architecture.md, "Adding a stage").

Stages meet only through the artifacts named here. The runner orders stages by these
inputs/outputs, and a stage's cache key covers exactly the config sections listed in `config`
and `reads` (plus its code, upstream keys and raw input files): a stage that starts reading
another config section must list it in `reads`, or changes to it would not invalidate the cache.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: str  # has run(cfg, ctx) -> {output name: path}; may have the hooks of pipeline.stage
    config: str  # dotted path of the section passed to run() as `cfg`
    reads: tuple[str, ...]  # other config paths the stage reads through ctx.pipeline
    inputs: tuple[str, ...]  # artifacts it consumes (its `wire` hook may change them for a pipeline)
    outputs: tuple[str, ...]  # artifacts it produces
    about: str
    code: tuple[str, ...] = ()  # further modules whose source is part of this stage's code (tune runs its target)
    # What the run summary, `--json` and the parent MLflow run show of it: templates over its
    # manifest's metrics (`pipeline.outcomes`); one whose metrics are missing is left out.
    outcomes: tuple[str, ...] = ()
    # Settings inside what it reads that cannot change its outputs (the model and data stages read all of
    # `task` to generate it, but how answers are scored is not theirs): left out of its cache key.
    ignores: tuple[str, ...] = ()
    # Its config section's class, "module:Class"; `stages.<name>` of PipelineConfig is composed from it.
    # Empty: the stage is configured by a shared top-level section (SECTIONS: the model stage by `model`).
    settings: str = ""
    # Whether `stages.<name>` is there when the YAML does not say: "always" (it cannot be null), "default"
    # (there unless set to null) or "opt-in" (empty unless configured).
    presence: str = "opt-in"
    doc: str = ""  # the description of `stages.<name>` in the config reference
    view: bool = False  # its outcomes are columns of the MLflow UI's runs table (`pipeline ui`)


@dataclass(frozen=True)
class SectionSpec:
    """A top-level config section that stages share (the base model, the task): "module:Class"."""

    name: str
    settings: str
    doc: str


@dataclass(frozen=True)
class CommandSpec:
    """A command of the CLI that a stage's code provides beside `run` (`python -m pipeline <name>`): its
    module has `add_arguments(parser)` and `main(args, cfg, console) -> exit code`."""

    name: str
    module: str
    help: str
    config: str = "required"  # the CONFIG argument: "required", "optional" (serve) or "none" (compare)
    # Library output goes to a log file through pipeline.console's router, as in `run`: the command's `main`
    # enters `console.command_log` once its arguments are checked; `--verbose` shows it live too.
    routed: bool = False


# A training stage's fixed cost: stage start -> its first optimizer step (ppo: its first iteration), held-out
# evaluations before it not counted (pipeline.events.StartupClock).
STARTUP = "start-up {startup_s:.1f}s"
PPO_OUTCOME = ("accuracy {eval_accuracy_before:.3f} -> {eval_accuracy:.3f} on {eval_prompts:.0f} held-out prompts "
               "(sign test p={eval_accuracy_sign_test_p:.3g})")


STAGES: tuple[StageSpec, ...] = (
    StageSpec("model", "stages.model", "model", ("seed", "task"), (), ("base_model",),
              "build the embedded base model + tokenizer, or check a local checkpoint",
              outcomes=("{num_parameters:,.0f} parameters",), ignores=("task.verifier",), presence="always"),
    StageSpec("data", "stages.data", "stages.data", ("seed", "task"), ("base_model",),
              ("sft_data", "preference_data", "prompt_data"),
              "Ray Data: validate, dedupe, template, tokenize, mask, split, write Parquet",
              outcomes=("{sft_train_rows:.0f} SFT rows", "{preference_train_rows:.0f} preference pairs",
                        "{prompts_train_rows:.0f} RL prompts"), ignores=("task.verifier",),
              settings="stages.data:DataConfig", presence="always", doc="The data stage (Ray Data)."),
    StageSpec("sft", "stages.sft", "stages.sft", ("seed", "task.verifier"), ("base_model", "sft_data", "prompt_data"),
              ("sft_model",),
              "Ray Train + DeepSpeed ZeRO: supervised fine-tuning on assistant tokens",
              outcomes=("eval loss {eval_loss:.3f}",
                        "accuracy {base_accuracy:.3f} -> {accuracy:.3f} on {accuracy_prompts:.0f} prompts", STARTUP),
              settings="stages.sft:SFTConfig", presence="default", view=True,
              doc="The sft stage (Ray Train + DeepSpeed); null: no SFT, RL (and the reward model) start from the "
                  "base model."),
    StageSpec("reward", "stages.reward", "stages.reward", ("seed", "task.preference"),
              ("base_model", "sft_model", "preference_data"),
              ("reward_model",), "Ray Train + DeepSpeed ZeRO: Bradley-Terry reward model on preference pairs",
              outcomes=("pairwise accuracy {eval_accuracy:.3f}", "against gold {eval_accuracy_gold:.3f}", STARTUP),
              settings="stages.reward:RewardConfig", presence="default", view=True,
              doc="The reward stage (Ray Train + DeepSpeed); null: no reward model (RL on a rule reward alone; "
                  "PPO's critic then starts from the SFT model)."),
    StageSpec("dpo", "stages.dpo", "stages.dpo", ("seed", "task.verifier"),
              ("base_model", "sft_model", "preference_data", "prompt_data"),
              ("dpo_model",),
              "Ray Train + DeepSpeed ZeRO: DPO / IPO / SimPO / KTO on the preference pairs, no reward model",
              outcomes=("implicit-reward accuracy {eval_reward_accuracy:.3f}",
                        "accuracy {eval_accuracy_before:.3f} -> {eval_accuracy:.3f} on {eval_prompts:.0f} held-out "
                        "prompts (sign test p={eval_accuracy_sign_test_p:.3g})", STARTUP),
              settings="stages.dpo:DPOConfig", view=True,
              doc="The dpo stage (Ray Train + DeepSpeed): DPO, IPO, SimPO or KTO on the preference pairs, no reward "
                  "model; empty: no such stage. Serve its model with stages.serve.source: dpo_model."),
    StageSpec("ppo", "stages.ppo", "stages.ppo", ("seed", "task.preference", "task.verifier"),
              ("sft_model", "reward_model", "prompt_data"),
              ("policy_model",), "vLLM rollout engines + DeepSpeed roles: PPO/GRPO on the reward, weights synced",
              outcomes=(PPO_OUTCOME, "gold win-rate {gold_winrate:.3f} against SFT (p={gold_winrate_p:.3g})",
                        # the eval_every curve, first point -> last (a template whose metrics are missing is left out)
                        "curve accuracy {curve_accuracy_first:.3f} -> {curve_accuracy_last:.3f}",
                        "reward {curve_reward_first:.3f} -> {curve_reward_last:.3f}, "
                        "length {curve_length_first:.1f} -> {curve_length_last:.1f}", STARTUP,
                        # failed calls of the user's code (shown only when there were any: the metrics exist then)
                        "reward errors {rule_errors_total:.0f}", "reward timeouts {rule_timeouts_total:.0f}",
                        "environment errors {env_errors_total:.0f}"),
              settings="stages.ppo:PPOConfig", presence="default", view=True,
              doc="The ppo stage (vLLM rollouts + DeepSpeed roles); null: no RL (serve takes the SFT model)."),
    # serve registers in the tracking server's model registry: another registry is another result.
    # `tracking_uri` is PipelineConfig's, without the password: another password is the same registry.
    StageSpec("serve", "stages.serve", "stages.serve", ("seed", "tracking_uri"), ("policy_model",), ("served_model",),
              "MLflow Model Registry + Ray Serve LLM: register the model, serve an OpenAI-compatible API",
              outcomes=("version {registered_version:.0f}", "p50 {smoke_latency_p50_s:.2f}s",
                        "{smoke_tokens_per_s:.0f} tokens/s"),
              settings="stages.serve:ServeConfig", presence="default", view=True,
              doc="The serve stage (MLflow Model Registry + Ray Serve LLM); null: no such stage (nothing is "
                  "registered or served; the serve and batch-infer commands still work, with this section's "
                  "defaults)."),
    # inputs: its source model, and the pipeline's prompts or reward model as configured (its `wire` hook)
    StageSpec("batch_infer", "stages.batch_infer", "stages.batch_infer", ("seed", "task.verifier"), (),
              ("predictions",),
              "Ray Data LLM: completions for a prompts dataset, scored, as Parquet",
              outcomes=("{rows:.0f} rows", "{rows_failed:.0f} failed"), settings="stages.batch_infer:BatchInferConfig",
              doc="The batch_infer stage (Ray Data LLM over a prompts dataset); empty: no such stage (the "
                  "batch-infer command still works)."),
    # reads, inputs and code: its target's (its `wire` hook); about: names the target
    StageSpec("tune", "stages.tune", "stages.tune", ("seed",), (), ("best_config",),
              "Ray Tune: sweep {target}'s config, "
              "every trial its real training, tracked in MLflow", outcomes=("{trials:.0f} trials",),
              settings="stages.tune:TuneConfig", doc="The tune stage (Ray Tune sweep over sft, reward, dpo or ppo); "
              "empty: no sweep. See docs/tune.md."),
)

# The top-level sections the stages share, composed into PipelineConfig after its own settings.
SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("model", "stages.common.models:ModelConfig", "Base model and tokenizer source."),
    SectionSpec("task", "stages.common.tasks:TaskConfig", "The generated task (data, rewards, accuracy)."),
)

# The CLI's commands that stages provide, after the framework's own (validate, plan, run, submit, ...).
COMMANDS: tuple[CommandSpec, ...] = (
    CommandSpec("serve", "stages.serve.command", "serve a registered model behind the OpenAI-compatible API until "
                "Ctrl-C (engine and endpoint from stages.serve)", config="optional", routed=True),
    CommandSpec("batch-infer", "stages.batch_infer", "generate completions for a prompts file with a "
                "registered model (settings from stages.batch_infer); Parquet results and a summary, tracked in MLflow",
                routed=True),
    CommandSpec("compare", "stages.compare", "two trained policies on the same held-out prompts: per metric the "
                "difference, prompts won and lost, and a paired sign test; logged to MLflow", config="none",
                routed=True),
)


def stages_for(cfg: Any, registry: tuple[StageSpec, ...] | None = None) -> tuple[StageSpec, ...]:
    """The stages of a pipeline config, in registry order: those whose section is not null, each as its
    `wire` hook places it in this pipeline (its inputs given the other stages present: without an sft stage,
    RL starts from the base model; a sweep reads what its target reads). A hook may also rewire a stage
    placed before it (a sweep's target with `use_tuned` consumes the sweep's `best_config`). `registry`: the
    stages the config was composed from (default: its class's, `pipeline.config.compose`)."""
    from pipeline.schema import get_path

    stages: tuple[StageSpec, ...] = ()
    for spec in registry or getattr(type(cfg), "registry", STAGES):
        if get_path(cfg, spec.config) is None:
            continue
        stages = load(spec.module).wire(spec, cfg, stages)
    return stages


# --------------------------------------------------------------------------- loading a stage and its hooks


def _no_raw_inputs(pipeline_cfg: Any) -> list[Path]:
    """Default `raw_inputs`: the stage reads no files from outside the run directory."""
    return []


def _cached_normally(cfg: Any) -> str | None:
    """Default `always_runs`: None, i.e. a finished artifact under the stage's key is reused."""
    return None


def _no_configured_code(cfg: Any) -> list[str]:
    """Default `configured_code`: the stage imports no module named by its config."""
    return []


def _nothing_to_check(pipeline_cfg: Any) -> None:
    """Default `check`: the stage's section needs nothing of the others."""


def _as_registered(spec: Any, pipeline_cfg: Any, stages: tuple) -> tuple:
    """Default `wire`: the stage takes the inputs the registry lists."""
    return (*stages, spec)


@dataclass(frozen=True)
class Stage:
    """A loaded stage module with both optional hooks filled in (this is the one place that looks them up).

    - `raw_inputs(pipeline_cfg)`: files outside the run directory the stage reads (user data, a
      local checkpoint); their fingerprints are part of its cache key, so editing one reruns it.
    - `always_runs(cfg)`: a reason to run even on a cache hit (e.g. serve with `block: true`, whose
      point is the running server), or None.
    - `configured_code(cfg)`: modules the stage imports at run time by a name in its config (a
      custom reward function); their code is part of its cache key like the stage's own.
    - `check(pipeline_cfg)`: the rules its section must keep with the rest of the config (a reward model
      to score with, enough CPUs on a local Ray), run when any config loads, whether the stage is
      configured or not; a ValueError naming the key and the fix becomes the config error.
    - `wire(spec, pipeline_cfg, stages)`: the pipeline's stages so far (registry order) with this one
      added as this pipeline needs it (its inputs given which stages are present); it may rewire one
      placed before it.
    """

    module: ModuleType
    run: Callable[[Any, Any], dict[str, Path]]  # run(cfg, ctx: pipeline.stage.StageContext)
    raw_inputs: Callable[[Any], list[Path]]
    always_runs: Callable[[Any], str | None]
    configured_code: Callable[[Any], list[str]]
    check: Callable[[Any], None]
    wire: Callable[[Any, Any, tuple], tuple]


def load(module_name: str) -> Stage:
    """The stage module `module_name` (e.g. 'stages.sft') as a `Stage`; a module without `run` is an error."""
    module = importlib.import_module(module_name)
    if not callable(getattr(module, "run", None)):
        raise TypeError(f"stage module {module_name} has no run(cfg, ctx) function")
    return Stage(module, module.run, getattr(module, "raw_inputs", _no_raw_inputs),
                 getattr(module, "always_runs", _cached_normally),
                 getattr(module, "configured_code", _no_configured_code),
                 getattr(module, "check", _nothing_to_check), getattr(module, "wire", _as_registered))


def import_path(path: str) -> Any:
    """The object a "module:name" path names (a stage's config class in the registry)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
