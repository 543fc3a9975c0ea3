"""`python -m pipeline compare A B` (stages/compare.py): finding the two policies, refusing pairs that cannot be
paired, the paired statistics, and (slow) the command on the session's trained smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from helpers.runs import fake_run
from pipeline.errors import UserError
from stages.common.evaluation import engines_at_once, paired
from stages.common.runs import find_policy
from stages.compare import shared_prompts, shared_task

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"ray": 1, "vllm_engines": 2}


def test_a_policy_is_found_by_run_directory_stage_or_artifact_directory(tmp_path):
    run = fake_run(tmp_path / "run", {"sft": "2026-11-28T10:00", "ppo": "2026-11-28T11:00"}, ["a", "b"])
    assert (find_policy(str(run)).stage, find_policy(str(run)).key) == ("ppo", "ppokey")  # the newest
    assert find_policy(f"{run}:sft").stage == "sft"
    artifact = find_policy(str(run / "artifacts" / "sft" / "sftkey"))
    assert (artifact.stage, artifact.run_dir, artifact.model_dir) == ("sft", run, run / "artifacts/sft/sftkey/model")
    with pytest.raises(UserError, match="'reward' is not a policy stage"):
        find_policy(f"{run}:reward")
    with pytest.raises(UserError, match="no finished dpo stage"):
        find_policy(f"{run}:dpo")
    with pytest.raises(UserError, match="not found; give a run directory"):
        find_policy(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="needs the tracking store"):
        find_policy("0123456789abcdef0123456789abcdef")


def test_a_run_directory_means_its_graphs_last_policy_not_the_newest_finished(tmp_path):
    """Issue 59, item 5: `run --only sft --force sft` after a whole run finishes an sft artifact after the ppo
    one; the run directory still means its ppo policy (and `compare DIR:sft DIR` pairs sft with ppo)."""
    from pipeline.registry import STAGES
    from stages.common.runs import POLICY_STAGES

    run = fake_run(tmp_path / "run", {"sft": "2026-12-01T12:00", "ppo": "2026-12-01T11:00"}, ["a", "b"])
    assert find_policy(str(run)).stage == "ppo"
    assert find_policy(f"{run}:sft").stage == "sft"
    dpo_only = fake_run(tmp_path / "dpo", {"sft": "2026-12-01T12:00", "dpo": "2026-12-01T11:00"}, ["a", "b"])
    assert find_policy(str(dpo_only)).stage == "dpo"
    # "the graph's last": the policy stages in the registry's order (downstream last) are POLICY_STAGES reversed
    assert [s.name for s in STAGES if s.name in POLICY_STAGES] == list(reversed(POLICY_STAGES))


def test_a_pair_on_different_prompts_or_tasks_is_refused_naming_why(tmp_path):
    a = find_policy(str(fake_run(tmp_path / "a", {"ppo": "1"}, ["p1", "p2", "p3"])))
    b = find_policy(str(fake_run(tmp_path / "b", {"ppo": "1"}, ["p1", "pX", "p3"])))
    with pytest.raises(UserError, match=r"different held-out prompts: .* has 3 .*first different at prompt 2"):
        shared_prompts(a, b)
    same = find_policy(str(fake_run(tmp_path / "c", {"sft": "1"}, ["p1", "p2", "p3"], gold="explained")))
    rows_a, rows_b = shared_prompts(a, same)
    assert [r["prompt"] for r in rows_a] == [r["prompt"] for r in rows_b] == ["p1", "p2", "p3"]
    assert shared_task(a, same) == ("number", "explained")  # one side's gold judges both
    other = find_policy(str(fake_run(tmp_path / "d", {"sft": "1"}, ["p1", "p2", "p3"], verifier="exact")))
    with pytest.raises(UserError, match="task verifiers differ"):
        shared_task(a, other)


def test_paired_counts_wins_and_losses_and_tests_them():
    got = paired([0.0, 1.0, 0.5, 0.5, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0])
    assert (got["a"], got["b"], got["won"], got["lost"]) == (0.4, 0.8, 3.0, 1.0)
    assert got["diff"] == pytest.approx(0.4) and got["p"] == pytest.approx(0.625)  # 2 x P(X <= 1 | n=4)
    with pytest.raises(ValueError, match="same prompts"):
        paired([1.0], [1.0, 0.0])


def test_engines_start_in_waves_the_cluster_can_place():
    """Three models on two CPUs: two engines, then one. All three at once left the third unplaced while the
    caller waited on its answers, the other two alive until then (test_sft_stage's three-model check hung)."""
    assert engines_at_once({"CPU": 2.0}, 1.0, gpu=False) == 2
    assert engines_at_once({"CPU": 8.0, "GPU": 3.0}, 1.0, gpu=True) == 3  # one GPU an engine
    # too big for the cluster: Ray's own error, not a hang here
    assert engines_at_once({"CPU": 1.0}, 2.0, gpu=False) == 1
    assert engines_at_once({}, 1.0, gpu=True) == 1


def test_a_policy_is_found_by_its_mlflow_run_id(tmp_path):
    """A pipeline run's id (its policy stage's child run) and a stage run's id both lead to the artifact, through
    the run's logged resolved_config.json (its run_dir) and the stage run's cache_key tag."""
    from mlflow.tracking import MlflowClient

    run = fake_run(tmp_path / "run", {"ppo": "1"}, ["a"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(experiment, run_name="pipeline").info.run_id
    client.log_dict(parent, {"run_dir": str(run)}, "resolved_config.json")
    child = client.create_run(experiment, run_name="ppo", tags={"mlflow.parentRunId": parent, "stage": "ppo",
                                                                "cache_key": "ppokey"}).info.run_id
    for run_id in (parent, child):
        got = find_policy(run_id, uri)
        assert (got.stage, got.key, got.run_dir) == ("ppo", "ppokey", run)
    with pytest.raises(UserError, match="no such MLflow run"):
        find_policy("f" * 32, uri)


def test_each_policy_answers_the_prompts_as_its_own_run_tokenized_them(tmp_path, monkeypatch):
    """Two runs' models may have different tokenizers (a built-in model's is trained on its task's corpus):
    each answers its own run's prompt ids, and the same limit and seed hold for both."""
    import pipeline.cluster
    import stages.common.evaluation
    import stages.compare

    a = fake_run(tmp_path / "a", {"ppo": "1"}, ["p1", "p2"], ids=(5, 6, 7))
    b = fake_run(tmp_path / "b", {"sft": "1"}, ["p1", "p2"], ids=(9, 9))
    seen = {}

    def answers(model_dirs, prompt_ids, samplings, seed, storage=None, own_prompt_ids=None):
        seen.update(dirs=model_dirs, own=own_prompt_ids, samplings=samplings, seed=seed)
        right = [(["1"], [False]), (["1"], [False])]
        return [[right] * len(samplings), [[(["0"], [False]), (["1"], [False])]] * len(samplings)]

    monkeypatch.setattr(stages.common.evaluation, "engine_answers", answers)
    monkeypatch.setattr(pipeline.cluster, "ensure_ray", lambda *a, **k: False)
    monkeypatch.setattr(stages.compare, "_log_to_mlflow", lambda *a, **k: "run-id")
    result = stages.compare.compare_runs(str(a), str(b), samples=2, log=lambda m: None)
    assert seen["own"] == [[[5, 6, 7], [5, 6, 7]], [[9, 9], [9, 9]]]
    assert seen["dirs"] == [a / "artifacts/ppo/ppokey/model", b / "artifacts/sft/sftkey/model"]
    assert [s.get("seed") for s in seen["samplings"]] == [None, 12345] and seen["samplings"][1]["n"] == 2
    assert result["metrics"]["accuracy"] == {"a": 1.0, "b": 0.5, "diff": -0.5, "won": 0.0, "lost": 1.0, "p": 1.0}


def test_the_command_refuses_a_pair_on_different_prompts_with_exit_2(tmp_path):
    a = fake_run(tmp_path / "a", {"ppo": "1"}, ["p1", "p2"])
    b = fake_run(tmp_path / "b", {"ppo": "1"}, ["p1", "p3"])
    done = subprocess.run([sys.executable, "-m", "pipeline", "compare", str(a), str(b)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "different held-out prompts" in done.stdout + done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/compare.py", "stages/common/engines.py", "stages/common/followed.py"))
def test_compare_pairs_the_sft_and_ppo_policies_of_a_run_and_logs_to_mlflow(smoke_trained, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = smoke_trained(tmp_path / "run")  # a copy of the session's run: sft, reward, ppo
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    done = subprocess.run([sys.executable, "-m", "pipeline", "compare", f"{run_dir}:sft", str(run_dir),
                           "--samples", "2", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["a"].startswith(f"{run_dir}:sft: sft ") and result["b"].startswith(f"{run_dir}: ppo ")
    from stages.common.parquet import read_rows

    n = result["prompts"]
    assert n == len(read_rows(find_policy(str(run_dir)).prompts_dir)) > 0  # every held-out prompt
    metrics = result["metrics"]
    assert {"accuracy", "sampled_accuracy", "reward", "sampled_reward"} <= set(metrics)  # ppo's reward model
    for stats in metrics.values():
        assert stats["won"] + stats["lost"] <= n and 0 <= stats["p"] <= 1
        assert stats["diff"] == pytest.approx(stats["b"] - stats["a"])
    logged = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}").get_run(result["run_id"])
    assert logged.data.tags["kind"] == "compare" and logged.info.status == "FINISHED"
    assert logged.data.metrics["accuracy_p"] == pytest.approx(metrics["accuracy"]["p"])
    assert (run_dir / "logs" / "compare.log").is_file()  # vLLM's and Ray's output, not the console
    assert "INFO" not in done.stderr
