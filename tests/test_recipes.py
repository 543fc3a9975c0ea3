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
    ppo = cfg.stages.ppo
    if ppo is not None:
        out += [f"stages.ppo.algorithm={ppo.algorithm}", f"stages.ppo.rewards.rule={ppo.rewards.rule}",
                f"stages.ppo.rewards.rule_weight={ppo.rewards.rule_weight}",
                f"stages.ppo.rewards.model_weight={ppo.rewards.model_weight}"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sft-only", "grpo-verifier", "own-job-real"])
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
