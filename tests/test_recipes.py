"""The recipes under configs/recipes/ run at smoke size: each one's stage graph and RL settings applied to
smoke.yaml (its tiny model and data), on the session's trained smoke run, so only what the recipe changes
runs. The full graph (configs/full.yaml, recipes/rlhf.yaml, rlhf-real.yaml, verifier.yaml) is what the
shared command-line run (`smoke_cli`) and tests/test_rlhf.py run; here, the graphs without some stage."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from conftest import CLI_RUN, ROOT, SMOKE, smoke_config
from pipeline.config import load_config
from pipeline.runner import run_pipeline

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 5, "ray": 4, "train_groups": 3, "vllm_engines": 4}

RECIPES = ROOT / "configs" / "recipes"


def at_smoke_size(recipe) -> list[str]:
    """Overrides that give smoke.yaml a recipe's stage graph, RL algorithm and rewards, and its own data
    sources and verifier where it has them (the model stays smoke.yaml's tiny one)."""
    cfg = load_config(recipe)
    out = [f"stages.{name}=null" for name in ("sft", "reward", "ppo") if getattr(cfg.stages, name) is None]
    sources = cfg.stages.data.sources
    for kind in ("sft", "preference", "prompts", "eval"):
        if getattr(sources, kind):
            out.append(f"stages.data.sources.{kind}=" + json.dumps([s.model_dump(exclude_defaults=True)
                                                                   for s in getattr(sources, kind)]))
    if sources.any():
        out += ["stages.data.generate.sft=null", "stages.data.generate.preference=null",
                "stages.data.generate.prompts=null", f"task.verifier={cfg.task.verifier}"]
    if cfg.stages.dpo is not None:  # its loss and reference, at smoke size
        dpo = cfg.stages.dpo
        out.append("stages.dpo=" + json.dumps({
            "loss": dpo.loss, "beta": dpo.beta, "reference": dpo.reference, "num_workers": 2, "max_steps": 6,
            "batch_size": 8, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "eval_every": 3,
            "checkpoint_every": 3, "eval_prompts": 16, "eval_samples": 2, "max_new_tokens": 8}))
    ppo = cfg.stages.ppo
    if ppo is not None:
        out += [f"stages.ppo.algorithm={ppo.algorithm}", f"stages.ppo.rewards.rule={ppo.rewards.rule}",
                f"stages.ppo.rewards.rule_weight={ppo.rewards.rule_weight}",
                f"stages.ppo.rewards.model_weight={ppo.rewards.model_weight}"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sft-only", "grpo-verifier", "own-job-real"])
@pytest.mark.tier("e2e", covers=(
    "configs/recipes/", "pipeline/plan.py", "pipeline/registry.py", "stages/dpo/", "stages/ppo/", "stages/sft.py",
    "stages/common/train_loop.py", "stages/common/training.py", "pipeline/upstream/"))
def test_a_recipe_without_some_stage_runs(recipe, smoke_trained, tmp_path):
    overrides = at_smoke_size(RECIPES / f"{recipe}.yaml")
    # its own tracking store: the serve stage registers a model version, which the shared store's registry
    # tests count
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = smoke_config(smoke_trained(tmp_path / "run"), f"mlflow.tracking_uri={tracking}", *CLI_RUN, *overrides,
                       "stages.serve.deploy=false")  # register only: deploying is the same code as smoke_cli's
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True))
    ran = {p.spec.name: p.status for p in summary["plan"]}
    if recipe == "sft-only":
        assert ran == {"model": "hit", "data": "hit", "sft": "hit", "serve": "miss"}
        assert summary["stages"]["serve"]["metrics"]["registered_version"] >= 1
    elif recipe == "own-job-real":  # the user's files, columns, eval set and reward, on the tiny model
        assert ran == {"model": "hit", "data": "miss", "sft": "miss", "ppo": "miss", "serve": "miss"}
        data, m = summary["stages"]["data"]["metrics"], summary["stages"]["ppo"]["metrics"]
        assert (data["sft_train_rows"] + data["sft_eval_rows"], data["prompts_eval_rows"]) == (400, 320)
        assert data["preference_train_rows"] == 0 and m["eval_prompts"] == min(320, cfg.stages.ppo.eval_prompts or 320)
        assert m["rule_errors"] == 0 and m["rule_timeouts"] == 0  # the user's reward, on the workers
    else:  # GRPO on the verifier: no reward stage, no reward model or critic loaded, the policy trained
        assert ran == {"model": "hit", "data": "hit", "sft": "hit", "ppo": "miss", "serve": "miss"}
        m = summary["stages"]["ppo"]["metrics"]
        assert "rm_score_mean" not in m and "critic_train_s" not in m and m["eval_prompts"] > 0
        assert set(summary["stages"]["ppo"]["components"]["upstream"]) == {"sft_model", "prompt_data"}
    served = summary["stages"]["serve"]["components"]["upstream"]
    assert set(served) == {"sft_model" if recipe == "sft-only" else "policy_model"}


@pytest.mark.slow
@pytest.mark.tier("faults", covers=(
    "configs/recipes/dpo.yaml", "stages/dpo/", "stages/common/train_loop.py", "stages/common/training.py",
    "stages/serve/", "pipeline/upstream/"))
def test_the_dpo_recipe_resumes_after_a_fault_and_serves_its_model(smoke_trained, tmp_path, monkeypatch):
    """SFT -> DPO -> serve at smoke size: DPO is interrupted after its checkpoint of step 3 and resumed; the
    reference log-probs it precomputed before step 1 come back from that checkpoint (recomputing them from
    the half-trained policy would be wrong), and serve registers the DPO model."""
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = smoke_trained(tmp_path / "run")
    cfg = smoke_config(run_dir, f"mlflow.tracking_uri={tracking}", *CLI_RUN, *at_smoke_size(RECIPES / "dpo.yaml"),
                       "stages.serve.deploy=false", "stages.dpo.max_failures=0")  # the fault fails the run
    assert cfg.stages.dpo.reference_kind() == "precomputed"
    monkeypatch.setenv("PIPELINE_FAULT_AFTER_STEP", "3")
    with pytest.raises(Exception, match="injected fault after step 3"):
        run_pipeline(cfg, SMOKE, Console(quiet=True))
    monkeypatch.delenv("PIPELINE_FAULT_AFTER_STEP")
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True))
    ran = {p.spec.name: p.status for p in summary["plan"]}
    assert ran == {"model": "hit", "data": "hit", "sft": "hit", "dpo": "miss", "serve": "miss"}
    m = summary["stages"]["dpo"]["metrics"]
    assert m["step"] == 6 and 0 <= m["eval_reward_accuracy"] <= 1 and m["eval_prompts"] == 16
    assert {"eval_accuracy_before", "eval_accuracy", "eval_sampled_accuracy_sign_test_p", "train_loss",
            "train_reward_margin", "eval_logps_chosen"} <= m.keys()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    resumed = client.get_run(summary["run_ids"]["dpo"])
    [failed] = client.search_runs([resumed.info.experiment_id], "tags.stage = 'dpo' and attributes.status = 'FAILED'")
    assert "reference_precompute_s" in failed.data.metrics  # computed once, before step 1 ...
    assert "reference_precompute_s" not in resumed.data.metrics  # ... and read back from the checkpoint
    steps = [h.step for h in client.get_metric_history(resumed.info.run_id, "train_loss")]
    assert min(steps) == 4 and max(steps) == 6  # the resumed attempt started after the checkpoint
    assert set(summary["stages"]["serve"]["components"]["upstream"]) == {"dpo_model"}
    assert summary["stages"]["serve"]["metrics"]["registered_version"] >= 1
