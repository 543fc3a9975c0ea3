"""A reward-model ensemble (`stages.reward.heads`, `stages.ppo.rewards.ensemble`): K score heads on one
backbone, each trained on its own bootstrap resample, combined into one reward by their mean, min or
mean - k std. Pure functions and tiny models, no Ray; the end-to-end run is tests/test_rlhf.py."""

from __future__ import annotations

import pytest
import torch

from stages.common import models
from stages.common.training import ensemble_score, head_spread
from stages.ppo import scoring
from stages.ppo.config import PPOConfig
from stages.reward import RewardConfig, bootstrap_weights, bradley_terry_loss, pair_key


@pytest.mark.parametrize("how, expected", [("mean", 2.0), ("min", 1.0), ("lcb", 2.0 - 2 * (2 / 3) ** 0.5)])
def test_the_heads_combine_by_mean_min_or_lower_bound(how, expected):
    heads = [1.0, 2.0, 3.0]  # population std sqrt(2/3)
    assert ensemble_score(heads, how, coef=2.0) == pytest.approx(expected)
    assert head_spread(heads) == pytest.approx((2 / 3) ** 0.5)
    assert ensemble_score([0.7], how, coef=2.0) == 0.7  # one head: its score, whatever the combination
    with pytest.raises(ValueError, match="unknown combination"):
        ensemble_score(heads, "median")


def test_bootstrap_weights_are_poisson_per_head_and_fixed_by_the_pair():
    keys = [pair_key([1, 2, i], [1, 3, i]) for i in range(2000)]
    assert len(set(keys)) == 2000
    import numpy as np  # the batches hold numpy arrays: a key must not depend on their type or dtype

    same = [pair_key([1, 2], [3]), pair_key((1, 2), (3,)), pair_key(np.array([1, 2]), np.array([3], np.int32))]
    assert len(set(same)) == 1 and pair_key([1, 2], [4]) != same[0]
    one = bootstrap_weights(keys[:5], 1, seed=0)
    assert one == [[1.0]] * 5  # one head trains on all the data, unweighted
    w = torch.tensor(bootstrap_weights(keys, 3, seed=0))
    assert w.shape == (2000, 3) and bool((w == w.round()).all()) and float(w.min()) == 0
    assert float(w.mean()) == pytest.approx(1.0, abs=0.06)  # Poisson(1): mean 1
    assert float((w == 0).float().mean()) == pytest.approx(0.368, abs=0.03)  # e^-1 of the pairs left out per head
    assert not torch.equal(w[:, 0], w[:, 1])  # each head its own resample
    assert bootstrap_weights(keys[:50], 3, seed=0) == w[:50].tolist()  # the same in every epoch and after resume
    assert bootstrap_weights(keys[:50], 3, seed=1) != w[:50].tolist()


def test_the_weighted_bradley_terry_loss_is_each_heads_mean_over_its_resample():
    rc = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    rr = torch.tensor([[0.0, 0.0], [3.0, -1.0]])
    nll = lambda d: -torch.nn.functional.logsigmoid(torch.tensor(d)).item()  # noqa: E731
    assert bradley_terry_loss(rc[:, :1], rr[:, :1]).item() == pytest.approx((nll(2.0) + nll(-2.0)) / 2)
    weights = torch.tensor([[2.0, 0.0], [0.0, 1.0]])  # head 0 sees pair 0 twice, head 1 pair 1 once
    assert bradley_terry_loss(rc, rr, weights).item() == pytest.approx((2 * nll(2.0) + nll(2.0)) / 3)
    ones = torch.ones_like(rc)
    assert bradley_terry_loss(rc, rr, ones).item() == pytest.approx(bradley_terry_loss(rc, rr).item())


def _classifier(heads: int, tmp_path=None):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, pad_token_id=0, num_labels=heads)
    model = LlamaForSequenceClassification(cfg).eval()
    if tmp_path is not None:
        model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("heads", [1, 2, 3])
def test_saved_heads_reads_a_reward_models_outputs_and_load_model_keeps_them(tmp_path, heads):
    _classifier(heads, tmp_path)
    assert models.saved_heads(tmp_path) == heads  # HF leaves two labels (its default) out of config.json
    assert models.load_model(tmp_path, "sequence", 0, heads).score.out_features == heads


def test_a_causal_checkpoint_counts_as_one_head(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    assert models.saved_heads(tmp_path) == 1


def test_a_critic_from_an_ensemble_starts_at_the_heads_mean():
    model = _classifier(3)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    before = model(input_ids=ids).logits
    models.single_head(model)
    after = model(input_ids=ids).logits
    assert after.shape == (2, 1) and model.config.num_labels == 1
    assert torch.allclose(after[:, 0], before.mean(-1), atol=1e-6)


def test_ppo_scores_an_ensemble_by_the_configured_combination(monkeypatch):
    """`scoring.score` as the training loop calls it: per-rank lists of each response's head scores
    (what the reward role returns) become one raw score by `rewards.ensemble`, and the spread is kept."""
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the reward ranks' results, already here
    rows = [{"prompt": "p", "answer": "1"}] * 3
    parts = [[[1.0, 3.0], [2.0, 2.0]], [[0.0, 4.0]]]  # two ranks
    base = {"rewards": {"rule_weight": 0.0, "model_weight": 1.0}}
    for how, raw in [("mean", [2.0, 2.0, 2.0]), ("min", [1.0, 2.0, 0.0]), ("lcb", [1.0, 2.0, 0.0])]:
        cfg = PPOConfig.model_validate({"rewards": {**base["rewards"], "ensemble": how, "ensemble_coef": 1.0}})
        scores, rule, got, spread = scoring.score(["a", "b", "c"], rows, object(), cfg, lambda *a: 0.0, parts)
        assert got == pytest.approx(raw) and scores == pytest.approx(raw), how
        assert spread == pytest.approx([1.0, 0.0, 2.0])
    cfg = PPOConfig.model_validate(base)
    assert scoring.score(["a"], rows[:1], object(), cfg, lambda *a: 0.0, [[[0.5]]])[2:] == ([0.5], [])


def test_config_keys_are_validated():
    assert RewardConfig().heads == 1 and PPOConfig().rewards.ensemble == "mean"
    with pytest.raises(ValueError, match="heads"):
        RewardConfig(heads=0)
    with pytest.raises(ValueError, match="ensemble"):
        PPOConfig.model_validate({"rewards": {"ensemble": "median"}})
