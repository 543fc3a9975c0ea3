"""The stage interface: what a stage module provides, and what it may use of the pipeline.

A stage is a module (`stages/<name>.py`, or a package such as `stages/ppo/`) that the registry
(`pipeline/registry.py`, which also loads it: `registry.load`) names. It provides

    run(cfg: <its config section>, ctx: StageContext) -> dict[str, Path]    # required
    raw_inputs(pipeline_cfg: PipelineConfig) -> list[Path]                    # optional hook
    always_runs(cfg: <its config section>) -> str | None                      # optional hook
    configured_code(cfg: <its config section>) -> list[str]                  # optional hook
    check(pipeline_cfg: PipelineConfig) -> None                               # optional hook
    wire(spec, pipeline_cfg, stages) -> stages                                # optional hook

`run` writes its outputs under `ctx.out_dir` and returns {output name: path} for every output
the registry lists. It talks to the rest of the system only through `ctx`: its inputs, its
directories, the run-wide storage (to hand to the workers it starts), logging and Ray.

Two contexts implement `StageContext`: the runner's (`pipeline.runner.RunContext`, one per
stage run, logging to the stage's nested MLflow run) and a sweep trial's
(`stages.tune.TrialContext`, which runs a target stage's `run` inside a Ray Tune trial and also
reports to Tune). A stage cannot tell them apart, which is why a sweep runs the real training.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from pipeline.config import PipelineConfig
    from pipeline.run_storage import RunStorage


class StageContext(Protocol):
    """What a stage sees of the pipeline while it runs."""

    name: str  # the stage's name (a trial's: "sft trial <id>"), for progress lines
    pipeline: PipelineConfig  # the whole validated config; read only the sections the registry lists
    out_dir: Path  # an empty directory for this run's outputs (the artifact, once a manifest is written)
    checkpoint_dir: Path  # survives a failed attempt: resume state goes here, keyed like the artifact
    inputs: dict[str, Path]  # {input artifact name: path}, e.g. {"sft_model": .../model}
    upstream: dict[str, dict]  # {input artifact name: manifest of the stage that made it}
    storage: RunStorage  # run_dir and the bucket of record; pass it to every worker the stage starts
    run_id: str  # this stage's MLflow run
    metrics: dict[str, float]  # every metric logged so far (the manifest keeps them)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record metrics on the stage's MLflow run (and, in a trial, report them to Tune)."""

    def log_dict(self, data: Any, name: str) -> None:
        """Attach a JSON document (e.g. the effective DeepSpeed config) to the stage's MLflow run."""

    def log_artifact(self, path: Path) -> None:
        """Attach a file to the stage's MLflow run."""

    def set_tags(self, tags: dict[str, str], run_id: str | None = None) -> None:
        """Tag the stage's MLflow run, or one of its nested runs (a sweep's trials)."""

    def mlflow_client(self) -> MlflowClient:
        """The MLflow client of this run's tracking store, for what the named methods do not cover
        (registering a model, searching a sweep's trial runs)."""

    @property
    def experiment_id(self) -> str:
        """The MLflow experiment the stage's run belongs to."""

    @property
    def pipeline_run_id(self) -> str:
        """The MLflow run of the whole pipeline run (the stage run's parent)."""

    def progress(self, message: str) -> None:
        """One progress line for the person watching."""

    def advance(self, done: int, total: int | None, unit: str = "step", note: str = "") -> None:
        """Progress of the stage's long phase: `done` of `total` units (a live bar with rate and ETA on a
        terminal, periodic lines in logs). Workers report theirs with `pipeline.events.advance`."""

    def ray(self) -> None:
        """Connect to Ray (started on first use; a fully cached rerun never starts it)."""

    def train_callbacks(self) -> list:
        """Extra Ray Train callbacks for the stage's TorchTrainer (a trial adds Tune's reporter)."""
