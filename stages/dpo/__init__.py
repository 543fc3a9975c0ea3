"""DPO stage: preference optimisation without a reward model (DPO, IPO, SimPO, KTO) on the preference pairs.

Same runtime shape as `stages.sft` and `stages.reward` (Ray Train V2 `TorchTrainer`, DeepSpeed ZeRO
from YAML, checkpoints that resume, LoRA through PEFT); the loop is its own because what it computes
differs. Each micro-batch of B pairs is one forward pass over 2B sequences (chosen first, then
rejected; KTO adds B mismatched prompt/answer sequences for its KL estimate). A sequence's
log-probability is the sum of its answer tokens' log-probs (the data stage's loss mask:
`sequence_logps`), and the losses are pure functions of those sums (`losses.py`: `pair_losses`,
`kto_losses`), written as TRL writes them (`DPOTrainer` loss_type sigmoid and ipo, `CPOTrainer` loss_type
simpo, `KTOTrainer`) so that a user's beta means what it means there; `tests/test_dpo_oracle.py` checks loss
and gradients against TRL's trainers on the same model and batch.

The reference policy (`reference`):
- `adapter_off` (LoRA only): the model with its adapter switched off, i.e. the start model, at no memory;
- `frozen_copy`: a second copy of the start model, frozen;
- `precomputed`: one pass over this rank's train and eval batches before the first step computes the
  reference log-probs (with the start model, which is the policy before training), kept beside the
  batches and in every checkpoint's trainer state, so training holds one model and does one forward
  per step (TRL's `precompute_ref_log_probs`).
SimPO is reference-free: `reference` is ignored.

Logged every step (rank 0, to the stage's MLflow run): loss, implicit-reward accuracy and margin on the
batch (the implicit reward of an answer is beta x its log-ratio to the reference; SimPO: beta x its mean
token log-prob), chosen / rejected log-probs; the same on the held-out pairs every `eval_every` steps.
At the end, held-out task accuracy (greedy and `eval_samples` sampled answers per prompt, the task
verifier) of the start model and the DPO model, with the paired sign test `ppo` reports.

Run alone: `python -m pipeline run configs/recipes/dpo.yaml --only dpo` (after `sft`).
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from pipeline import events
from pipeline.errors import UserError
from stages.common import train_loop
from stages.common.deepspeed import TrainingConfig, train_check, without_sft
from stages.dpo.losses import _smoothed_sigmoid, chosen_nll, kto_kl, kto_losses, pair_losses  # noqa: F401

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext

LOSSES = ("dpo", "ipo", "simpo", "kto")


class DPOConfig(TrainingConfig):
    """The dpo stage: the shared training fields plus the preference loss, its reference and evaluation."""

    lr: float = Field(1e-4, gt=0, description="Peak learning rate (lower than SFT's: DPO moves a trained policy).")
    warmup_steps: int = Field(5, ge=0, description="Linear warm-up steps from 0 to lr.")
    eval_every: int = Field(10, ge=1, description="Evaluate on the held-out pairs every N optimizer steps.")
    init_from: Literal["sft", "base"] = Field("sft", description="Start (and reference) model: the SFT model or "
                                                                 "the base model.")
    loss: Literal["dpo", "ipo", "simpo", "kto"] = Field(
        "dpo", description="'dpo': -log sigmoid(beta x margin of log-ratios) (TRL loss_type 'sigmoid'); 'ipo': "
        "(margin of per-token log-ratios - 1/(2 beta))^2 (TRL 'ipo'); 'simpo': reference-free, the margin of mean "
        "token log-probs minus simpo_gamma/beta (TRL CPOTrainer 'simpo'); 'kto': each chosen answer desirable and "
        "each rejected one undesirable, against a KL estimate from mismatched pairs (TRL KTOTrainer).")
    beta: float = Field(0.1, gt=0, description="Inverse temperature of the implicit reward (IPO: its regulariser tau).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Assumed share of flipped labels (conservative "
                                   "DPO, cDPO): the loss also rewards the opposite preference with this weight. "
                                   "dpo and simpo only.")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target margin gamma (the logits are shifted by "
                                                      "gamma/beta).")
    sft_weight: float = Field(0.0, ge=0, description="Weight of a language-modelling loss on the chosen answers "
                              "(their mean token negative log-likelihood) added to the preference loss: RPO (Pang et "
                              "al. 2024; TRL loss_type [sigmoid, sft] with loss_weights [1, w]). It keeps the chosen "
                              "answers' own likelihood from falling with the rejected ones', the way DPO fails on "
                              "reasoning tasks.")
    kto_desirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the desirable (chosen) answers' loss.")
    kto_undesirable_weight: float = Field(1.0, gt=0,
                                          description="KTO: weight of the undesirable (rejected) answers' loss.")
    reference: Literal["auto", "adapter_off", "frozen_copy", "precomputed"] = Field(
        "auto", description="The reference policy: 'adapter_off' (LoRA: the model with its adapter off), "
        "'frozen_copy' (a second, frozen copy of the start model), 'precomputed' (reference log-probs computed once "
        "before training and kept with the batches: one model in memory, one forward per step); 'auto': "
        "adapter_off with LoRA, else precomputed. Ignored by simpo.")
    eval_prompts: int = Field(200, ge=0, description="Held-out RL prompts scored by the task verifier before and "
                              "after (0: skip).")
    eval_samples: int = Field(4, ge=0, description="Sampled answers per held-out prompt (0: greedy only).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the held-out sampled answers.")
    max_new_tokens: int = Field(24, ge=1, description="Tokens generated per held-out answer.")

    @model_validator(mode="after")
    def _reference_exists(self) -> "DPOConfig":
        if self.reference == "adapter_off" and self.lora is None:
            raise ValueError("reference adapter_off needs a LoRA adapter to switch off; add stages.dpo.lora or set "
                             "reference: frozen_copy or precomputed")
        if self.label_smoothing and self.loss in ("ipo", "kto"):
            raise ValueError(f"label_smoothing applies to dpo and simpo, not {self.loss}; set label_smoothing: 0")
        return self

    def reference_kind(self) -> str | None:
        """What gives the reference log-probs: None for SimPO (reference-free)."""
        if self.loss == "simpo":
            return None
        if self.reference == "auto":
            return "adapter_off" if self.lora else "precomputed"
        return self.reference


# --------------------------------------------------------------------------- pure helpers (the losses: losses.py)


def sequence_logps(logits, input_ids, mask):
    """Per sequence: (sum of the log-probs of the tokens where `mask` is 1, how many there are).

    Position t's logits predict token t + 1 (a causal LM's shift); `mask` is aligned with `input_ids`
    (the data stage's loss mask: 1 on the answer's tokens). Computed as gathered logit - logsumexp,
    which never materialises a (N, T, V) log-softmax."""
    import torch

    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    m = mask[:, 1:].to(logits.dtype)
    token = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return (token * m).sum(-1), m.sum(-1)


def answer_start(mask: list[int]) -> int:
    """Index of the first answer token of a tokenized conversation (its loss mask's first 1)."""
    return next((i for i, m in enumerate(mask) if m), len(mask))


def completions(batch: dict) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's one answered sequence and its mask: the chosen side, or the rejected one of an unpaired
    undesirable row (whose chosen mask is all 0)."""
    rows = zip(batch["chosen_input_ids"], batch["chosen_loss_mask"], batch["rejected_input_ids"],
               batch["rejected_loss_mask"])
    picked = [(ci, cm) if any(cm) else (ri, rm) for ci, cm, ri, rm in rows]
    return [list(i) for i, _ in picked], [list(m) for _, m in picked]


def mismatched(ids: list[list[int]], masks: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Row i's prompt followed by row i+1's answer (the last row takes the first's): KTO's KL sequences.

    Prompt = the tokens before the answer's first masked token; answer = the rest, with its mask. The
    chat template's tokens after the answer (end of turn) come with it."""
    out_ids, out_masks = [], []
    for i in range(len(ids)):
        j = (i + 1) % len(ids)
        p, a = answer_start(masks[i]), answer_start(masks[j])
        out_ids.append(list(ids[i][:p]) + list(ids[j][a:]))
        out_masks.append([0] * p + list(masks[j][a:]))
    return out_ids, out_masks


def collate(batch: dict, pad_id: int, kto: bool = False) -> dict:
    """B pairs -> one right-padded batch of 2B sequences (chosen first, then rejected) with their answer
    masks; with `kto`, B mismatched sequences after them (`mismatched`). `has_chosen` / `has_rejected`: 0 on
    the absent side of an unpaired row (a completion labelled desirable or undesirable, which the data stage
    stores with that side's mask all 0)."""
    import torch

    from stages.common.training import pad

    ids = [*batch["chosen_input_ids"], *batch["rejected_input_ids"]]
    masks = [*batch["chosen_loss_mask"], *batch["rejected_loss_mask"]]
    if kto:
        kl_ids, kl_masks = mismatched(*completions(batch))
        ids, masks = ids + kl_ids, masks + kl_masks
    input_ids, attention = pad(ids, pad_id)
    mask, _ = pad(masks, 0)
    return {"input_ids": input_ids, "attention_mask": attention, "mask": mask,
            "has_chosen": torch.tensor([float(any(m)) for m in batch["chosen_loss_mask"]]),
            "has_rejected": torch.tensor([float(any(m)) for m in batch["rejected_loss_mask"]])}


def logps(model, batch: dict):
    """(summed answer log-probs, answer lengths) of every sequence of a `collate`d batch."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return sequence_logps(out.logits, batch["input_ids"], batch["mask"])


def batch_loss(cfg: DPOConfig, policy, lengths, ref, batch: dict):
    """The batch's loss, and per row its implicit rewards and log-probs, from the summed log-probs of its
    sequences (`policy`, `ref`: chosen, rejected[, mismatched]; `ref` None for simpo). The mean over pairs;
    KTO's, over examples (an unpaired row is one)."""
    n = lengths.shape[0] // (3 if cfg.loss == "kto" else 2)
    pc, pr = policy[:n], policy[n:2 * n]
    rc, rr = (ref[:n], ref[n:2 * n]) if ref is not None else (None, None)
    parts = {"chosen_logps": pc.detach(), "rejected_logps": pr.detach(),
             "paired": (batch["has_chosen"] * batch["has_rejected"]).to(pc.device)}
    if cfg.loss == "kto":
        kl = kto_kl(policy[2 * n:], ref[2 * n:])
        total, examples, chosen_r, rejected_r = kto_losses(
            cfg.beta, pc, pr, rc, rr, kl, cfg.kto_desirable_weight, cfg.kto_undesirable_weight,
            batch["has_chosen"].to(pc.device), batch["has_rejected"].to(pc.device))
        loss = total.sum() / examples.sum().clamp(min=1)
        parts["kl"] = kl
    else:
        per, chosen_r, rejected_r = pair_losses(cfg.loss, cfg.beta, pc, pr, rc, rr, lengths[:n], lengths[n:2 * n],
                                                cfg.label_smoothing, cfg.simpo_gamma)
        loss = per.mean()
    if cfg.sft_weight:
        loss = loss + cfg.sft_weight * chosen_nll(pc, lengths[:n], batch["has_chosen"].to(pc.device))
    return loss, parts | {"chosen_reward": chosen_r, "rejected_reward": rejected_r}


def batch_metrics(parts: dict) -> dict[str, float]:
    """Sums over a batch's pairs (an unpaired KTO row has nothing to compare): implicit-reward accuracy (chosen
    above rejected; a tie counts a half, so the start model, whose rewards are all 0, scores chance, 0.5) and
    margin, log-probs; KTO's KL estimate (weighted by pairs, like the rest)."""
    c, r, paired = parts["chosen_reward"], parts["rejected_reward"], parts["paired"]
    out = {"reward_accuracy": float((((c > r).float() + 0.5 * (c == r).float()) * paired).sum()),
           "reward_margin": float(((c - r) * paired).sum()),
           "logps_chosen": float((parts["chosen_logps"] * paired).sum()),
           "logps_rejected": float((parts["rejected_logps"] * paired).sum()), "pairs": float(paired.sum())}
    return out | ({"kl": float(parts["kl"]) * out["pairs"]} if "kl" in parts else {})


def averages(sums: dict[str, float]) -> dict[str, float]:
    """Sums over batches (and ranks) -> means: the loss over rows, the rest over pairs (left out with none:
    only unpaired KTO rows)."""
    rows, pairs = sums["rows"], sums["pairs"]
    out = {"loss": sums["loss"] / max(rows, 1.0)}
    if pairs:
        out |= {k: v / pairs for k, v in sums.items() if k not in ("loss", "rows", "pairs")}
    return out


# --------------------------------------------------------------------------- what the Train loop computes


class Reference:
    """The reference log-probs of a batch, however the config says to get them (see the module docstring)."""

    def __init__(self, kind: str | None, engine, init: str):
        self.kind, self.engine, self.frozen = kind, engine, None
        self.stored: dict[str, list] = {}  # precomputed: per split, one tensor per micro-batch, in replay order
        if kind == "frozen_copy":
            import torch

            from stages.common import models

            self.frozen = models.load_model(init, "causal").to(engine.device).eval().requires_grad_(False)
            if next(engine.module.parameters()).dtype == torch.bfloat16:
                self.frozen = self.frozen.to(torch.bfloat16)

    def _forward(self, batch):
        import torch

        with torch.no_grad():
            if self.kind == "adapter_off":
                with self.engine.module.disable_adapter():
                    return logps(self.engine, batch)[0]
            if self.kind == "frozen_copy":
                return logps(self.frozen, batch)[0]
            return logps(self.engine, batch)[0]  # precomputing: the policy before its first step

    def precompute(self, splits: dict, say) -> None:
        """Every micro-batch's reference log-probs, before the first step (precomputed only)."""
        self.engine.eval()
        for name, batches in splits.items():
            self.stored[name] = [self._forward(b).cpu() for b in batches]
            say(f"reference log-probs precomputed for {len(self.stored[name])} {name} micro-batches")
        self.engine.train()

    def state(self) -> dict:
        return {name: [t.tolist() for t in ts] for name, ts in self.stored.items()}

    def load(self, state: dict) -> None:
        import torch

        self.stored = {name: [torch.tensor(t) for t in ts] for name, ts in state.items()}

    def __call__(self, batch, split: str, index: int):
        if self.kind is None:
            return None
        if self.kind == "precomputed":
            return self.stored[split][index].to(self.engine.device)
        return self._forward(batch)


def _evaluate(engine, batches, reference: Reference, cfg: DPOConfig) -> dict[str, float]:
    """Loss, implicit-reward accuracy and margin, chosen / rejected log-probs, over every rank's eval pairs."""
    import torch

    from stages.common.training import all_reduce_sum

    engine.eval()
    sums: dict[str, float] = {}
    with torch.no_grad():
        for i, batch in enumerate(batches):
            policy, lengths = logps(engine, batch)
            loss, parts = batch_loss(cfg, policy, lengths, reference(batch, "eval", i), batch)
            rows = parts["chosen_reward"].shape[0]
            for k, v in (batch_metrics(parts) | {"loss": loss.item() * rows, "rows": float(rows)}).items():
                sums[k] = sums.get(k, 0.0) + v
    engine.train()
    totals = dict(zip(sums, all_reduce_sum(list(sums.values()))))
    return {f"eval_{k}": v for k, v in averages(totals).items()}


def _gather_reference(reference: Reference, rank: int, world: int) -> list | None:
    """Every rank's precomputed log-probs, for rank 0's trainer state (a resume gives each rank its own)."""
    import torch.distributed as dist

    if reference.kind != "precomputed":
        return None
    parts = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(parts, reference.state())
    else:
        parts[rank] = reference.state()
    return parts


class Objective(train_loop.Objective):
    """The configured preference loss against the reference; logged per step: its parts averaged over every
    rank's rows, the learning rate and the seconds of each phase (the reference's among them); evaluated: the
    same on the held-out pairs."""

    config = DPOConfig
    phases = True

    def collate(self, cfg, c: dict, split: str):
        return partial(collate, pad_id=c["pad_id"], kto=cfg.loss == "kto")

    def prepare(self, engine, cfg, c: dict, init: Path, splits: dict, state: dict, log, clock, rank: int,
                world: int) -> None:
        self.reference, self.sums = Reference(cfg.reference_kind(), engine, init), {}
        clock.mark("reference")  # a frozen copy loaded (none for the other kinds)
        if self.reference.kind == "precomputed":
            if state.get("reference"):
                self.reference.load(state["reference"][rank])
            else:  # its time is a metric: the cost of holding one model instead of two
                t0 = time.time()
                self.reference.precompute(splits, log.print)
                log.log({"reference_precompute_s": time.time() - t0}, 0)
            clock.mark("reference_precompute", counted=False)  # the steps' reference passes, done up front
        self.saved = _gather_reference(self.reference, rank, world)

    def loss(self, engine, batch: dict, micro: int, phases: dict):
        t0 = time.time()
        ref = self.reference(batch, "train", micro - 1)
        t1 = time.time()
        policy, lengths = logps(engine, batch)
        loss, parts = batch_loss(self.cfg, policy, lengths, ref, batch)
        phases["reference"] = phases.get("reference", 0.0) + t1 - t0
        phases["forward"] = phases.get("forward", 0.0) + time.time() - t1
        rows = parts["chosen_reward"].shape[0]
        for k, v in (batch_metrics(parts) | {"loss": loss.item() * rows, "rows": float(rows)}).items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        return loss

    def step_metrics(self, engine, busy: float, world: int) -> dict:
        from stages.common.training import all_reduce_sum

        totals = dict(zip(self.sums, all_reduce_sum(list(self.sums.values()))))
        self.sums = {}
        return {f"train_{k}": v for k, v in averages(totals).items()} | {"lr": engine.get_lr()[0], "step_time_s": busy}

    def evaluate(self, engine, batches) -> dict:
        return _evaluate(engine, batches, self.reference, self.cfg)

    def state(self) -> dict:
        return {"reference": self.saved}


# --------------------------------------------------------------------------- the stage: held-out task accuracy


def task_accuracy(start: Path, tuned: Path, rows: list[dict], cfg: DPOConfig, verifier: str, seed: int,
                  storage) -> dict[str, float]:
    """Held-out task accuracy of the start model and the DPO model: greedy and sampled answers (a vLLM engine
    per model, `stages.common.evaluation`), scored by the task verifier, compared prompt by prompt with a
    paired sign test (`eval_accuracy_before`, `eval_accuracy`, `eval_accuracy_sign_test_p`, and the same
    with `sampled_`)."""
    from stages.common.evaluation import compare, engine_answers, per_prompt_accuracy

    measures = {"accuracy": {"temperature": 0.0, "max_tokens": cfg.max_new_tokens}}
    if cfg.eval_samples:  # a fixed seed: both models draw from the same random stream
        measures["sampled_accuracy"] = {"n": cfg.eval_samples, "temperature": cfg.temperature,
                                        "max_tokens": cfg.max_new_tokens, "seed": 12345}
    outs = engine_answers([start, tuned], [r["prompt_ids"] for r in rows], list(measures.values()), seed, storage)
    before, after = ({name: per_prompt_accuracy(answers, rows, verifier) for name, answers in zip(measures, out)}
                     for out in outs)
    return {"eval_prompts": len(rows), **compare(before, after)}


def check(pipeline_cfg) -> None:
    """`init_from: sft` needs an sft stage; a local Ray with GPUs, one per worker."""
    train_check("dpo", pipeline_cfg)


wire = without_sft  # without an sft stage, it starts from the base model


def run(cfg: DPOConfig, ctx: StageContext) -> dict[str, Path]:
    """Train with TorchTrainer, export the HF model, score held-out task accuracy before and after."""
    from stages.common.deepspeed import total_steps
    from stages.common.lora import describe
    from stages.common.parquet import read_rows
    from stages.common.training import export

    clock = events.StartupClock()
    data = ctx.inputs["preference_data"]
    init = ctx.inputs["sft_model"] if cfg.init_from == "sft" else ctx.inputs["base_model"]
    meta = json.loads((data / "meta.json").read_text())
    n_pairs, unpaired = meta["rows"]["train"], sum(meta.get("unpaired", {}).values())
    if unpaired and cfg.loss != "kto":
        raise UserError(f"stages.dpo: {unpaired} preference rows are unpaired (one completion labelled desirable or "
                        f"undesirable), which loss {cfg.loss} cannot train on; set stages.dpo.loss: kto, or give "
                        "prompt/chosen/rejected pairs")
    steps = total_steps(n_pairs, cfg)
    if steps < 1:
        raise UserError(f"stages.dpo: {n_pairs} training pairs make no full optimizer step with batch_size "
                        f"{cfg.batch_size}; lower stages.dpo.batch_size or give more preference pairs")
    reference = cfg.reference_kind() or "none (reference-free)"
    result, tok = train_loop.train(
        Objective(), cfg, ctx, init, data, steps, lambda precision: f"{cfg.loss} on {n_pairs} pairs: {steps} steps on "
        f"{cfg.num_workers} worker{'s' if cfg.num_workers != 1 else ''} (ZeRO-{cfg.deepspeed.zero_stage}, {precision}, "
        f"beta {cfg.beta:g}, reference "
        f"{reference}, init from {cfg.init_from}{describe(cfg.lora)})", clock)
    out = ctx.out_dir / "model"
    metrics = export(result, out, tok, init, "causal")  # a LoRA adapter is merged into `init` here
    ctx.progress(f"held-out implicit-reward accuracy {metrics.get('eval_reward_accuracy', float('nan')):.3f}, "
                 f"margin {metrics.get('eval_reward_margin', float('nan')):.3f}")
    rows = read_rows(ctx.inputs["prompt_data"] / "eval", cfg.eval_prompts)
    if rows:
        ctx.progress(f"scoring answers on {len(rows)} held-out prompts (greedy, {cfg.eval_samples} sampled each)")
        ctx.ray()  # the engines are Ray actors; one worker trained without Ray (train_loop.train)
        metrics.update(task_accuracy(init, out, rows, cfg, ctx.pipeline.task.verifier, ctx.pipeline.seed,
                                     ctx.storage))
        line = (f"greedy accuracy {metrics['eval_accuracy_before']:.3f} -> {metrics['eval_accuracy']:.3f} "
                f"(p={metrics['eval_accuracy_sign_test_p']:.3g})")
        if "eval_sampled_accuracy" in metrics:
            line += (f", sampled {metrics['eval_sampled_accuracy_before']:.3f} -> "
                     f"{metrics['eval_sampled_accuracy']:.3f} (p={metrics['eval_sampled_accuracy_sign_test_p']:.3g})")
        ctx.progress(line)
    ctx.log_metrics(metrics, step=steps)
    return {"dpo_model": out}
