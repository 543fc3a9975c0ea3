"""The reward stage's losses (`stages/reward/losses.py`) against their references: `bradley_terry_loss` against
TRL's `RewardTrainer.compute_loss` (trl 1.16.0, the `bench` extra) run on the same scores, values and gradients,
and `lm_loss` against a direct torch cross-entropy and transformers' `ForCausalLMLoss` (the loss a causal LM
computes from its labels, as the sft stage's model does).

TRL's own code path, without a model: `compute_loss` is called on a stand-in trainer (eval mode, no reward
centring, an accelerator that gathers nothing) with a stand-in model whose logits are the scores, chosen rows
first, then rejected, as a sequence classifier gives them. TRL has a `margin` column and no per-pair weights;
ours has weights (each score head's bootstrap resample, `bootstrap_weights`) and no margin. So the weighted
loss is checked against TRL's on the resample written out (each pair repeated its Poisson weight times, per
head), and the margin only for its sign convention (TRL subtracts it from chosen minus rejected).
"""

from __future__ import annotations

import os

_ENV = dict(os.environ)  # before any library import (tests/test_dpo_oracle.py says why)

from collections import defaultdict  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402
from trl import RewardTrainer  # noqa: E402

os.environ.clear()
os.environ.update(_ENV)

from stages.reward import bootstrap_weights, pair_key  # noqa: E402
from stages.reward.losses import bradley_terry_loss, lm_loss  # noqa: E402

B = 6


def trl_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's RewardTrainer.compute_loss on these scores: (B,) or (B, K) each, K the model's num_labels."""
    accelerator = SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(model=SimpleNamespace(training=False),
                              args=SimpleNamespace(center_rewards_coefficient=None),
                              accelerator=accelerator, _metrics={"eval": defaultdict(list)}, _total_train_tokens=0,
                              _tp_size=1)
    scores = torch.cat([r_chosen, r_rejected])
    logits = scores.unsqueeze(-1) if scores.dim() == 1 else scores  # (2B, num_labels)
    inputs = {"input_ids": torch.zeros(scores.shape[0], 4, dtype=torch.long),
              "attention_mask": torch.ones(scores.shape[0], 4, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = margin
    loss = RewardTrainer.compute_loss(trainer, lambda **_: SimpleNamespace(logits=logits), inputs)
    assert trainer._metrics["eval"]["accuracy"]  # TRL's path ran to its metrics: the stand-in is complete
    return loss


def scores(seed: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    chosen = (torch.randn(*shape, generator=g) * 2).requires_grad_()
    return chosen, (torch.randn(*shape, generator=g) * 2).requires_grad_()


def same_loss_and_grads(ours: torch.Tensor, theirs: torch.Tensor, *inputs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    for g_ours, g_theirs in zip(torch.autograd.grad(ours, inputs), torch.autograd.grad(theirs, inputs)):
        torch.testing.assert_close(g_ours, g_theirs, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- Bradley-Terry, against TRL


def test_bradley_terry_equals_trls_reward_trainer_loss():
    rc, rr = scores(0, B)
    ours, theirs = bradley_terry_loss(rc, rr), trl_loss(rc, rr)
    assert 0.1 < float(ours.detach()) and not torch.allclose(ours, bradley_terry_loss(rr, rc))  # the order matters
    same_loss_and_grads(ours, theirs, rc, rr)


def test_bradley_terry_over_heads_without_weights_equals_trls_over_num_labels():
    """K heads unweighted: the mean over every (pair, head), TRL's loss on a model with num_labels K."""
    rc, rr = scores(1, B, 3)
    same_loss_and_grads(bradley_terry_loss(rc, rr), trl_loss(rc, rr), rc, rr)


def test_weighted_bradley_terry_equals_trls_loss_on_the_resample_written_out():
    """Each head's Poisson(1) bootstrap weights (the stage's own): TRL's loss on every head's resample, each pair
    repeated its weight times, equals ours with the weights."""
    heads = 3
    rc, rr = scores(2, B, heads)
    keys = [pair_key([i, i + 1], [i + 2]) for i in range(B)]
    weights = torch.tensor(bootstrap_weights(keys, heads, seed=7))
    assert (weights == 0).any() and (weights > 1).any()  # a resample, not all ones: the weights change the loss
    counts = weights.long()
    rc_rep = torch.cat([rc[:, k].repeat_interleave(counts[:, k]) for k in range(heads)])
    rr_rep = torch.cat([rr[:, k].repeat_interleave(counts[:, k]) for k in range(heads)])
    ours = bradley_terry_loss(rc, rr, weights)
    assert not torch.allclose(ours, bradley_terry_loss(rc, rr))
    same_loss_and_grads(ours, trl_loss(rc_rep, rr_rep), rc, rr)


def test_weights_of_one_are_trls_loss_and_all_zero_weights_are_no_loss():
    rc, rr = scores(3, B)
    same_loss_and_grads(bradley_terry_loss(rc, rr, torch.ones(B)), trl_loss(rc, rr), rc, rr)
    empty = bradley_terry_loss(rc, rr, torch.zeros(B))  # a micro-batch outside one head's resample: no NaN
    assert float(empty.detach()) == 0.0


def test_trls_margin_shifts_chosen_minus_rejected_as_shifted_scores_do_ours():
    rc, rr = scores(4, B)
    margin = torch.linspace(0.0, 1.5, B)
    theirs = trl_loss(rc, rr, margin)
    assert not torch.allclose(theirs, trl_loss(rc, rr))
    same_loss_and_grads(bradley_terry_loss(rc - margin, rr), theirs, rc, rr)


# --------------------------------------------------------------------------- the LM loss, against cross-entropy


def lm_case(seed: int, n: int = 3, t: int = 7, h: int = 5, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, h, generator=g).requires_grad_()
    head = torch.randn(v, h, generator=g).requires_grad_()
    ids = torch.randint(0, v, (n, t), generator=g)
    mask = torch.zeros(n, t, dtype=torch.long)
    mask[0, 3:] = 1  # answers of different lengths; the last row is a rejected one (no LM tokens)
    mask[1, 5:] = 1
    return hidden, head, ids, mask


def test_lm_loss_equals_torch_cross_entropy_and_a_causal_lms_label_loss():
    hidden, head, ids, mask = lm_case(5)
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))  # a causal LM's labels: -100 is no loss
    v = head.shape[0]
    direct = F.cross_entropy((hidden @ head.T)[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=-100)
    same_loss_and_grads(lm_loss(hidden, head, ids, mask), direct, hidden, head)
    same_loss_and_grads(lm_loss(hidden, head, ids, mask), ForCausalLMLoss(hidden @ head.T, labels, vocab_size=v),
                        hidden, head)
    assert float(direct.detach()) > 0.5


def test_lm_loss_reads_only_masked_tokens_and_is_zero_without_any():
    hidden, head, ids, mask = lm_case(6)
    other = ids.clone()
    other[2] = (ids[2] + 1) % head.shape[0]  # the unmasked row's tokens changed
    other[0, :3] = (ids[0, :3] + 1) % head.shape[0]  # and the prompt part of a masked row: predicting, not predicted
    torch.testing.assert_close(lm_loss(hidden, head, other, mask), lm_loss(hidden, head, ids, mask))
    assert float(lm_loss(hidden, head, ids, torch.zeros_like(mask)).detach()) == 0.0
    other[0, 4] = (ids[0, 4] + 1) % head.shape[0]  # an answer token: the loss changes
    assert not torch.allclose(lm_loss(hidden, head, other, mask), lm_loss(hidden, head, ids, mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lm_loss_is_computed_in_float32(dtype):
    hidden, head, ids, mask = lm_case(7)
    got = lm_loss(hidden.detach().to(dtype), head.detach().to(dtype), ids, mask)
    assert got.dtype == torch.float32
    want = lm_loss(hidden.detach().to(dtype).float(), head.detach().to(dtype).float(), ids, mask)
    torch.testing.assert_close(got, want)
