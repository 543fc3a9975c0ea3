"""MLflow lineage of the stage runs (pipeline/lineage.py): the data a run read is a dataset input, a model it
trained is a logged model (one per output and cache key), linked as an output of every run that yields it and as
an input of the runs that read it."""

from __future__ import annotations


def test_stage_runs_carry_their_datasets_and_models_as_mlflow_lineage(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline import lineage

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    data_dir, sft_dir = tmp_path / "artifacts" / "data" / "d4t4", tmp_path / "artifacts" / "sft" / "5f7"
    sft_run, cached_run, reward_run = (client.create_run(exp).info.run_id for _ in range(3))
    lineage.record(client, exp, sft_run, "sft", "5f7", {"sft_data": (data_dir, "d4t4"), "base_model": (data_dir, "m0")},
                   {"sft_model": sft_dir / "model"})
    lineage.record(client, exp, cached_run, "sft", "5f7", {"sft_data": (data_dir, "d4t4")},
                   {"sft_model": sft_dir / "model"})
    lineage.record(client, exp, reward_run, "reward", "r3w", {"sft_model": (sft_dir, "5f7")}, {})

    inputs = client.get_run(sft_run).inputs
    assert [(d.dataset.name, d.dataset.digest, d.dataset.source) for d in inputs.dataset_inputs] == [
        ("sft_data", "d4t4", f'{{"uri": "{data_dir}"}}')]
    models = client.search_logged_models([exp])
    assert [(m.name, m.tags["cache_key"], m.source_run_id) for m in models] == [("sft_model", "5f7", sft_run)]
    # A cached rerun yields the same model (no second one); the reward run reads it.
    assert client.get_run(cached_run).outputs.model_outputs[0].model_id == models[0].model_id
    assert [m.model_id for m in client.get_run(reward_run).inputs.model_inputs] == [models[0].model_id]
