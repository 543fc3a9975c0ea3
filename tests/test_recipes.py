"""The recipes under configs/recipes/ run at smoke size: each one's stage graph and RL settings applied to
smoke.yaml (its tiny model and data), on the session's trained smoke run, so only what the recipe changes
runs. The full graph (configs/full.yaml, recipes/rlhf.yaml, rlhf-real.yaml, verifier.yaml) is what the
shared command-line run (`smoke_cli`) and tests/test_rlhf.py run; here, the graphs without some stage."""

from __future__ import annotations

import pytest
from rich.console import Console

from conftest import CLI_RUN, ROOT, SMOKE, smoke_config
from pipeline.config import load_config
from pipeline.runner import run_pipeline

RECIPES = ROOT / "configs" / "recipes"


def at_smoke_size(recipe) -> list[str]:
    """Overrides that give smoke.yaml a recipe's stage graph and RL algorithm and rewards."""
    cfg = load_config(recipe)
    out = [f"stages.{name}=null" for name in ("sft", "reward", "ppo") if getattr(cfg.stages, name) is None]
    ppo = cfg.stages.ppo
    if ppo is not None:
        out += [f"stages.ppo.algorithm={ppo.algorithm}", f"stages.ppo.rewards.rule={ppo.rewards.rule}",
                f"stages.ppo.rewards.rule_weight={ppo.rewards.rule_weight}",
                f"stages.ppo.rewards.model_weight={ppo.rewards.model_weight}"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sft-only", "grpo-verifier"])
def test_a_recipe_without_some_stage_runs(recipe, smoke_trained, tmp_path, tracking_uri):
    overrides = at_smoke_size(RECIPES / f"{recipe}.yaml")
    cfg = smoke_config(smoke_trained(tmp_path / "run"), f"mlflow.tracking_uri={tracking_uri}", *CLI_RUN, *overrides,
                       "stages.serve.deploy=false")  # register only: deploying is the same code as smoke_cli's
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True))
    ran = {p.spec.name: p.status for p in summary["plan"]}
    if recipe == "sft-only":
        assert ran == {"model": "hit", "data": "hit", "sft": "hit", "serve": "miss"}
        assert summary["stages"]["serve"]["metrics"]["registered_version"] >= 1
    else:  # GRPO on the verifier: no reward stage, no reward model or critic loaded, the policy trained
        assert ran == {"model": "hit", "data": "hit", "sft": "hit", "ppo": "miss", "serve": "miss"}
        m = summary["stages"]["ppo"]["metrics"]
        assert "rm_score_mean" not in m and "critic_train_s" not in m and m["eval_prompts"] > 0
        assert set(summary["stages"]["ppo"]["components"]["upstream"]) == {"sft_model", "prompt_data"}
    served = summary["stages"]["serve"]["components"]["upstream"]
    assert set(served) == {"sft_model" if recipe == "sft-only" else "policy_model"}
