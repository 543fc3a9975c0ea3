"""One trial of a sweep (a Ray Tune worker): the target stage's real `run` with a `TrialContext`.

`_trial` applies the trial's sampled values to the target's config, validates it (a bad combination fails that
trial, not the sweep), opens the trial's nested MLflow run and calls the target stage's own `run(cfg, ctx)`.
`TrialContext` is the stage interface (`pipeline.stage.StageContext`) there: what the stage logs also reaches
Tune, with `step` (ASHA's time attribute). The sweep itself (searcher, scheduler, the results) is
`stages/tune/__init__.py`.
"""

from __future__ import annotations

import importlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import events

TIME_ATTR = "step"  # optimizer step (sft, reward) or PPO iteration: what ASHA's rungs count


@dataclass
class TrialContext:
    """The stage interface (`pipeline.stage.StageContext`) inside a trial: the target stage's run is
    the trial's nested MLflow run, and what it logs is also reported to Tune."""

    name: str
    pipeline: Any
    out_dir: Path
    checkpoint_dir: Path
    inputs: dict[str, Path]
    run_id: str
    storage: Any  # pipeline.run_storage.RunStorage
    experiment_id: str
    pipeline_run_id: str
    upstream: dict[str, dict] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    last_step: int = 0

    def mlflow_client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.pipeline.tracking_uri)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from ray import tune

        from pipeline.tracking import log_metrics

        self.metrics.update(metrics)
        self.last_step = max(self.last_step, step or 0)
        log_metrics(self.mlflow_client(), self.run_id, metrics, step)
        tune.report({**metrics, TIME_ATTR: step or 0})  # PPO's per-iteration results reach ASHA here

    def log_dict(self, data: Any, name: str) -> None:
        from pipeline.tracking import redact

        self.mlflow_client().log_dict(self.run_id, redact(data), name)

    def log_artifact(self, path: Path) -> None:
        self.mlflow_client().log_artifact(self.run_id, str(path))

    def set_tags(self, tags: dict[str, str], run_id: str | None = None) -> None:
        client = self.mlflow_client()
        for k, v in tags.items():
            client.set_tag(run_id or self.run_id, k, v)

    def progress(self, message: str) -> None:
        events.say(f"{self.name}: {message}")

    def advance(self, done: int, total: int | None, unit: str = "step", note: str = "") -> None:
        events.advance(self.name, done, total, unit, note)

    def ray(self) -> None:
        """A trial already runs inside Ray."""

    def train_callbacks(self) -> list:
        """Ray Train callbacks for a TorchTrainer started in this trial: rank 0's reports go to Tune."""
        from ray.tune.integration.ray_train import TuneReportCallback

        return [TuneReportCallback()]


def _trial(config: dict, setup: dict) -> None:
    """Run the target stage once with this trial's sampled values; report its end to Tune."""
    from mlflow.tracking import MlflowClient
    from ray import tune

    from pipeline.schema import flatten, with_values
    from pipeline.tracking import log_params

    pipeline = setup["pipeline"]  # the PipelineConfig itself (pickled by Tune): no import of pipeline.config here
    trial_id = tune.get_context().get_trial_id()
    client = MlflowClient(pipeline.tracking_uri)
    params = config["params"]
    run_id = client.create_run(setup["experiment_id"], run_name=f"{setup['target']} trial {trial_id}", tags={
        "mlflow.parentRunId": setup["parent_run_id"], "stage": f"tune:{setup['target']}", "tune_trial_id": trial_id,
        "tuned_params": json.dumps(params, default=str)}).info.run_id
    try:
        base = getattr(pipeline.stages, setup["target"])
        cfg = with_values(base, params, prefix=f"stages.{setup['target']}")
        log_params(client, run_id, flatten(cfg.model_dump(mode="json")))
        work = Path(setup["work_dir"]) / trial_id
        run_storage = setup["storage"]
        trial_ctx = TrialContext(f"{setup['target']} trial {trial_id}", pipeline, work / "out", work / "checkpoints",
                           {k: run_storage.localize(v) for k, v in setup["inputs"].items()}, run_id, run_storage,
                           setup["experiment_id"], setup["pipeline_run_id"], setup["upstream"])
        shutil.rmtree(trial_ctx.out_dir, ignore_errors=True)
        trial_ctx.out_dir.mkdir(parents=True)
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False  # trial logs are forwarded, not a terminal
        importlib.import_module(f"stages.{setup['target']}").run(cfg, trial_ctx)
        tune.report({**{k: v for k, v in trial_ctx.metrics.items() if isinstance(v, (int, float))},
                     TIME_ATTR: trial_ctx.last_step, "trial_completed": 1})
    except Exception as exc:
        client.set_tag(run_id, "trial_status", "failed")
        client.set_tag(run_id, "error", f"{type(exc).__name__}: {exc}"[:5000])
        client.set_terminated(run_id, "FAILED")
        raise
