"""LoRA in every training role, end to end on the built-in tiny model: sft, reward and ppo (policy and
critic) train adapters; the base never moves; PPO's reference is the SFT policy; the engines get exact
merged weights; checkpoints hold adapters only and resume."""

from __future__ import annotations

import pytest
from rich.console import Console

from conftest import SMOKE, smoke_config
from pipeline import storage
from pipeline.runner import run_pipeline

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 3, "train_groups": 2, "vllm_engines": 4}

pytestmark = [pytest.mark.slow, pytest.mark.tier("e2e", covers=(
    "stages/common/lora.py", "stages/sft.py", "stages/reward/", "stages/ppo/", "stages/common/train_loop.py",
    "stages/common/training.py", "pipeline/upstream/"))]

# LoRA everywhere; adapters learn at larger learning rates than full fine-tuning. PPO uses the toy
# reward of tests/test_ppo_stage.py (share of digits) without the reward model, to keep it short.
LORA = ("stages.sft.lora.r=8", "stages.sft.lr=0.01", "stages.reward.lora.r=8", "stages.reward.lr=0.01",
        "stages.ppo.policy.lora.r=8", "stages.ppo.critic.lora.r=8", "stages.ppo.policy.lr=0.01",
        "stages.ppo.critic.lr=0.01", "stages.ppo.rewards.rule=helpers.toy_rewards:digits",
        "stages.ppo.rewards.model_weight=0", "stages.ppo.kl.coef=0.0", "stages.ppo.iterations=6",
        "stages.ppo.ppo_epochs=2", "stages.ppo.checkpoint_every=2", "stages.ppo.eval_prompts=0")


def _outputs(summary, cfg, stage):
    manifest = summary["stages"][stage]
    return manifest, storage.output_paths(manifest, storage.artifact_dir(cfg.run_dir, stage, manifest["key"]))


def _history(tracking_uri, run_id, key) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri).get_metric_history(run_id, key)}


def _weights(model_dir, kind="causal") -> dict:
    from stages.common.models import load_model

    return load_model(model_dir, kind).state_dict()


@pytest.fixture(scope="module")
def lora_run(ray_local, smoke_upstream, tmp_path_factory, tracking_uri):
    """model -> data -> sft -> reward -> ppo with LoRA; PPO is interrupted after iteration 2 and resumed."""
    import os
    import time

    from mlflow.tracking import MlflowClient

    run_dir = smoke_upstream(tmp_path_factory.mktemp("lora"))
    cfg = smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", *LORA)
    trained = run_pipeline(cfg, SMOKE, Console(quiet=True), to="reward")  # its sft and reward runs trained
    started = int(time.time() * 1000)
    os.environ["PIPELINE_FAULT_AFTER_ITERATION"] = "2"
    try:
        with pytest.raises(Exception, match="injected fault after iteration 2"):
            run_pipeline(cfg, SMOKE, Console(quiet=True), to="ppo")
    finally:
        del os.environ["PIPELINE_FAULT_AFTER_ITERATION"]
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True), to="ppo")
    client = MlflowClient(tracking_uri)
    experiment = client.get_run(summary["run_ids"]["ppo"]).info.experiment_id
    [interrupted] = client.search_runs([experiment], f"tags.stage = 'ppo' and attributes.status = 'FAILED' and "
                                       f"attributes.start_time > {started}")
    return cfg, trained, summary, interrupted.info.run_id


def test_lora_sft_trains_an_adapter_and_ends_merged_into_its_base(lora_run, tracking_uri):
    import torch

    from stages.common import lora
    from pipeline.upstream.deepspeed_loads import load_weights_only

    cfg, summary, _, _ = lora_run
    manifest, out = _outputs(summary, cfg, "sft")
    evals = _history(tracking_uri, summary["run_ids"]["sft"], "eval_loss")
    # the adapter learned (a random-init tiny base learns slowly through adapters: 5.65 -> 5.28 here)
    assert evals[max(evals)] < evals[0] - 0.2, evals
    base_dir = _outputs(summary, cfg, "model")[1]["base_model"]
    model_dir, adapter = out["sft_model"], out["sft_model"].parent / lora.ADAPTER_DIR
    assert lora.adapter_problem(adapter) is None  # the adapter, as safetensors, beside the merged model
    merged, base = _weights(model_dir), _weights(base_dir)
    assert any(not torch.equal(merged[k], base[k]) for k in merged if "q_proj" in k)  # merged in
    # embeddings carry no adapter: untouched by training
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    again = _weights(lora.merge_into(base_dir, adapter, "causal", model_dir.parent / "remerged"))
    assert all(torch.equal(again[k], merged[k]) for k in merged)  # model = the base it started from + the adapter
    # checkpoints hold the adapter, not a copy of the base
    states = sorted((cfg.run_dir / "checkpoints" / "sft").rglob("mp_rank_00_model_states.pt"))[-1]
    module = load_weights_only(str(states))["module"]
    assert module and all("lora_" in k for k in module), sorted(module)[:5]


def test_lora_reward_model_trains_an_adapter_and_its_score_head(lora_run):
    from safetensors import safe_open

    from stages.common import lora, models

    cfg, summary, _, _ = lora_run
    manifest, out = _outputs(summary, cfg, "reward")
    adapter = out["reward_model"].parent / lora.ADAPTER_DIR
    with safe_open(str(adapter / lora.SAFE_ADAPTER), "pt") as f:
        keys = list(f.keys())
    assert any("score" in k for k in keys) and any("lora_A" in k for k in keys)
    assert {"eval_accuracy", "eval_margin"} <= manifest["metrics"].keys()
    scorer = models.load_model(out["reward_model"], "sequence")
    assert scorer.config.num_labels == 1


def test_lora_ppo_keeps_the_sft_policy_as_reference_syncs_exact_merged_weights_and_resumes(lora_run, tracking_uri):
    import torch

    from stages.common import lora

    cfg, _, summary, interrupted = lora_run
    manifest, out = _outputs(summary, cfg, "ppo")
    run_id = summary["run_ids"]["ppo"]
    reward = _history(tracking_uri, run_id, "reward_mean")
    assert sorted(reward) == list(range(3, 7))  # resumed after the checkpoint of iteration 2
    # The engines sample from exactly the trainer's merged weights, every iteration.
    mismatch = _history(tracking_uri, run_id, "logprob_mismatch_mean")
    assert len(mismatch) == 4 and max(mismatch.values()) < 1e-4, mismatch
    # The reference is the SFT policy: KL 0 at the first iteration (the untrained adapter is the SFT
    # policy), then the policy moves away from it (a reference that followed the policy would stay at 0).
    first_kl = _history(tracking_uri, interrupted, "kl")
    assert sorted(first_kl) == [1, 2] and abs(first_kl[1]) < 1e-6, first_kl
    kl = _history(tracking_uri, run_id, "kl")
    assert max(abs(v) for v in kl.values()) > 0.01, kl
    # The base never moved: the SFT model + the trained adapter is exactly the exported policy.
    sft = _outputs(summary, cfg, "sft")[1]["sft_model"]
    adapter = out["policy_model"].parent / lora.ADAPTER_DIR
    assert lora.adapter_problem(adapter) is None
    again = _weights(lora.merge_into(sft, adapter, "causal", out["policy_model"].parent / "remerged"))
    policy = _weights(out["policy_model"])
    assert all(torch.allclose(again[k], policy[k], atol=1e-6) for k in policy)
    assert any(not torch.equal(policy[k], _weights(sft)[k]) for k in policy)
