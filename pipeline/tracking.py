"""MLflow lineage: one parent run per pipeline run, one nested run per stage (executed or cached).

Each stage run carries the stage's flattened config as params, its metrics, tags for the cache
key, hit/miss and code version, and its manifest as an artifact; the parent carries the resolved
config. Uses `MlflowClient` with explicit run ids rather than the fluent `mlflow.start_run` API,
so nothing depends on a global "active run" (stages may log from callbacks and other threads).

The default store is SQLite under the run directory, with artifacts beside it; any tracking
server URI works the same way (`mlflow server`, see README).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
BATCH = 100  # MLflow's limit on params per log_batch call


# scheme://user:password@host -> the password is never logged (a tracking server or object store
# URI can carry one); what the run needs stays in its own config, only what MLflow shows is redacted.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<secret>[^@/\s]+)@")


def redact(value: Any, mask: str | None = "***") -> Any:
    """`value` (a string, or dicts/lists of them) with the passwords of any URIs in it masked.

    `mask=None` drops the password instead (`https://user@host`): what a shipped config carries, so
    the reader authenticates from its own environment (MLFLOW_TRACKING_PASSWORD, ...) rather than
    sending the mask as a password."""
    if isinstance(value, str):
        return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}{'' if mask is None else ':' + mask}@", value)
    if isinstance(value, dict):
        return {k: redact(v, mask) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, mask) for v in value]
    return value


def redacted_keys(value: Any, prefix: str = "") -> list[str]:
    """Dotted keys of `value` (a config dump) whose strings carry a URI password."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in redacted_keys(v, f"{prefix}{key}.")]
    if isinstance(value, (list, tuple)):
        return [k for i, v in enumerate(value) for k in redacted_keys(v, f"{prefix}{i}.")]
    return [prefix.rstrip(".")] if isinstance(value, str) and _USERINFO.search(value) else []


def is_local_store(tracking_uri: str) -> bool:
    """A store that lives in files of the machine that opens it (SQLite, a file store, a bare path)."""
    scheme = tracking_uri.partition("://")[0].lower() if "://" in tracking_uri else ""
    return scheme in ("", "file") or scheme.startswith("sqlite")


def cluster_store_problem(tracking_uri: str, nodes: int) -> str | None:
    """Why `tracking_uri` cannot serve a run on `nodes` Ray nodes, or None.

    Training workers and tune trials log to the store from whatever node they run on: a SQLite
    file (or file store) is a different file on each node, or one file shared over a network
    filesystem, where SQLite's locking is not safe. A tracking server is one store for all."""
    if nodes <= 1 or not is_local_store(tracking_uri):
        return None
    return (f"mlflow.tracking_uri: the Ray cluster has {nodes} nodes and the tracking store is a local file "
            f"({redact(tracking_uri)}), which workers on other nodes cannot share; run a tracking server "
            "(`mlflow server --host 0.0.0.0 --port 5000 --backend-store-uri sqlite:///mlflow.db`) and set "
            "mlflow.tracking_uri: http://HOST:5000")


def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    """Params in batches within MLflow's limits (100 per call, 6000 characters per value), redacted."""
    from mlflow.entities import Param

    items = [Param(k, redact(str(v))[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
    for i in range(0, len(items), BATCH):
        client.log_batch(run_id, params=items[i : i + BATCH])


def log_metrics(client, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
    """Metrics at one step, in batches of MLflow's 1000-per-call limit."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
    for i in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[i : i + 1000])


def check_reachable(tracking_uri: str, timeout: float = 5.0) -> None:
    """Fail fast on an unreachable tracking server (MLflow's client would retry for minutes)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout)
    except (urllib.error.URLError, OSError) as exc:
        from pipeline.errors import UserError

        raise UserError(f"mlflow.tracking_uri: cannot reach {tracking_uri} ({getattr(exc, 'reason', exc)}); start "
                        "the server (`mlflow server --host 127.0.0.1 --port 5000`) or leave it empty for the "
                        "local SQLite store") from None


# MLflow 3's UI opens an experiment without this tag in its GenAI view (traces, "Evaluations");
# a model-training experiment opens on the runs table, where stages and runs compare.
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."  # + key: a runs-table view the UI opens with ?viewStateShareKey=key


def share_runs_view(client, experiment_id: str, metric_columns: list[str]) -> str:
    """Store the experiment's runs-table view for the UI and return its key.

    MLflow's UI (3.17) shows only the Source, Models and Dataset columns and keeps stage runs
    folded under their parent unless a person picks columns and expands each run by hand; a view
    shared through an experiment tag can set the columns and the order, not the expansion. Runs
    sorted by end time (latest first) are listed flat - the UI nests child runs only when sorted
    by start time - so each pipeline run is followed by its stages, each with its headline metrics."""
    state = {"orderByKey": "attributes.end_time", "orderByAsc": False, "searchFilter": "",
             "selectedColumns": ["attributes.`Source`", "attributes.`Models`", "attributes.`Dataset`",
                                 *(f"metrics.`{m}`" for m in metric_columns)]}
    value = json.dumps(state, separators=(",", ":"))
    key = "pipeline-" + hashlib.sha256(value.encode()).hexdigest()[:12]
    client.set_experiment_tag(experiment_id, SHARED_VIEW_PREFIX + key, value)
    return key


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str, run_dir: Path, run_name: str, tags: dict[str, str]):
        from mlflow.tracking import MlflowClient

        check_reachable(tracking_uri)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            # A local store keeps artifacts beside it; a server decides for itself (mlflow-artifacts:/).
            location = (run_dir / "mlartifacts").as_uri() if is_local_store(tracking_uri) else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location,
                                                               tags={EXPERIMENT_KIND: MODEL_TRAINING})
        else:
            self.experiment_id = exp.experiment_id
            if EXPERIMENT_KIND not in exp.tags:  # made by an older version: MLflow guessed it was GenAI
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        self.parent_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id

    def start_stage(self, stage: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        run = self.client.create_run(
            self.experiment_id, run_name=stage, tags={"mlflow.parentRunId": self.parent_id, "stage": stage, **tags}
        )
        log_params(self.client, run.info.run_id, params)
        return run.info.run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
        log_metrics(self.client, run_id, metrics, step)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, v)

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_dict(self, run_id: str, data: Any, name: str) -> None:
        self.client.log_dict(run_id, redact(data), name)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)
