"""The run's headline outcomes: what the summary table, `--json` and the parent MLflow run show."""

from __future__ import annotations

from pipeline.outcomes import describe, fields, headline, rollup
from pipeline.registry import STAGES

SPEC = {s.name: s.outcomes for s in STAGES}
PPO = {"eval_accuracy_before": 0.25, "eval_accuracy": 0.5, "eval_accuracy_sign_test_p": 0.0039, "eval_prompts": 64,
       "approx_kl": 0.01, "clip_frac": 0.0}


def test_each_stage_reads_as_one_line_of_what_it_achieved():
    assert describe(SPEC["ppo"], PPO) == "accuracy 0.250 -> 0.500 on 64 held-out prompts (sign test p=0.0039)"
    assert describe(SPEC["sft"], {"eval_loss": 1.23456, "base_accuracy": 0.1, "accuracy": 0.4, "accuracy_prompts": 32,
                                  "lr": 1e-3}) == "eval loss 1.235, accuracy 0.100 -> 0.400 on 32 prompts"
    assert describe(SPEC["reward"], {"eval_accuracy": 0.9375, "eval_loss": 0.2}) == "pairwise accuracy 0.938"
    assert describe(SPEC["data"], {"sft_train_rows": 161, "preference_train_rows": 83, "sft_rows_bad": 0}) == \
        "161 SFT rows, 83 preference pairs"
    assert describe(SPEC["serve"], {"registered_version": 2, "smoke_latency_p50_s": 0.279,
                                    "smoke_tokens_per_s": 215.3}) == "version 2, p50 0.28s, 215 tokens/s"
    assert describe(SPEC["model"], {"num_parameters": 55936}) == "55,936 parameters"
    # evaluation off, or a manifest from before a metric existed: what there is, never an error
    assert describe(SPEC["sft"], {"eval_loss": 2.0, "accuracy": 0.5}) == "eval loss 2.000"
    assert describe(SPEC["ppo"], {"eval_accuracy": True}) == ""
    assert fields(SPEC["ppo"][0]) == \
        ["eval_accuracy_before", "eval_accuracy", "eval_prompts", "eval_accuracy_sign_test_p"]


def test_the_parent_run_carries_every_stage_headline_and_nothing_else():
    metrics = rollup({"ppo": (SPEC["ppo"], PPO), "reward": (SPEC["reward"], {"eval_accuracy": 0.9, "train_loss": 0.1}),
                      "model": (SPEC["model"], {"num_parameters": 55936, "vocab_size": 295})})
    assert metrics == {"ppo.eval_accuracy_before": 0.25, "ppo.eval_accuracy": 0.5,
                       "ppo.eval_accuracy_sign_test_p": 0.0039,
                       "ppo.eval_prompts": 64.0, "reward.eval_accuracy": 0.9, "model.num_parameters": 55936.0}
    assert headline(SPEC["sft"], {"eval_loss": 2.0}) == {"eval_loss": 2.0}
