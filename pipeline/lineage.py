"""Lineage in MLflow's own terms, so the runs table's Dataset and Models columns show where each
result came from without opening a manifest:

- the data stage's outputs (`*_data`) are MLflow dataset inputs of the stage runs that read them,
  named after the output, their source the artifact's path and their digest its cache key (the
  key fixes the content: the same key is the same files);
- trained models (`*_model` outputs but the serve stage's record) are MLflow logged models, one
  per output and cache key, made by the first run that produced them and linked as an output of
  every run (executed or cached) that yields them, and as a model input of the runs that read them.
"""

from __future__ import annotations

from pathlib import Path


def is_dataset(name: str) -> bool:
    return name.endswith("_data")


def is_model(name: str) -> bool:
    return name.endswith("_model") and name != "served_model"  # served_model is a registry record


def _logged_model(client, experiment_id: str, name: str, key: str):
    found = client.search_logged_models([experiment_id], filter_string=f"name = '{name}' AND tags.cache_key = '{key}'",
                                        max_results=1)
    return found[0] if found else None


def record(client, experiment_id: str, run_id: str, stage: str, key: str,
           inputs: dict[str, tuple[Path, str]], outputs: dict[str, Path]) -> None:
    """Link a stage run to what it read (`inputs`: name -> (path, producer's cache key)) and made."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag, LoggedModelInput, LoggedModelOutput, LoggedModelStatus

    datasets = [DatasetInput(MetaDataset(resolve_dataset_source(str(path)), name=name, digest=ikey)._to_mlflow_entity(),
                             tags=[InputTag("mlflow.data.context", stage)])
                for name, (path, ikey) in sorted(inputs.items()) if is_dataset(name)]
    models = [LoggedModelInput(m.model_id) for name, (_, ikey) in sorted(inputs.items()) if is_model(name)
              for m in [_logged_model(client, experiment_id, name, ikey)] if m is not None]
    if datasets or models:
        client.log_inputs(run_id, datasets=datasets, models=models)
    for name, path in sorted(outputs.items()):
        if not is_model(name):
            continue
        model = _logged_model(client, experiment_id, name, key)
        if model is None:
            model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id,
                                               tags={"cache_key": key, "stage": stage, "path": str(path)})
            client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
