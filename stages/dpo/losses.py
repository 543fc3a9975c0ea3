"""The dpo stage's losses, pure functions of summed answer log-probs (`stages.dpo.sequence_logps`): DPO, IPO,
SimPO (`pair_losses`), KTO and its reference point (`kto_losses`, `kto_kl`), RPO's language-modelling term
(`chosen_nll`). Written as TRL writes them (`DPOTrainer` loss_type sigmoid, ipo and sft, `CPOTrainer` simpo,
`KTOTrainer`) so that a user's beta means what it means there: `tests/test_dpo_oracle.py` holds loss and
gradients to TRL's trainers on the same model and batch, `tests/test_dpo_units.py` to hand-computed values.
Nothing here knows the stage: no config, no batch layout (`stages.dpo.batch_loss` puts them together).
"""

from __future__ import annotations


def _smoothed_sigmoid(x, beta: float, label_smoothing: float):
    """-log sigmoid(beta x) with weight 1 - eps, plus -log sigmoid(-beta x) with weight eps (cDPO)."""
    import torch.nn.functional as F

    return -F.logsigmoid(beta * x) * (1 - label_smoothing) - F.logsigmoid(-beta * x) * label_smoothing


def pair_losses(loss: str, beta: float, chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len,
                label_smoothing: float = 0.0, simpo_gamma: float = 0.5):
    """Per pair: (loss, implicit reward of the chosen answer, of the rejected one), for dpo, ipo and simpo.

    `chosen` / `rejected` are summed answer log-probs under the policy, `ref_*` under the reference (None
    for simpo), `*_len` the answers' token counts.
    - dpo: x = (chosen - ref_chosen) - (rejected - ref_rejected); loss = cDPO(x).
    - ipo: x as dpo but each log-ratio divided by its answer's length (TRL's normalisation, confirmed by
      the IPO authors); loss = (x - 1/(2 beta))^2.
    - simpo: x = chosen/chosen_len - rejected/rejected_len - simpo_gamma/beta; loss = cDPO(x).
    The implicit rewards are beta x log-ratio (simpo: beta x mean log-prob); their difference is the margin.
    """
    if loss == "simpo":
        rc, rr = chosen / chosen_len.clamp(min=1), rejected / rejected_len.clamp(min=1)
        loss = _smoothed_sigmoid(rc - rr - simpo_gamma / beta, beta, label_smoothing)
        return loss, beta * rc.detach(), beta * rr.detach()
    lc, lr = chosen - ref_chosen, rejected - ref_rejected
    if loss == "dpo":
        out = _smoothed_sigmoid(lc - lr, beta, label_smoothing)
    elif loss == "ipo":
        out = (lc / chosen_len.clamp(min=1) - lr / rejected_len.clamp(min=1) - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"pair_losses: unknown loss {loss!r}; one of dpo, ipo, simpo (kto: kto_losses)")
    return out, beta * lc.detach(), beta * lr.detach()


def kto_losses(beta: float, chosen, rejected, ref_chosen, ref_rejected, kl, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0, has_chosen=None, has_rejected=None):
    """KTO (Ethayarajh et al. 2024): per row (weighted loss summed over its examples, its examples, implicit
    rewards).

    A pair is two examples, its chosen answer desirable and its rejected one undesirable; an unpaired row
    (`has_chosen` / `has_rejected` 0 on its absent side) is one. With r = log-ratio to the reference and z
    the KL estimate (`kl`, detached, at least 0), the desirable loss is 1 - sigmoid(beta (r - z)), the
    undesirable one 1 - sigmoid(beta (z - r)), weighted. The batch loss, sum(loss) / sum(examples), is TRL
    KTOTrainer's mean over all its examples."""
    import torch

    lc, lr = chosen - ref_chosen, rejected - ref_rejected
    hc = torch.ones_like(lc) if has_chosen is None else has_chosen.to(lc.dtype)
    hr = torch.ones_like(lr) if has_rejected is None else has_rejected.to(lr.dtype)
    z = kl.detach().clamp(min=0)
    desirable = 1 - torch.sigmoid(beta * (lc - z))
    undesirable = 1 - torch.sigmoid(beta * (z - lr))
    return (desirable_weight * desirable * hc + undesirable_weight * undesirable * hr, hc + hr,
            beta * lc.detach(), beta * lr.detach())


def chosen_nll(chosen, chosen_len, has_chosen):
    """The chosen answers' mean token negative log-likelihood over the batch (TRL's `sft` loss type): summed
    log-probs over summed lengths, rows without a chosen answer left out."""
    return -(chosen * has_chosen).sum() / (chosen_len * has_chosen).sum().clamp(min=1)


def kto_kl(mismatched, ref_mismatched):
    """KTO's reference point: the batch mean of log-ratios of mismatched answers (another prompt's answer
    under this prompt), at least 0 (TRL KTOTrainer's `kl`, per micro-batch here)."""
    return (mismatched - ref_mismatched).mean().clamp(min=0).detach()
