"""The reward stage's losses, pure functions of the scores and hidden states its model gives: Bradley-Terry on
the pairs' scores (`bradley_terry_loss`, per score head, on bootstrap weights) and the language-modelling loss
on the chosen answers (`lm_loss`, the `lm_loss_weight` regulariser). `tests/test_reward_losses.py` holds them
to TRL's `RewardTrainer` and to torch's cross-entropy. Nothing here knows the stage (`stages.reward.Objective`
puts them together).
"""

from __future__ import annotations


def bradley_terry_loss(r_chosen, r_rejected, weights=None):
    """Mean of -log sigmoid(r_chosen - r_rejected): the pair's log-likelihood under Bradley-Terry.

    Scores (B,) or (B, K) for K heads; with `weights` (the shape of the scores: each head's bootstrap
    weights) it is the weighted mean over every (pair, head), sum(w * nll) / sum(w)."""
    import torch.nn.functional as F

    nll = -F.logsigmoid(r_chosen - r_rejected)
    if weights is None:
        return nll.mean()
    return (nll * weights).sum() / weights.sum().clamp(min=1.0)


def lm_loss(hidden, head_weight, input_ids, mask):
    """Mean next-token negative log-likelihood over the tokens where `mask` is 1.

    `hidden` (N, T, H) is the final (normed) hidden state; position t predicts token t + 1 through
    `head_weight` (V, H), the same shift as a causal LM's labels.
    """
    import torch.nn.functional as F

    logits = hidden[:, :-1].float() @ head_weight.float().T
    nll = F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none")
    m = mask[:, 1:].float().flatten()
    return (nll * m).sum() / m.sum().clamp(min=1.0)
