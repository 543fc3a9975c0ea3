"""RLHF from the learned reward alone, as a user runs it: `python -m pipeline run` with a gold
preference (task.preference), a reward model trained on the pairs it labels, and GRPO whose only
reward is that reward model (rule_weight 0). The gold function never trains anything; it judges.

One command-line run (about two minutes): the reward model, an ensemble of three score heads
(`stages.reward.heads`) scored by their lower bound (`rewards.ensemble: lcb`), learns the trivially
learnable preference (noise 0), the gold score of the policy's held-out samples rises over the
handful of iterations, and the stage logs the over-optimisation curve (heldout_* metrics, the plot)
and the heads' disagreement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SMOKE, run_cli
from pipeline import storage
from stages.common.models import saved_heads

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 1, "ray": 1, "train_groups": 2, "vllm_engines": 1}

pytestmark = [pytest.mark.slow, pytest.mark.tier("e2e", covers=(
    "stages/ppo/", "stages/reward/", "stages/common/tasks.py", "stages/common/evaluation.py"))]

RLHF = ("task.preference.gold=explained", "task.preference.noise=0",
        "stages.data.generate.sft=400", "stages.data.generate.preference=200",
        "stages.sft.max_steps=60", "stages.sft.max_new_tokens=24",
        "stages.ppo.algorithm=grpo", "stages.ppo.rewards.rule_weight=0", "stages.ppo.rewards.model_weight=1",
        "stages.ppo.rewards.normalize=true", "stages.reward.heads=3", "stages.ppo.rewards.ensemble=lcb",
        "stages.ppo.iterations=6", "stages.ppo.sampling.max_new_tokens=24",
        "stages.ppo.policy.num_ranks=1", "stages.ppo.rollout.num_engines=1", "stages.ppo.rollout.engine_logprobs=true",
        "stages.ppo.eval_every=3", "stages.ppo.curve_prompts=8", "stages.ppo.checkpoint_every=6")


def _metric_history(run_dir: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_rl_on_the_reward_model_alone_raises_the_gold_preference(tmp_path):
    run_dir = tmp_path / "rlhf"
    done = run_cli("run", str(SMOKE), "--to", "ppo", "--json", f"run_dir={run_dir}", *RLHF, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    stages = {s["name"]: s for s in summary["stages"]}
    manifest = lambda name: json.loads((Path(stages[name]["artifact"]) / "manifest.json").read_text())  # noqa: E731
    rm, rl = manifest("reward")["metrics"], manifest("ppo")["metrics"]
    # The reward model is scored against its labels and against gold (here the same: no noise).
    assert rm["eval_accuracy_gold"] >= 0.9, rm
    assert saved_heads(storage.output_paths(manifest("reward"),
                                            Path(stages["reward"]["artifact"]))["reward_model"]) == 3
    assert "3 score heads on bootstrap resamples" in done.stderr and "3 score head(s), combined by lcb" in done.stderr
    # The gold score of the held-out samples rises, and the win-rate against the SFT policy is above a half.
    assert rl["eval_sampled_gold"] > rl["eval_sampled_gold_before"], rl
    assert rl["gold_winrate"] > 0.5 and rl["gold_winrate_wins"] > rl["gold_winrate_losses"], rl
    assert "gold win-rate" in done.stderr and "against the gold labels" in done.stderr
    # The over-optimisation curve: a point before training, every 3 iterations and at the end, each with
    # proxy, gold and KL; its plot is attached to the stage's run.
    ppo_run = stages["ppo"]["mlflow_run_id"]
    gold = _metric_history(run_dir, ppo_run, "heldout_gold")
    kl = _metric_history(run_dir, ppo_run, "heldout_kl")
    assert [s for s, _ in gold] == [0, 3, 6] == [s for s, _ in kl], gold
    assert kl[0][1] == pytest.approx(0.0, abs=1e-3) and kl[-1][1] > 0  # the engines' policy starts at the reference
    assert gold[-1][1] > gold[0][1], gold
    assert [s for s, _ in _metric_history(run_dir, ppo_run, "heldout_proxy")] == [0, 3, 6]
    # The heads disagree (each trained on its own resample), and that is logged on rollouts and on the curve.
    spread = _metric_history(run_dir, ppo_run, "rm_spread_mean")
    assert sorted({s for s, _ in spread}) == list(range(1, 7)) and all(v > 0 for _, v in spread), spread
    assert [s for s, _ in _metric_history(run_dir, ppo_run, "heldout_rm_spread")] == [0, 3, 6]
    assert (Path(stages["ppo"]["artifact"]) / "overoptimisation.png").stat().st_size > 1000
    # The curve also tracks correctness (task.verifier) and response length, and the run summary shows the
    # curve's first -> last point.
    assert [s for s, _ in _metric_history(run_dir, ppo_run, "heldout_accuracy")] == [0, 3, 6]
    length = _metric_history(run_dir, ppo_run, "heldout_length")
    assert [s for s, _ in length] == [0, 3, 6] and all(v > 0 for _, v in length), length
    assert (rl["curve_length_first"], rl["curve_length_last"]) == pytest.approx((length[0][1], length[-1][1]))
    assert "curve accuracy" in done.stderr and f"length {rl['curve_length_first']:.1f} -> " in done.stderr
