"""Tune stage: a Ray Tune sweep over one training stage, each trial running that stage's real code.

    stages:
      tune:
        target: sft                                   # sft, reward, dpo or ppo
        search_space:
          lr: {loguniform: [1.0e-4, 1.0e-2]}          # keys are field paths of stages.sft
          deepspeed.zero_stage: {choice: [0, 2]}
        num_samples: 4
        metric: eval_loss
        mode: min
        scheduler: {type: asha, grace_period: 4, reduction_factor: 2}
      sft:
        use_tuned: true                               # train with the sweep's best values

How it works: `Tuner` runs `_trial` (stages/tune/trial.py) once per sampled configuration. A trial applies its sampled
values to the target's config, validates it (a bad combination fails that trial, not the sweep)
and calls the target stage's own `run(cfg, ctx)` with a `TrialContext` instead of the runner's
context: same inputs (the artifacts the target stage would use), its own scratch directory. For
sft/reward that is a `TorchTrainer` inside the trial whose rank-0 reports reach Tune through
`TuneReportCallback` (docs/architecture.md, fact 10); PPO reports every iteration through `ctx.log_metrics`.
Reports carry `step` (optimizer step, or PPO iteration), ASHA's time attribute, so ASHA stops
poor trials at its rungs while they train.

MLflow: every trial is a nested run under this stage's run, with the target's effective config as
params and its metric history (rank 0 and the trial log straight into it). When the sweep ends,
the driver gives every trial run its final status (`completed`, `stopped_early` by the scheduler,
or `failed` with the error) and tags the best one. The sweep fails only when every trial failed.

Outputs: `best_config.json` (the best trial's sampled values, its metric and MLflow run id) and
`results.csv` (one row per trial). A target with `use_tuned: true` takes those values; the
runner keys it on the values themselves, so it reruns exactly when the sweep's outcome changes.

Run alone: `python -m pipeline run CONFIG --only tune` (after the target's upstream stages).
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipeline import events
from pipeline.schema import Section
from stages.tune.trial import TIME_ATTR, TrialContext, _trial  # noqa: F401  (TrialContext: the stage interface in a trial)

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext

TARGETS = ("sft", "reward", "dpo", "ppo")
# What each target reports (to Tune and MLflow); a sweep's metric must be one of these.
TARGET_METRICS = {
    "sft": ("eval_loss", "train_loss", "accuracy"),
    "reward": ("eval_loss", "eval_accuracy", "eval_margin", "train_loss", "train_accuracy"),
    "dpo": ("eval_loss", "eval_reward_accuracy", "eval_reward_margin", "train_loss", "train_reward_accuracy",
            "eval_accuracy", "eval_sampled_accuracy"),
    "ppo": ("reward_mean", "rule_reward_mean", "kl", "response_length", "eval_accuracy", "eval_reward",
            "eval_sampled_accuracy", "eval_sampled_reward", "distill_reverse_kl"),
}
SEARCH_ALGS = {"random": None, "optuna": "optuna", "hyperopt": "hyperopt"}  # name -> package it needs


class Dimension(Section):
    """One search-space dimension: exactly one of the four keys."""

    uniform: tuple[float, float] | None = Field(None, description="[low, high]: a float drawn uniformly.")
    loguniform: tuple[float, float] | None = Field(None, description="[low, high], low > 0: a float drawn uniformly in "
                                                                     "log space.")
    choice: list[Any] | None = Field(None, description="Values drawn at random, one per trial.")
    grid: list[Any] | None = Field(None, description="Every value is tried (times num_samples); random search only.")

    @model_validator(mode="after")
    def _one_kind(self) -> "Dimension":
        given = [k for k in ("uniform", "loguniform", "choice", "grid") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of uniform, loguniform, choice, grid (got "
                             f"{', '.join(given) or 'none'})")
        kind, value = given[0], getattr(self, given[0])
        if kind in ("choice", "grid") and not value:
            raise ValueError(f"{kind} is empty; list at least one value, e.g. {kind}: [1.0e-3, 3.0e-3]")
        if kind in ("uniform", "loguniform") and not value[0] < value[1]:
            raise ValueError(f"{kind}: low must be below high, got {list(value)}")
        if kind == "loguniform" and value[0] <= 0:
            raise ValueError(f"loguniform: low must be > 0, got {value[0]}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("uniform", "loguniform", "choice", "grid") if getattr(self, k) is not None)

    def candidates(self) -> list[Any]:
        """Values whose validity can be checked before the sweep: every listed value, or the bounds."""
        return list(getattr(self, self.kind))


class SchedulerConfig(Section):
    """The trial scheduler."""

    type: Literal["asha", "fifo"] = Field("asha", description="'asha': stop poor trials at rungs; 'fifo': run every "
                                                              "trial to the end.")
    grace_period: int = Field(4, ge=1,
                              description="ASHA: steps (PPO: iterations) a trial runs before it can be stopped.")
    reduction_factor: float = Field(2.0, gt=1,
                                    description="ASHA: keep the best 1/reduction_factor of trials at each rung.")
    max_t: int | None = Field(None, ge=1,
                              description="ASHA: steps after which a trial is stopped regardless (empty: no limit).")


class ResourcesConfig(Section):
    """Resources of each trial's driver. Train workers, PPO roles and engines reserve their own."""

    cpu: float = Field(1.0, ge=0, description="Logical CPUs of the trial driver process.")
    gpu: float = Field(0.0, ge=0, description="GPUs of the trial driver process (the target's workers get theirs).")


class TuneConfig(Section):
    """The tune stage: a Ray Tune sweep over a training stage's config fields."""

    target: Literal["sft", "reward", "dpo", "ppo"] = Field("sft", description="The training stage to sweep.")
    search_space: dict[str, Dimension] = Field(
        ..., min_length=1, description="Field path of the target's config (e.g. 'lr', 'deepspeed.zero_stage', "
        "'policy.lr') -> {uniform|loguniform|choice|grid: ...}.")
    num_samples: int = Field(4, ge=1, description="Trials to sample (with grid dimensions: repeats of the whole grid).")
    metric: str = Field("eval_loss",
                        description="Reported metric that ranks trials (docs/tune.md lists each target's).")
    mode: Literal["min", "max"] = Field("min", description="Whether a lower or higher metric is better.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Early stopping of poor trials.")
    search_alg: Literal["random", "optuna", "hyperopt"] = Field(
        "random", description="'random' (also runs grids; seeded by `seed`); 'optuna'/'hyperopt' need their package.")
    max_concurrent_trials: int = Field(
        1, ge=1, description="Trials running at once. Each holds its driver's resources plus the target's workers.")
    resources_per_trial: ResourcesConfig = Field(default_factory=ResourcesConfig,
                                                 description="Each trial driver's resources.")

    @field_validator("search_space", mode="before")
    @classmethod
    def _flatten(cls, value: Any) -> Any:
        """Nested keys mean the same as dotted ones: {deepspeed: {zero_stage: ...}} is 'deepspeed.zero_stage'."""
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for key, dim in value.items():
            if isinstance(dim, dict) and dim and not set(dim) & set(Dimension.model_fields):
                out.update({f"{key}.{k}": v for k, v in cls._flatten(dim).items()})
            else:
                out[str(key)] = dim
        return out

    @field_validator("metric")
    @classmethod
    def _reported(cls, metric: str, info: ValidationInfo) -> str:
        target = info.data.get("target")
        if target and metric not in TARGET_METRICS[target]:
            raise ValueError(f"{target} does not report {metric!r}; use one of {', '.join(TARGET_METRICS[target])}")
        return metric

    @model_validator(mode="after")
    def _coherent(self) -> "TuneConfig":
        package = SEARCH_ALGS[self.search_alg]
        if package:
            import importlib.util

            if importlib.util.find_spec(package) is None:
                raise ValueError(f"search_alg: {self.search_alg!r} needs the {package} package; `pip install "
                                 f"{package}` "
                                 "or use search_alg: random")
            grids = [k for k, d in self.search_space.items() if d.kind == "grid"]
            if grids:
                raise ValueError(f"search_space.{grids[0]}: grid works with search_alg: random only; use choice")
        return self


# --------------------------------------------------------------------------- pure helpers


def tune_space(space: dict[str, Dimension]) -> dict[str, Any]:
    """The YAML search space as Ray Tune domains, keyed by field path."""
    from ray import tune

    make = {"uniform": lambda v: tune.uniform(*v), "loguniform": lambda v: tune.loguniform(*v),
            "choice": tune.choice, "grid": tune.grid_search}
    return {path: make[d.kind](getattr(d, d.kind)) for path, d in space.items()}


def trial_status(metrics: dict | None, error: Any) -> str:
    """'failed' (raised), 'completed' (reported its end) or 'stopped_early' (the scheduler ended it)."""
    if error is not None:
        return "failed"
    return "completed" if (metrics or {}).get("trial_completed") else "stopped_early"


def best_trial(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The row with the best last-reported metric (Tune's scope='last'); None if no trial reported it."""
    scored = [r for r in rows if isinstance(r.get(metric), (int, float)) and r[metric] == r[metric]]
    if not scored:
        return None
    return (min if mode == "min" else max)(scored, key=lambda r: r[metric])


# --------------------------------------------------------------------------- the driver


def trial_count(cfg: TuneConfig) -> int:
    """Trials the sweep runs: `num_samples` times the size of the grid (Tune repeats the whole grid
    `num_samples` times; a sweep without grid dimensions is `num_samples` trials)."""
    return cfg.num_samples * math.prod(len(d.grid) for d in cfg.search_space.values() if d.grid is not None)


def _progress_callback(metric: str, mode: str, trials: int):
    """A Tune callback reporting the sweep (Tune's own tables are off): trials finished out of
    `trials` as progress, and one line per failed trial.

    Built on call so that importing this module does not import Ray; it holds plain values only
    because Tune pickles its run config.
    """
    from ray.tune import Callback

    class Progress(Callback):
        def __init__(self):
            self.ended, self.best = 0, None

        def _advance(self, trial, what: str) -> None:
            self.ended += 1
            best = "" if self.best is None else f", best {metric} {self.best:.4g}"
            events.advance("tune", self.ended, trials, "trial", f"{trial.trial_id} {what}{best}")

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if isinstance(result.get(metric), (int, float)):
                self.best = result[metric] if self.best is None else \
                    (min if mode == "min" else max)(self.best, result[metric])

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._advance(trial, "ended")

        def on_trial_error(self, iteration, trials, trial, **info):
            events.say(f"tune: trial {trial.trial_id} failed")
            self._advance(trial, "failed")

    return Progress()


def _searcher(cfg: TuneConfig, seed: int):
    if cfg.search_alg == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=seed)
    if cfg.search_alg == "hyperopt":
        from ray.tune.search.hyperopt import HyperOptSearch

        return HyperOptSearch(random_state_seed=seed)
    from ray.tune.search import BasicVariantGenerator

    # Seeded: an unchanged sweep samples the same trials. It enforces the concurrency limit itself
    # (Tune's max_concurrent_trials only wraps `Searcher`s, not this generator).
    return BasicVariantGenerator(random_state=seed, max_concurrent=cfg.max_concurrent_trials)


def _scheduler(cfg: TuneConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if cfg.scheduler.type == "fifo":
        return FIFOScheduler()
    return ASHAScheduler(time_attr=TIME_ATTR, grace_period=cfg.scheduler.grace_period,
                         reduction_factor=cfg.scheduler.reduction_factor, max_t=cfg.scheduler.max_t or 10**9)


def _trial_runs(ctx) -> dict[str, Any]:
    """{Tune trial id: MLflow run} of this stage's nested trial runs."""
    runs = ctx.mlflow_client().search_runs([ctx.experiment_id],
                                           filter_string=f"tags.mlflow.parentRunId = '{ctx.run_id}'", max_results=10000)
    return {r.data.tags["tune_trial_id"]: r for r in runs if "tune_trial_id" in r.data.tags}


def last_reported(metrics: dict, history, metric: str):
    """The trial's last value of `metric`. A trial's final report may lack it (a checkpoint-only report
    sent just before ASHA's stop lands), so fall back to the last non-empty entry of its history."""
    if metrics.get(metric) is not None:
        return metrics[metric]
    if history is None or metric not in getattr(history, "columns", ()):
        return None
    values = history[metric].dropna()
    return None if values.empty else float(values.iloc[-1])


def _finalise(ctx, grid, cfg: TuneConfig) -> list[dict]:
    """One row per trial; every trial's MLflow run ends with its status (trials never see their stop)."""
    runs, rows = _trial_runs(ctx), []
    for result in grid:
        trial_id = Path(result.path).name  # trial_dirname_creator names each trial's directory by its id
        metrics = result.metrics or {}
        value = last_reported(metrics, result.metrics_dataframe, cfg.metric)
        run = runs.get(trial_id)
        status = trial_status(metrics, result.error)
        params = (result.config or {}).get("params", {})
        row = {"trial_id": trial_id, "status": status, **{f"param.{k}": v for k, v in params.items()},
               TIME_ATTR: metrics.get(TIME_ATTR), cfg.metric: value,
               "mlflow_run_id": run.info.run_id if run else None,
               "error": f"{type(result.error).__name__}: {result.error}"[:500] if result.error else ""}
        rows.append(row)
        if run is None:
            continue
        ctx.set_tags({"trial_status": status}, run.info.run_id)
        if status != "failed":  # a failed trial ended its own run, with the error
            ctx.mlflow_client().set_terminated(run.info.run_id, "FINISHED" if status == "completed" else "KILLED")
    return sorted(rows, key=lambda r: str(r["trial_id"]))


def _write_results(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def check(pipeline_cfg) -> None:
    """The stage's `check` hook: a target that is there, `use_tuned` only on a sweep's target, a search space of
    the target's settable fields whose every value the target accepts, and a local Ray that fits the trials."""
    from pipeline.schema import leaf_problem, with_values

    stages, tune = pipeline_cfg.stages, pipeline_cfg.stages.tune
    if tune is not None and getattr(stages, tune.target) is None:
        raise ValueError(f"stages.tune.target is {tune.target} but stages.{tune.target} is null")
    for name in TARGETS:
        section = getattr(stages, name)
        if section is not None and section.use_tuned and (tune is None or tune.target != name):
            raise ValueError(f"stages.{name}.use_tuned: there is no sweep over {name} to take values from; add "
                             f"stages.tune with target: {name}, or set use_tuned: false")
    if tune is None:
        return
    target = getattr(stages, tune.target)
    for path, dim in tune.search_space.items():
        key = f"stages.tune.search_space.{path}"
        problem = leaf_problem(type(target), path, f"stages.{tune.target}")
        if problem:
            raise ValueError(f"{key}: {problem}")
        for value in dim.candidates():  # every listed value (or both bounds) must be valid for the target
            try:
                with_values(target, {path: value}, prefix=f"stages.{tune.target}")
            except ValueError as exc:
                raise ValueError(f"{key}: {dim.kind} value {value!r} is invalid for stages.{tune.target}: "
                                 f"{exc}") from None
    have = pipeline_cfg.ray.local_cpus()
    per_trial = tune.resources_per_trial.cpu + (target.cpus_needed() if tune.target == "ppo" else target.num_workers)
    if have is not None and per_trial * tune.max_concurrent_trials > have:
        raise ValueError(f"stages.tune.max_concurrent_trials: {tune.max_concurrent_trials} trials of "
                         f"{tune.target} need {per_trial:g} logical CPUs each (driver + workers), "
                         f"{per_trial * tune.max_concurrent_trials:g} in all, but the local Ray has {have} "
                         "(ray.num_cpus); run fewer trials at once or raise ray.num_cpus")


def wire(spec, pipeline_cfg, stages: tuple) -> tuple:
    """The stage's `wire` hook: the sweep reads what its target reads (it runs the target's code on the same
    artifacts) and the target's section; a target with `use_tuned: true` also consumes the sweep's
    `best_config`, which places the sweep before it."""
    from dataclasses import replace

    name = pipeline_cfg.stages.tune.target
    target = next(s for s in stages if s.name == name)
    sweep = replace(spec, reads=(*spec.reads, target.config), inputs=target.inputs, code=(target.module,),
                    about=spec.about.format(target=name))
    uses = getattr(pipeline_cfg.stages, name).use_tuned
    return (*(replace(s, inputs=(*s.inputs, "best_config")) if s is target and uses else s for s in stages), sweep)


def raw_inputs(pcfg) -> list[Path]:
    """What the target reads besides its artifacts (a ppo teacher's files): the sweep reruns when they change,
    as the target itself would."""
    tune = pcfg.stages.tune
    hook = getattr(importlib.import_module(f"stages.{tune.target}"), "raw_inputs", None) if tune else None
    return hook(pcfg) if hook else []


def run(cfg: TuneConfig, ctx: StageContext) -> dict[str, Path]:
    """Sweep the target stage with Ray Tune; write the best trial's values and a results table."""
    from ray import tune

    from pipeline.errors import UserError

    ctx.ray()
    work = ctx.checkpoint_dir / "trials"
    tune_storage, tune_fs = ctx.storage.target(ctx.checkpoint_dir / "tune")
    setup = {"target": cfg.target, "pipeline": ctx.pipeline,
             "inputs": {k: str(v) for k, v in ctx.inputs.items()}, "work_dir": str(work),
             "experiment_id": ctx.experiment_id, "parent_run_id": ctx.run_id,
             "pipeline_run_id": ctx.pipeline_run_id, "upstream": ctx.upstream, "storage": ctx.storage}
    trainable = tune.with_resources(tune.with_parameters(_trial, setup=setup),
                                    {"cpu": cfg.resources_per_trial.cpu, "gpu": cfg.resources_per_trial.gpu})
    ctx.progress(f"sweeping {cfg.target} over {', '.join(cfg.search_space)}: {trial_count(cfg)} trials, "
                 f"{cfg.scheduler.type} scheduler, {cfg.max_concurrent_trials} at a time, ranked by {cfg.metric} "
                 f"({cfg.mode})")
    t0 = time.time()
    # Not every report carries the metric (checkpoint-only reports; sft's accuracy comes at the end):
    # ASHA skips those, but Tune's strict check would fail the sweep. A metric no trial reports at
    # all is caught below instead.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    tuner = tune.Tuner(
        trainable,
        param_space={"params": tune_space(cfg.search_space)},
        tune_config=tune.TuneConfig(metric=cfg.metric, mode=cfg.mode, num_samples=cfg.num_samples,
                                    scheduler=_scheduler(cfg), search_alg=_searcher(cfg, ctx.pipeline.seed),
                                    # the random searcher limits itself (see _searcher)
                                    max_concurrent_trials=None if cfg.search_alg == "random"
                                    else cfg.max_concurrent_trials,
                                    trial_dirname_creator=lambda trial: trial.trial_id),
        # With an object store, Tune's experiment state lives in the bucket like every checkpoint.
        run_config=tune.RunConfig(name="sweep", storage_path=tune_storage, storage_filesystem=tune_fs, verbose=0,
                                  callbacks=[_progress_callback(cfg.metric, cfg.mode, trial_count(cfg))]),
    )
    try:
        grid = tuner.fit()
    except BaseException:  # interrupted (Ctrl-C, SIGTERM) or Tune itself failed: no trial run stays RUNNING
        for run in _trial_runs(ctx).values():
            if run.info.status == "RUNNING":
                ctx.mlflow_client().set_terminated(run.info.run_id, "KILLED")
        raise
    rows = _finalise(ctx, grid, cfg)
    _write_results(ctx.out_dir / "results.csv", rows)
    ctx.log_artifact(ctx.out_dir / "results.csv")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("completed", "stopped_early", "failed")}
    for r in rows:
        value = r[cfg.metric]
        shown = f"{value:.4g}" if isinstance(value, (int, float)) else "not reported"
        sampled = ", ".join(f"{k.removeprefix('param.')}={v}" for k, v in r.items() if k.startswith("param."))
        ctx.progress(f"trial {r['trial_id']} ({sampled}): {r['status']} at step {r[TIME_ATTR]}, {cfg.metric} {shown}"
                     + (f" ({r['error']})" if r["error"] else ""))
    if counts["failed"] == len(rows):
        raise RuntimeError(f"every one of the {len(rows)} trials failed; the first error: {rows[0]['error']} "
                           f"(trial logs under {ctx.checkpoint_dir / 'tune'})")
    best = best_trial([r for r in rows if r["status"] != "failed"], cfg.metric, cfg.mode)
    if best is None:
        raise UserError(f"stages.tune.metric: no trial reported {cfg.metric!r}; pick a metric the {cfg.target} "
                        f"stage reports at its evaluations: {', '.join(TARGET_METRICS[cfg.target])}")
    params = {k.removeprefix("param."): v for k, v in best.items() if k.startswith("param.")}
    best_config = {"target": cfg.target, "params": params, "metric": cfg.metric, "mode": cfg.mode,
                   "value": best[cfg.metric], "trial_id": best["trial_id"], "mlflow_run_id": best["mlflow_run_id"]}
    (ctx.out_dir / "best_config.json").write_text(json.dumps(best_config, indent=2, default=str))
    if best["mlflow_run_id"]:
        ctx.set_tags({"best_trial": "true"}, best["mlflow_run_id"])
    ctx.set_tags({"best_trial_run_id": str(best["mlflow_run_id"]),
                  "best_params": json.dumps(params, default=str)})
    ctx.log_metrics({f"best_{cfg.metric}": best[cfg.metric], "trials": len(rows), "sweep_s": time.time() - t0,
                     **{f"trials_{k}": v for k, v in counts.items()}})
    ctx.progress(f"best trial {best['trial_id']}: {cfg.metric} {best[cfg.metric]:.4g} with {params} "
                 f"({counts['completed']} completed, {counts['stopped_early']} stopped early, {counts['failed']} "
                 f"failed, "
                 f"{time.time() - t0:.0f}s)")
    shutil.rmtree(work, ignore_errors=True)  # trial models and checkpoints: only the chosen values are kept
    ctx.storage.drop_path(work)  # (and their copies in the object store, if any)
    return {"best_config": ctx.out_dir / "best_config.json"}
