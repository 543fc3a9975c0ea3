"""The sft stage on Ray Train + DeepSpeed (2 CPU workers, smoke-sized model and data).

`test_sft_learns_and_exports_a_loadable_model` checks the session's shared trained run; the ZeRO
comparison trains two runs of its own, the ZeRO-3 one interrupted and resumed. All train for real (slow).
The batches every training rank reads (`stages.common.training.rank_batches`) are checked against Ray Data
on the session's Ray (fast)."""

from __future__ import annotations

import numpy as np
import pytest
from rich.console import Console

from conftest import SMOKE, TRAINED, smoke_config
from pipeline import storage
from pipeline.runner import run_pipeline

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 3, "ray": 3, "train_groups": 3, "vllm_engines": 3}

FAST = list(TRAINED)  # the shared trained run's SFT settings: its ZeRO-2 run is a cache hit here


def run_sft(run_dir, tracking_uri, *overrides):
    """Run model + data + sft; return (sft manifest, sft MLflow run id, model dir)."""
    cfg = smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", *FAST, *overrides)
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True), to="sft")
    manifest = summary["stages"]["sft"]
    out = storage.output_paths(manifest, storage.artifact_dir(cfg.run_dir, "sft", manifest["key"]))
    return manifest, summary["run_ids"]["sft"], out["sft_model"]


def history(tracking_uri, run_id, key) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri).get_metric_history(run_id, key)}


def weights(model_dir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _trained_sft(smoke_trained):
    """(manifest, MLflow run id, model dir) of the shared trained run's SFT (ZeRO-2, smoke's default)."""
    summary = smoke_trained.summary
    manifest = summary["stages"]["sft"]
    out = storage.output_paths(manifest, storage.artifact_dir(smoke_trained.run_dir, "sft", manifest["key"]))
    return manifest, summary["run_ids"]["sft"], out["sft_model"]


@pytest.fixture(scope="module")
def zero_runs(smoke_trained, tmp_path_factory, tracking_uri):
    """The same run under ZeRO 0, 2 and 3: ({stage: (manifest, run id, model dir)}, the interrupted ZeRO-3
    run's MLflow run id, the sft manifests there were when it failed, the run dir); ZeRO-2 is the shared
    run. The ZeRO-3 run is interrupted after its checkpoint of step 3 and resumed: it must still match ZeRO-0."""
    import os
    import time

    from mlflow.tracking import MlflowClient

    run_dir = smoke_trained(tmp_path_factory.mktemp("sft"))
    runs = {0: run_sft(run_dir, tracking_uri, "stages.sft.deepspeed.zero_stage=0"), 2: _trained_sft(smoke_trained)}
    zero3 = ("stages.sft.deepspeed.zero_stage=3", "stages.sft.max_failures=0")
    started = int(time.time() * 1000)
    os.environ["PIPELINE_FAULT_AFTER_STEP"] = "3"
    try:
        with pytest.raises(Exception, match="injected fault after step 3"):
            run_sft(run_dir, tracking_uri, *zero3)
    finally:
        del os.environ["PIPELINE_FAULT_AFTER_STEP"]
    finished = set((run_dir / "artifacts" / "sft").glob("*/manifest.json"))
    runs[3] = run_sft(run_dir, tracking_uri, *zero3)
    client = MlflowClient(tracking_uri)
    experiment = client.get_run(runs[3][1]).info.experiment_id
    [interrupted] = client.search_runs([experiment], f"tags.stage = 'sft' and attributes.status = 'FAILED' and "
                                       f"attributes.start_time > {started}")
    return runs, interrupted.info.run_id, finished, run_dir


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=(
    "stages/sft.py", "stages/common/deepspeed.py", "stages/common/training.py", "stages/common/train_loop.py",
    "pipeline/upstream/"))
def test_zero_stages_give_the_same_loss_trajectory_and_an_interrupted_run_resumes(zero_runs, smoke_trained,
                                                                                  tracking_uri):
    runs, interrupted, finished, run_dir = zero_runs
    stores = {0: tracking_uri, 2: smoke_trained.tracking_uri, 3: tracking_uri}
    losses = {z: history(stores[z], run_id, "train_loss") for z, (_, run_id, _) in runs.items()}
    assert sorted(losses[0]) == list(range(1, 13))
    # ZeRO-3 was interrupted after step 3 and left no manifest; the rerun continued after step 3 (did not restart)
    assert run_dir / "artifacts" / "sft" / runs[3][0]["key"] / "manifest.json" not in finished
    first = history(tracking_uri, interrupted, "train_loss")
    assert sorted(first) == [1, 2, 3], first
    assert min(losses[3]) == 4
    losses[3] = {**first, **losses[3]}  # its whole trajectory: steps 1-3 before the fault, 4-12 resumed
    for z in (2, 3):
        assert losses[z].keys() == losses[0].keys()
        np.testing.assert_allclose([losses[z][s] for s in losses[0]], list(losses[0].values()), rtol=2e-4)
    # ZeRO-3 shards the parameters; the saved model is the gathered full one, equal to ZeRO-0's (and so the
    # resumed run ends on the weights of an uninterrupted one).
    w0, w3 = weights(runs[0][2]), weights(runs[3][2])
    assert w0.keys() == w3.keys()
    for name in w0:
        np.testing.assert_allclose(w3[name], w0[name], atol=1e-5)


@pytest.mark.slow  # the session's shared trained run: ~80 s, over the fast suite's budget (docs/development.md)
def test_sft_learns_and_exports_a_loadable_model(smoke_trained):
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common.models import load_tokenizer

    manifest, run_id, model_dir = _trained_sft(smoke_trained)
    evals = history(smoke_trained.tracking_uri, run_id, "eval_loss")
    assert evals[12] < evals[0] - 0.5  # eval loss fell well below its start
    assert {"base_accuracy", "accuracy", "tokens_per_s"} <= manifest["metrics"].keys()

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5

    from mlflow.tracking import MlflowClient

    files = {a.path for a in MlflowClient(smoke_trained.tracking_uri).list_artifacts(run_id)}
    assert "deepspeed_config.json" in files
    assert torch.isfinite(torch.tensor(evals[12]))


@pytest.mark.slow
def test_vllm_engines_answer_the_held_out_prompts_as_hf_generate_does(smoke_trained, ray_local, tmp_path):
    """`accuracy_engine: vllm`: the engines' greedy answers (and which ones were cut off) are HF's,
    for the base and the tuned model alike, so the switch changes the speed, not the figure. The smoke
    models answer every prompt with one repeated token, so a third model, the base with larger random
    weights, gives answers that differ from prompt to prompt and token to token: a real comparison."""
    import shutil

    from helpers.weights import redraw
    from stages.common.models import greedy_generate
    from stages.common.parquet import read_rows
    from stages.sft import engine_greedy

    def output(stage, name):
        manifest = smoke_trained.summary["stages"][stage]
        return storage.output_paths(manifest, storage.artifact_dir(smoke_trained.run_dir, stage, manifest["key"]))[name]

    noisy = redraw(shutil.copytree(output("model", "base_model"), tmp_path / "noisy"))
    models = [output("model", "base_model"), output("sft", "sft_model"), noisy]
    prompts = [r["prompt_ids"] for r in read_rows(output("data", "prompt_data") / "eval", 16)]
    engine = engine_greedy(models, prompts, 12, seed=0)
    hf = [greedy_generate(m, prompts, 12) for m in models]
    assert engine == hf
    assert engine[0][0] != engine[1][0]  # two models, two sets of answers: each engine held its own
    assert len(set(engine[2][0])) > 3 and len(set("".join(engine[2][0]))) > 3, engine[2][0]  # not a degenerate repeat


# --------------------------------------------------------------------------- the ranks' batches


def test_rank_batches_do_not_depend_on_the_block_layout(ray_local):
    """The same rows give every rank the same batches however Ray Data partitioned them: reruns train alike."""
    import ray.data

    from stages.common.training import rank_batches

    ray.data.DataContext.get_current().execution_options.preserve_order = True  # as fit's DataConfig sets it
    rows = [{"i": i} for i in range(50)]
    collate = lambda b: [int(v) for v in b["i"]]  # noqa: E731
    seen = {}
    for blocks in (1, 7, 13):
        ds = ray.data.from_items(rows, override_num_blocks=blocks)
        seen[blocks] = [list(rank_batches(ds, 4, r, 3, collate)) for r in range(3)]
    assert seen[1] == seen[7] == seen[13]
    ranks = seen[1]
    assert [len(r) for r in ranks] == [4, 4, 4]  # 50 rows, global batch 12: 4 full batches, the rest dropped
    assert ranks[0][0] == [0, 1, 2, 3] and ranks[1][0] == [4, 5, 6, 7] and ranks[2][1] == [20, 21, 22, 23]


def test_a_small_split_read_with_pyarrow_gives_every_rank_the_batches_ray_data_gives(ray_local, tmp_path):
    """`ParquetSplit` (what workers read small splits with) against Ray Data over the same multi-file,
    list-column split: the same collated batches for every rank, with and without a short last batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    from stages.common.training import ParquetSplit, pad, rank_batches

    ray.data.DataContext.get_current().execution_options.preserve_order = True  # as fit's DataConfig sets it
    split = tmp_path / "train"
    split.mkdir()
    for f, rows in enumerate((range(0, 9), range(9, 17), range(17, 23))):  # three files, uneven
        pq.write_table(pa.table({"input_ids": [list(range(i % 5 + 1)) for i in rows], "n": list(rows)}),
                       split / f"part-{f:03d}.parquet")

    def collate(b):
        ids, mask = pad(b["input_ids"], 0)
        return ids.tolist(), mask.tolist(), [int(v) for v in b["n"]]

    for drop_last in (True, False):
        for rank in range(2):
            direct = list(rank_batches(ParquetSplit(str(split)), 3, rank, 2, collate, drop_last=drop_last))
            streamed = list(rank_batches(ray.data.read_parquet(str(split)), 3, rank, 2, collate, drop_last=drop_last))
            assert direct == streamed and direct
    every = [n for r in range(2) for b in rank_batches(ParquetSplit(str(split)), 3, r, 2, collate, drop_last=False)
             for n in b[2]]
    assert sorted(every) == list(range(23))  # without drop_last every row is read exactly once
