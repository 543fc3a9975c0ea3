"""The pure math of PPO and the critic-free estimators (GRPO, RLOO, REINFORCE++, Dr. GRPO) on the
driver's side: advantages, KL penalties and their controller, whitening, truncated importance
sampling, reward shaping (DAPO's overlong penalty and group filter), on-policy distillation's sampled
per-token reward. The losses the ranks minimise with them, and the exact reverse KL that reward
estimates, are in `losses.py`.

Why a module of its own: these few formulas decide whether RL training works, and every bug in
them is silent (the loss still goes down). Kept as small functions on tensors, with no Ray,
vLLM or DeepSpeed in sight, each one is checked against hand-computed values in
`tests/test_rl_math.py` (docs/architecture.md), and the PPO stage only wires them together.

Conventions: response tensors are (B, T) for B sequences of T response tokens, right-padded;
`mask` is (B, T), 1 (or True) on real response tokens and 0 on padding. Anything at a masked
position is ignored, whatever its value, so callers never need to zero padding first.

Run the checks: `.venv/bin/python -m pytest tests/test_rl_math.py -q`.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CONTROLLERS = ("fixed", "adaptive")


# --------------------------------------------------------------------------- masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over entries where `mask` is set: a scalar (dim=None) or along `dim`.

    Padding must not count, or a batch of short answers would dilute every loss. `where` rather
    than multiplying by the mask, so a NaN or inf at a padded position cannot leak in; an empty
    mask gives 0 instead of 0/0.
    """
    mask = mask.to(x.dtype)
    kept = torch.where(mask.bool(), x, torch.zeros_like(x))
    if dim is None:
        return kept.sum() / mask.sum().clamp(min=1)
    return kept.sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked entries; padded entries of the result are 0.

    Whitening advantages keeps the policy step size independent of the reward scale. With
    `shift_mean=False` the mean is added back (only the scale changes), as TRL and OpenRLHF do
    for rewards, so their sign still says "better or worse than zero".
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)  # population variance (unbiased=False)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


# --------------------------------------------------------------------------- from logits


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position: logits (B, T, V), labels (B, T) -> (B, T), in float32.

    float32 because bf16 log-softmax loses the small differences between the policy and the old
    policy that the PPO ratio exp(logp - old_logp) is made of.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position: (B, T, V) -> (B, T), in float32.

    H = logsumexp(z) - sum p*z, which avoids log(p) of tiny probabilities. Logged to watch for
    the policy collapsing onto one answer.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def distill_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                       weight: float = 1.0) -> torch.Tensor:
    """Per-token advantages (B, T) of on-policy distillation: weight x (log p_teacher - log p_student) of each
    sampled token, 0 on padding.

    The student's own samples make this a one-sample estimate of -KL(student || teacher) at each position
    (its mean over the student's sampling is `-losses.reverse_kl`), from two log-probs per token instead
    of two vocabularies: the teacher only scores the tokens the student sampled (Agarwal et al. 2024; Thinking
    Machines' "on-policy distillation", 2025). Each token keeps its own reward, undiscounted: a dense signal
    where a verifier gives one number per response. No gradient flows through it.
    """
    adv = (teacher_logp.detach().float() - student_logp.detach().float()) * weight
    return torch.where(mask.bool(), adv, torch.zeros_like(adv))


# --------------------------------------------------------------------------- rewards and advantages


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3).

    k1 = log r is unbiased but can be negative per token; k2 = (log r)^2 / 2 is low-variance but
    biased; k3 = 1/r - 1 + log r is unbiased and never negative (r = p / p_ref).
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"kl estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards (B, T): -kl_coef * kl on every real token, plus the score on the last.

    The reward model (or verifier) judges the whole answer, so its score (B,) arrives at the
    last token of the mask, the model's last token (a multi-turn response has the environment's
    tokens masked out between its turns); the KL penalty is paid token by token. A row with no
    response tokens gets nothing.
    """
    rewards = torch.where(mask.bool(), -kl_coef * kl, torch.zeros_like(kl))
    lengths = mask.long().sum(1)
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = ((mask.bool() * positions).argmax(1) if mask.shape[1] else lengths).unsqueeze(1)
    bonus = torch.where(lengths > 0, scores.to(rewards.dtype), torch.zeros_like(scores, dtype=rewards.dtype))
    return rewards.scatter_add(1, last, bonus.unsqueeze(1))


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016): (advantages, returns), each (B, T).

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, run backwards
    with V = 0 after the last token. Masked positions are skipped: padding after a row's last
    token adds nothing, and the environment's tokens between a multi-turn response's turns are
    not steps (the model chose none of them), so t+1 is the model's next token, as in verl's
    multi-turn GAE. Both outputs are targets, not functions of the model: the inputs are detached.
    """
    keep = mask.bool()
    rewards = torch.where(keep, rewards.detach(), torch.zeros_like(rewards))
    values = torch.where(keep, values.detach(), torch.zeros_like(values))
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = keep[:, t]
        next_advantage = torch.where(here, delta + gamma * lam * next_advantage, next_advantage)
        advantages[:, t] = next_advantage
        next_value = torch.where(here, values[:, t], next_value)
    advantages = torch.where(keep, advantages, torch.zeros_like(advantages))
    return advantages, advantages + values


def grpo_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6, std_floor: float = 0.0) -> torch.Tensor:
    """GRPO's advantage (Shao et al. 2024): each score standardized within its prompt's group.

    scores is (B,) with B = n_prompts * group_size and each prompt's samples contiguous. The
    group mean is the baseline, so no value model is needed; a group of equal scores (all right
    or all wrong) gives zeros and teaches nothing, which is the intent.

    `std_floor`: a group whose scores spread less than this is divided by the floor, not by its own
    spread. Why: dividing by the std blows any spread up to unit advantages, so a group of nearly
    equal scores (all answers wrong, told apart only by a reward model's small differences) pushed
    the policy as hard as a group of right and wrong answers; on the real model that drowned the
    verifier's signal when the reward model was mixed in (bench/RESULTS.md). In the reward's units.
    """
    groups = _groups(scores, group_size, minimum=1)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std.clamp(min=std_floor) + eps)).view(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's advantage (Ahmadian et al. 2024): each score minus the mean of its group's *other* scores.

    The leave-one-out baseline does not depend on the sample it judges, so the gradient stays
    unbiased; it equals n/(n-1) x (score - group mean). No std division: the scale is the reward's.
    """
    groups = _groups(scores, group_size, minimum=2)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baseline).view(-1)


def dr_grpo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO's advantage (Liu et al. 2025, "Understanding R1-Zero-like training"): score - group mean.

    GRPO's division by the group's std up-weights prompts whose samples nearly agree (too easy
    or too hard); Dr. GRPO drops it, and drops the per-response length normalisation in the loss
    too (`aggregate(..., "dr_grpo")`), so long wrong answers are not penalised less per token.
    """
    groups = _groups(scores, group_size, minimum=1)
    return (groups - groups.mean(dim=1, keepdim=True)).view(-1)


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++'s advantage (Hu 2025): per-token returns, whitened over the whole global batch.

    `rewards` are per-token rewards (B, T) with the KL penalty already in them (`token_rewards`);
    the return G_t = sum_{s>=t} gamma^(s-t) r_s needs no critic, and normalising the returns over
    every token of the batch (not per prompt, as GRPO does) is the variance reduction.
    """
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return masked_whiten(returns, mask)


def _groups(scores: torch.Tensor, group_size: int, minimum: int) -> torch.Tensor:
    if group_size < minimum:
        raise ValueError(f"group_size must be >= {minimum}, got {group_size}")
    if scores.dim() != 1 or scores.shape[0] % group_size != 0:
        raise ValueError(
            f"scores must be 1-D with a length divisible by group_size={group_size}, got shape "
            f"{tuple(scores.shape)}; generate group_size samples per prompt"
        )
    return scores.float().view(-1, group_size)


def tis_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights min(pi_trainer / pi_rollout, cap) per token (no gradient).

    The rollout engine and the trainer compute the same policy with different kernels (and on
    GPUs, often different precisions), so the tokens were sampled from a slightly different
    distribution than the one PPO's ratio assumes. Weighting each token's loss by this ratio
    corrects for it (Yao et al. 2025); truncating at `cap` bounds the variance a rare token with
    a tiny rollout probability would add.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    return torch.exp(trainer_logp.detach().float() - rollout_logp.detach().float()).clamp(max=cap)


def logprob_mismatch(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |trainer log p - rollout engine log p| of the sampled tokens (real tokens only).

    ~0 when the engine holds exactly the trainer's weights in the same precision; a growing value
    means the engines sample from another policy than the one being trained (a stale or broken
    weight sync, or a precision gap worth correcting with `tis_weights`).
    """
    diff = (trainer_logp.float() - rollout_logp.float()).abs()
    kept = torch.where(mask.bool(), diff, torch.zeros_like(diff))
    return {"logprob_mismatch_mean": masked_mean(diff, mask).item(),
            "logprob_mismatch_max": kept.max().item() if kept.numel() else 0.0}


# --------------------------------------------------------------------------- shaping and filtering the rewards


def overlong_penalty(lengths: list[int], max_len: int, cache: int) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), added to each response's reward:
    0 up to max_len - cache tokens, then falling linearly to -1 at max_len, -1 beyond.

    A response cut at the token limit usually has no answer, and the verifier scores it like a wrong
    one; the ramp tells the policy it is getting long before it is cut. Same values as
    `trl.rewards.get_soft_overlong_punishment(max_len, cache)`.
    """
    if cache <= 0 or cache > max_len:
        raise ValueError(f"the overlong cache must be in 1..{max_len} tokens (the response limit), got {cache}")
    start = max_len - cache
    return [0.0 if n <= start else (start - n) / cache if n <= max_len else -1.0 for n in lengths]


def dynamic_keep(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """DAPO's dynamic sampling: which prompts' groups (G,) carry a learning signal.

    A group whose samples all scored the same (all right, or all wrong) has zero advantage under a
    group baseline: it adds no policy gradient, only dilutes the batch. The loop replaces such groups
    with fresh prompts (`stages.ppo.dynamic_sampling`).
    """
    groups = _groups(scores, group_size, minimum=2)
    return (groups.max(1).values - groups.min(1).values) > eps


# --------------------------------------------------------------------------- KL coefficient


class FixedKLController:
    """A constant KL coefficient; `update` exists so the PPO loop treats both kinds alike."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """A KL coefficient steered toward a target KL (Ziegler et al. 2019, as in TRL).

    The error current_kl / target - 1 is clipped to +-0.2 so one noisy batch cannot swing the
    coefficient; `horizon` is how many samples a full correction takes.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def kl_controller(
    kind: str, coef: float, target: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """The KL controller named by the config: "fixed" or "adaptive" (which needs target, horizon)."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target is None or target <= 0 or horizon is None or horizon <= 0:
            raise ValueError(
                f"adaptive kl controller needs target > 0 and horizon > 0, got target={target}, horizon={horizon}"
            )
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"kl controller must be one of {', '.join(KL_CONTROLLERS)}, got {kind!r}")


# --------------------------------------------------------------------------- rollouts as tensors, and the estimator


def make_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict:
    """Rollouts -> tensors: prompts left-padded to width P, responses right-padded to width T.

    Every response token t then sits at column P + t in every row, so one slice of the logits
    serves the whole batch; position ids count real tokens only, as without padding.
    """
    import torch

    p = max(len(x) for x in prompts)
    t = max(1, max(len(r) for r in responses))
    b = len(prompts)
    ids = torch.full((b, p + t), pad_id, dtype=torch.long)
    attn = torch.zeros((b, p + t), dtype=torch.long)
    for i, (q, r) in enumerate(zip(prompts, responses)):
        ids[i, p - len(q) : p] = torch.tensor(q)
        attn[i, p - len(q) : p] = 1
        if r:
            ids[i, p : p + len(r)] = torch.tensor(r)
            attn[i, p : p + len(r)] = 1
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": position_ids, "prompt_width": p,
            "response_ids": ids[:, p:], "response_mask": attn[:, p:].float()}


def pad_rows(rows: list[list[float]], width: int):
    """Ragged per-token values (e.g. the engines' log-probs) -> (B, width) float tensor, 0-padded."""
    import torch

    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def advantages(cfg, scores, kl, mask, kl_coef: float, values=None, distill=None):
    """(advantages (B, T), returns (B, T) or None, coefficient of the KL term in the policy loss); `cfg`, the stage's
    PPOConfig (not imported: the math stays below the config).

    PPO and REINFORCE++ pay the KL to the reference per token inside the reward; the group
    estimators (GRPO, RLOO, Dr. GRPO) score whole responses against their prompt's other
    samples and pay the KL as a loss term instead, as their papers do. `distill` (B, T), the
    teacher's per-token rewards (`distill_advantages`), joins each token's reward (PPO, REINFORCE++)
    or, undiscounted, its advantage (the group estimators: on-policy distillation's form).
    """
    extra = distill if distill is not None else torch.zeros_like(mask, dtype=torch.float32)
    if cfg.algorithm == "ppo":
        adv, returns = gae(token_rewards(scores, kl, mask, kl_coef) + extra, values, mask, cfg.gamma, cfg.lam)
        return (masked_whiten(adv, mask) if cfg.whiten_advantages else adv), returns, 0.0
    if cfg.algorithm == "reinforce_pp":
        return reinforce_pp_advantages(token_rewards(scores, kl, mask, kl_coef) + extra, mask, cfg.gamma), None, 0.0
    if cfg.algorithm == "grpo":
        per_response = grpo_advantages(scores, cfg.sampling.n, std_floor=cfg.group_std_floor)
    else:
        per_response = {"rloo": rloo_advantages, "dr_grpo": dr_grpo_advantages}[cfg.algorithm](scores, cfg.sampling.n)
    return per_response[:, None] * mask + extra * mask, None, kl_coef
