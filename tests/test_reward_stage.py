"""The reward stage on Ray Train + DeepSpeed: the session's shared trained run, and a Bradley-Terry
model that learns a clear preference on data of its own. Both train for real (slow: the shared run is
the session's command-line run, conftest.smoke_cli)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from conftest import SMOKE, smoke_config
from pipeline import storage
from pipeline.runner import run_pipeline

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 1, "train_groups": 2}


@pytest.mark.slow
def test_the_shared_reward_run_trains_and_exports_a_scorer(smoke_trained):
    """smoke.yaml's reward stage for real (2 workers, ZeRO-2, the LM loss on): every step trained and
    logged, the LM loss fell, and the export is a one-logit sequence classifier that scores answers."""
    import torch
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForSequenceClassification

    from stages.common.models import load_tokenizer
    from stages.common.training import reward_scores

    summary = smoke_trained.summary
    manifest, run_id = summary["stages"]["reward"], summary["run_ids"]["reward"]
    client = MlflowClient(smoke_trained.tracking_uri)
    # smoke's pairs differ only in the final number, too hard for a 1-layer model after 12 SFT steps:
    # the Bradley-Terry part barely moves here (the slow test below shows it learning a clear
    # preference); the LM loss on the chosen answers is what must fall.
    lm = sorted(client.get_metric_history(run_id, "train_lm_loss"), key=lambda x: x.step)
    steps = int(manifest["metrics"]["step"]) if "step" in manifest["metrics"] else lm[-1].step
    assert [x.step for x in lm][:steps] == list(range(1, steps + 1)) and steps >= 10
    mean = lambda xs: sum(x.value for x in xs) / len(xs)  # noqa: E731
    assert mean(lm[-3:]) < mean(lm[:3]) - 0.5, [round(x.value, 3) for x in lm]
    evals = sorted(client.get_metric_history(run_id, "eval_loss"), key=lambda x: x.step)
    assert evals[0].step == 0 and evals[-1].step == steps and \
        all(torch.isfinite(torch.tensor([e.value for e in evals])))
    assert {"eval_accuracy", "eval_margin", "train_loss"} <= manifest["metrics"].keys()
    out = storage.output_paths(manifest, storage.artifact_dir(smoke_trained.run_dir, "reward",
                                                              manifest["key"]))["reward_model"]
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1
    tok = load_tokenizer(out)
    pairs = [("What is 2 + 3?", "2 + 3 = 5"), ("What is 2 + 3?", "no"),
             ("What is 12 + 31?", "12 + 31 = 43, since 2 + 1 = 3"),
             ("What is 4 + 4?", "8")]
    heads = reward_scores(model, tok, pairs, 2)  # scored in length order, returned in the callers' order
    assert [len(h) for h in heads] == [1] * 4  # one score head
    scores = [h[0] for h in heads]
    assert all(torch.isfinite(torch.tensor(scores)))
    alone = [reward_scores(model, tok, [p], 1)[0][0] for p in pairs]
    assert torch.allclose(torch.tensor(scores), torch.tensor(alone), atol=1e-4), (scores, alone)


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/reward/", "stages/common/train_loop.py", "stages/common/training.py",
                                 "pipeline/upstream/"))
def test_reward_model_learns_a_held_out_preference(ray_local, smoke_upstream, tmp_path, tracking_uri):
    import torch
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForSequenceClassification

    from stages.common.models import load_tokenizer

    # Smoke-sized preference data with a preference a tiny model can learn in a few steps:
    # a worked answer is preferred over a refusal.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}",
                                         "rejected": "I do not know."}) + "\n"
                             for a in range(12) for b in range(10)))
    # The session's model is a cache hit; data (its own pairs), sft and reward run.
    cfg = smoke_config(smoke_upstream(tmp_path / "run"), f"mlflow.tracking_uri={tracking_uri}",
                       f"stages.data.sources.preference=[{pairs}]",
                       "stages.data.eval_fraction=0.25", "stages.sft.max_steps=2", "stages.sft.accuracy_prompts=0",
                       "stages.reward.max_steps=10", "stages.reward.eval_every=5",
                       "stages.reward.lm_loss_weight=1.0")
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True), to="reward")
    manifest = summary["stages"]["reward"]
    m = manifest["metrics"]
    assert m["eval_accuracy"] >= 0.9 and m["eval_margin"] > 0  # chance is 0.5
    first = MlflowClient(tracking_uri).get_metric_history(summary["run_ids"]["reward"], "eval_loss")
    assert min(x.value for x in first if x.step == 10) < min(x.value for x in first if x.step == 0)
    # The auxiliary LM loss on the chosen answers is trained too (the worked answers were barely
    # seen by a 2-step SFT, so it falls).
    lm = sorted(MlflowClient(tracking_uri).get_metric_history(summary["run_ids"]["reward"], "train_lm_loss"),
                key=lambda x: x.step)
    assert {x.step for x in lm} == set(range(1, 11)) and lm[-1].value < lm[0].value

    # The export is a one-logit sequence classifier that ranks a held-out pair the same way.
    out = storage.output_paths(manifest, storage.artifact_dir(cfg.run_dir, "reward", manifest["key"]))["reward_model"]
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = load_tokenizer(out)
    assert model.config.num_labels == 1

    def score(reply: str) -> float:
        text = tok.apply_chat_template([{"role": "user", "content": "What is 30 + 4?"},
                                        {"role": "assistant", "content": reply}], tokenize=False)
        with torch.no_grad():
            return model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits.item()

    assert score("30 + 4 = 34") > score("I do not know.")
