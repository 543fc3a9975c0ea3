"""The losses the policy and critic ranks minimise (`worker.py`), by TRL's `loss_type` names: how a
per-token loss is aggregated (`aggregate`), the importance ratio per token or per sequence (GSPO,
`importance_log_ratio`), the clipped policy objective with clip-higher, CISPO's clipped-weight form and
the KL term (`policy_loss`), and the critic's clipped value loss (`value_loss`). docs/objectives.md gives
each setting's formula; `tests/test_grpo_oracle.py` holds the loss and its gradient to TRL's, and
`tests/test_rl_math.py` to hand-computed values. And on-policy distillation's loss over the whole
vocabulary (`reverse_kl`, TRL GKDTrainer's at beta 1, `tests/test_distill_oracle.py`): the stage pays its
sampled estimate as a per-token reward (`rl.distill_advantages`, docs/distillation.md), the tests measure
it exactly. Conventions as in `rl.py` ((B, T) tensors, `mask`).
"""

from __future__ import annotations

import torch

from stages.ppo.rl import masked_mean


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IMPORTANCE_LEVELS = ("token", "sequence")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int | None = None,
              tokens: float | None = None) -> torch.Tensor:
    """A per-token loss (B, T) -> scalar, by TRL's `GRPOConfig.loss_type` names (same formulas).

    "bnpo": the mean over every real token of the micro-batch (the default here, for every algorithm).
    "grpo": each response's token mean, then the mean over responses (the GRPO paper's form: a short
    response's tokens weigh more than a long one's).
    "dr_grpo": the token sum divided by a constant, B x max_len (Dr. GRPO: no length bias).
    "dapo" / "cispo": the token sum divided by `tokens`, the optimizer step's real tokens per micro-batch
    (its mean over the iteration's batch: TRL's normalizer of the generation batch). Every token of an
    optimizer step then weighs the same, whichever micro-batch it falls in. Without `tokens`: this
    micro-batch's own token count (the same as "bnpo").
    """
    kept = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    if mode == "bnpo":
        return masked_mean(per_token, mask)
    if mode == "grpo":
        return (kept.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if mode == "dr_grpo":
        if not max_len:
            raise ValueError("dr_grpo aggregation needs max_len (the longest response, e.g. max_new_tokens)")
        return kept.sum() / (per_token.shape[0] * max_len)
    if mode in ("dapo", "cispo"):
        return kept.sum() / (tokens if tokens else mask.sum().clamp(min=1))
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {mode!r}")


def importance_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(pi / pi_old) per token (B, T), or per response (B, 1): the mean of its tokens' (GSPO).

    GSPO (Zheng et al. 2025) clips one ratio per response, the geometric mean of its tokens' ratios,
    because the reward judges the response: a token ratio far from 1 then no longer zeroes its own
    gradient alone, and the noise of single tokens averages out over the response.
    """
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level == "sequence":
        kept = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
        return (kept.sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)
    raise ValueError(f"importance_sampling must be one of {', '.join(IMPORTANCE_LEVELS)}, got {level!r}")


def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
    weights: torch.Tensor | None = None, agg: str = "bnpo", max_len: int | None = None,
    clip_eps_high: float | None = None, level: str = "token", kl: torch.Tensor | None = None,
    kl_coef: float = 0.0, tokens: float | None = None, kl_weighted: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy's loss on one micro-batch: PPO's clipped surrogate (Schulman et al. 2017) or CISPO's,
    plus the KL term, aggregated by `agg` (a `LOSS_TYPES` name, `aggregate`'s modes).

    Clipped surrogate: the max of the two negated terms is the pessimistic bound. Once the ratio has
    moved past [1 - clip_eps, 1 + clip_eps_high] in the direction the advantage rewards, the clipped term
    wins and its gradient is zero, so one batch cannot push the policy far. `clip_eps_high` above
    `clip_eps` is DAPO's clip-higher: a token the policy thought unlikely may grow further (exploration).
    "cispo" (MiniMax-M1) clips the importance weight instead, min(ratio, clip_eps_high) with no
    gradient through it, and keeps every token's gradient -w A grad(log p): no token is silenced.
    `clip_eps_high` is then that cap itself (TRL's ε_max, 5.0 in ScaleRL), not 1 + it.

    `level`: "token" or "sequence" ratios (`importance_log_ratio`, GSPO). `weights` (B, T), e.g.
    `tis_weights`, scale each token's term; `kl` (B, T) per-token KL to the reference, added as
    `kl_coef` * kl to each token's loss before aggregating (as TRL's GRPOTrainer does), times the
    importance ratio with `kl_weighted` (DeepSeek-V3.2's unbiased KL gradient; TRL's default). `tokens`:
    the dapo / cispo normalizer (`aggregate`). clip_frac is the share of tokens whose term was clipped;
    approx_kl (k2 between new and old policy, token level) shows how far the step went.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = importance_log_ratio(logp, old_logp, mask, level)
    ratio = torch.exp(log_ratio)
    if agg == "cispo":
        per_token = -ratio.clamp(max=high).detach() * advantages * logp
        clipped_tokens = ((ratio > high) & (advantages > 0)).float()
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + high)
        per_token = torch.maximum(unclipped, clipped)
        clipped_tokens = (clipped > unclipped).float()
    if weights is not None:
        per_token = per_token * weights
    if kl is not None and kl_coef:
        per_token = per_token + kl_coef * (kl * ratio if kl_weighted else kl)
    loss = aggregate(per_token.expand_as(mask), mask, agg, max_len, tokens)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(clipped_tokens.expand_as(mask), mask).item(),
            "approx_kl": masked_mean(0.5 * (logp - old_logp) ** 2, mask).item(),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_value: float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Squared error of the value head against the GAE returns, optionally clipped like PPO.

    Clipping keeps the new value within clip_value of the one used to compute the advantages,
    taking the worse of the clipped and unclipped errors; None turns it off.
    value_clip_frac is the share of tokens where the clipped error was the larger one.
    """
    unclipped = (values - returns) ** 2
    if clip_value is None:
        return 0.5 * masked_mean(unclipped, mask), {"value_clip_frac": 0.0}
    clipped_values = old_values + torch.clamp(values - old_values, -clip_value, clip_value)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        frac = masked_mean((clipped > unclipped).float(), mask).item()
    return loss, {"value_clip_frac": frac}


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) of the next-token distributions per position: (B, T, V) twice -> (B, T).

    On-policy distillation's per-token loss, over the whole vocabulary: sum_v p_s (log p_s - log p_t).
    Reverse KL is mode-seeking: the student is pushed off tokens the teacher finds unlikely rather than
    spread over everything the teacher allows. The same values as TRL's
    `GKDTrainer.generalized_jsd_loss` with beta 1 before its reduction (tests/test_distill_oracle.py).
    """
    log_s = torch.log_softmax(student_logits.float(), dim=-1)
    log_t = torch.log_softmax(teacher_logits.float(), dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1)
