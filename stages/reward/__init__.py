"""Reward stage: a Bradley-Terry reward model trained on the preference pairs.

Same runtime shape as `stages.sft` (Ray Train V2 `TorchTrainer`, DeepSpeed ZeRO from YAML, Ray Data shards,
checkpoints that resume): the loop is repeated here rather than shared through hooks, because what it computes
differs. The model is a sequence classifier with one output per score head (`AutoModelForSequenceClassification`,
`num_labels=heads`, 1 by default) initialised from the SFT model by default; chosen and rejected answers go through
one forward pass and the loss is `-log sigmoid(r_chosen - r_rejected)` (`losses.py`, held to TRL's RewardTrainer by
tests/test_reward_losses.py). Evaluation: pairwise accuracy (share of held-out pairs with r_chosen > r_rejected) and
mean margin. With `heads: K` the classifier has K outputs, each a reward model of its own trained on a bootstrap
resample of the pairs (`bootstrap_weights`), and evaluation reads their mean; PPO combines them conservatively
(`training.ensemble_score`). Heads on one backbone rather than K separate models: K times cheaper (Zhang et al.
2024, "Improving Reinforcement Learning from Human Feedback with Efficient Reward Model Ensemble"). The price: heads
share every feature, and on the gold task their spread fell as the policy drifted (bench/RESULTS.md, 2026-11-28), so
they guard less than separately trained models would. With a gold preference (`task.preference.gold`), the held-out
pairs are also re-labelled by the gold function and `eval_accuracy_gold` reported beside `eval_accuracy`, which is
against the data's (noisy) labels: a reward model that learned the preference rather than the noise scores higher
against gold than against its own labels.

`lm_loss_weight` adds a language-modelling loss on the chosen answers (the hidden-state
regularisation of "Generalizable Reward Models", Yang et al. 2024). Why: the score is read at the
sequence's last token, but what the SFT model knows about the answer sits at the positions that
predict it; pure Bradley-Terry fine-tuning erodes that knowledge faster than the score head learns
to use it. On the embedded default the reward model without it judged "off by one" pairs at chance
(0.5-0.6) although the SFT model's own log-probs rank them at 0.8 (bench/RESULTS.md;
docs/architecture.md, fact 14).

Run alone: `python -m pipeline run configs/full.yaml --only reward` (after `sft`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from pipeline import events
from pipeline.errors import UserError
from stages.common import train_loop
from stages.common.deepspeed import TrainingConfig, train_check, without_sft
from stages.reward.losses import bradley_terry_loss, lm_loss

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext


class RewardConfig(TrainingConfig):
    """The reward stage: the shared training fields plus where the model starts."""

    init_from: Literal["sft", "base"] = Field("sft", description="Initialise from the SFT model or the base model.")
    heads: int = Field(1, ge=1, le=16, description="Score heads on the one backbone: an ensemble of reward models "
                       "for the cost of one. Each head starts from its own random init and trains on its own "
                       "bootstrap resample of the pairs (each pair weighted Poisson(1) per head); the reported "
                       "accuracy is the heads' mean's. PPO combines them by `stages.ppo.rewards.ensemble` (mean, "
                       "min, or mean - k std), the standard guard against over-optimising one reward model.")
    lm_loss_weight: float = Field(
        0.0, ge=0, description="Weight of a language-modelling loss on the chosen answers added to the Bradley-Terry "
        "loss (0: pure Bradley-Terry). It keeps the model's knowledge of good answers while the score head learns; "
        "with untied embeddings the init model's LM head is used frozen.")

    @model_validator(mode="after")
    def _lm_loss_needs_whole_weights(self) -> "RewardConfig":
        if self.lm_loss_weight > 0 and self.deepspeed.zero_stage == 3:
            raise ValueError("lm_loss_weight > 0 reads the embedding matrix outside the model's forward, which "
                             "ZeRO-3 partitions; use deepspeed.zero_stage 2 or set lm_loss_weight: 0")
        return self


# --------------------------------------------------------------------------- pure helpers (the losses: losses.py)


def pair_key(chosen_ids, rejected_ids) -> int:
    """A stable integer naming a pair by its tokens (the same on every rank, epoch and resume)."""
    import zlib

    # ints first: the batches hold numpy arrays, whose repr differs by dtype and numpy version
    return zlib.crc32(repr(([int(x) for x in chosen_ids], [int(x) for x in rejected_ids])).encode())


def bootstrap_weights(keys: list[int], heads: int, seed: int) -> list[list[float]]:
    """Per pair and head, the pair's weight in that head's bootstrap resample: Poisson(1) draws (the
    online bootstrap of Oza & Russell 2001), fixed by the pair's key, the head and the seed, so a
    head sees the same resample in every epoch and after a resume. One head: every weight 1 (no
    resampling: one reward model is trained on all the data)."""
    import numpy as np

    if heads == 1:
        return [[1.0] for _ in keys]
    return [[float(np.random.default_rng([seed, key, h]).poisson(1.0)) for h in range(heads)] for key in keys]


def collate(batch: dict, pad_id: int) -> dict:
    """B pairs -> one padded batch of 2B sequences: chosen first, then rejected.

    `lm_mask` marks the chosen answers' tokens (the data stage's loss mask), zero on rejected rows.
    """
    from stages.common.training import pad

    input_ids, attention = pad([*batch["chosen_input_ids"], *batch["rejected_input_ids"]], pad_id)
    masks = [*batch["chosen_loss_mask"], *[[0] * len(ids) for ids in batch["rejected_input_ids"]]]
    lm_mask, _ = pad(masks, 0)
    keys = [pair_key(c, r) for c, r in zip(batch["chosen_input_ids"], batch["rejected_input_ids"])]
    return {"input_ids": input_ids, "attention_mask": attention, "lm_mask": lm_mask, "pair_key": keys}


def gold_signs(prompts, chosen, rejected, gold) -> list[int]:
    """Per pair: +1 where the gold preference prefers the stored `chosen`, -1 where it prefers `rejected`
    (a flipped label), 0 on a tie (left out of the gold accuracy)."""
    out = []
    for p, c, r in zip(prompts, chosen, rejected):
        gc, gr = float(gold(str(p), str(c))), float(gold(str(p), str(r)))
        out.append((gc > gr) - (gc < gr))
    return out


def collate_eval(batch: dict, pad_id: int, gold_spec: str | None) -> dict:
    """`collate`, plus each pair's `gold_sign` when a gold preference is set."""
    import torch

    out = collate(batch, pad_id)
    if gold_spec:
        from stages.common.tasks import gold_function

        signs = gold_signs(batch["prompt"], batch["chosen"], batch["rejected"], gold_function(gold_spec))
        out["gold_sign"] = torch.tensor(signs)
    return out


def _rewards(engine, batch):
    """(chosen, rejected) scores, (B, K): a column per head."""
    r = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    half = r.shape[0] // 2
    return r[:half], r[half:]


def lm_head_for(model, init: str):
    """The output projection for `lm_loss`: the (trained) input embeddings when tied, else the init model's
    LM head, frozen (a sequence classifier has no LM head of its own)."""
    from stages.common import models

    if getattr(model.config, "tie_word_embeddings", False):
        return model.get_input_embeddings().weight
    lm = models.load_model(init, "causal")
    return lm.get_output_embeddings().weight.detach().clone()


def capture_score_input(model) -> dict:
    """Record the input of the classifier head (the final hidden states, every position) on each forward.

    HF's `*ForSequenceClassification` apply `model.score` to every position before pooling the last
    one, so a forward hook gives the LM loss its hidden states without a second forward pass.
    """
    head = getattr(model, "score", None)
    if head is None:
        raise UserError(f"stages.reward.lm_loss_weight: {type(model).__name__} has no `score` head to read hidden "
                        "states from; set lm_loss_weight: 0")
    captured: dict = {}
    head.register_forward_hook(lambda _m, args, _out: captured.__setitem__("hidden", args[0]))
    return captured


# --------------------------------------------------------------------------- what the Train loop computes


def _evaluate(engine, batches) -> dict[str, float]:
    """Pairwise accuracy, mean margin and loss over every rank's eval shard; with gold signs, the accuracy
    against the gold labels too."""
    import torch

    from stages.common.training import all_reduce_sum

    engine.eval()
    correct = margin = loss = n = gold_correct = gold_n = 0.0
    with torch.no_grad():
        for batch in batches:
            rc, rr = (r.mean(-1) for r in _rewards(engine, batch))  # an ensemble is judged by its mean
            correct += float((rc > rr).sum())
            margin += float((rc - rr).sum())
            loss += float(bradley_terry_loss(rc, rr)) * len(rc)
            n += len(rc)
            if "gold_sign" in batch:
                sign = batch["gold_sign"]
                gold_correct += float(((rc > rr) == (sign > 0))[sign != 0].sum())
                gold_n += float((sign != 0).sum())
    engine.train()
    correct, margin, loss, n, gold_correct, gold_n = all_reduce_sum([correct, margin, loss, n, gold_correct, gold_n])
    out = {"eval_accuracy": correct / max(n, 1), "eval_margin": margin / max(n, 1), "eval_loss": loss / max(n, 1)}
    return out | ({"eval_accuracy_gold": gold_correct / gold_n} if gold_n else {})


class Objective(train_loop.Objective):
    """Bradley-Terry on the pairs (each score head on its bootstrap weights), plus the LM loss on the chosen
    answers when `lm_loss_weight` > 0; logged per step: the loss, pairwise accuracy, the LM loss, the learning
    rate; evaluated: pairwise accuracy, margin and loss (and against the gold labels)."""

    config = RewardConfig
    kind = "sequence"

    def model_args(self, cfg, c: dict) -> tuple:
        return c["pad_id"], cfg.heads

    def model(self, cfg, c: dict, init: Path):
        from stages.common import lora

        model = super().model(cfg, c, init)  # with LoRA an adapter on the backbone; the score head trains in full
        self.head, self.captured = None, {}
        if cfg.lm_loss_weight > 0:  # after wrapping: LoRA replaces the score head by the copy it trains
            self.head, self.captured = lm_head_for(lora.base_of(model), init), capture_score_input(lora.base_of(model))
        return model

    def collate(self, cfg, c: dict, split: str):
        if split == "eval":
            return partial(collate_eval, pad_id=c["pad_id"], gold_spec=c.get("gold"))
        return partial(collate, pad_id=c["pad_id"])

    def loss(self, engine, batch: dict, micro: int, phases: dict):
        import torch

        rc, rr = _rewards(engine, batch)
        weights = torch.tensor(bootstrap_weights(batch["pair_key"], self.cfg.heads, self.c["seed"]), dtype=rc.dtype,
                               device=rc.device)
        loss = self.bt = bradley_terry_loss(rc, rr, weights)
        self.accuracy = float((rc.mean(-1) > rr.mean(-1)).float().mean())
        if self.head is not None:
            self.lm = lm_loss(self.captured.pop("hidden"), self.head, batch["input_ids"], batch["lm_mask"])
            loss = self.bt + self.cfg.lm_loss_weight * self.lm
        return loss

    def step_metrics(self, engine, busy: float, world: int) -> dict:
        metrics = {"train_loss": self.bt.item(), "train_accuracy": self.accuracy, "lr": engine.get_lr()[0],
                   "step_time_s": busy}
        return metrics | ({"train_lm_loss": self.lm.item()} if self.head is not None else {})

    def evaluate(self, engine, batches) -> dict:
        return _evaluate(engine, batches)


# --------------------------------------------------------------------------- the stage


def check(pipeline_cfg) -> None:
    """`init_from: sft` needs an sft stage; a local Ray with GPUs, one per worker."""
    train_check("reward", pipeline_cfg)


wire = without_sft  # without an sft stage, it starts from the base model


def run(cfg: RewardConfig, ctx: StageContext) -> dict[str, Path]:
    """Train with TorchTrainer and export the HF sequence-classification model."""
    from stages.common.deepspeed import total_steps
    from stages.common.lora import describe
    from stages.common.training import export

    clock = events.StartupClock()
    data = ctx.inputs["preference_data"]
    init = ctx.inputs["sft_model"] if cfg.init_from == "sft" else ctx.inputs["base_model"]
    meta = json.loads((data / "meta.json").read_text())
    n_pairs, unpaired = meta["rows"]["train"], sum(meta.get("unpaired", {}).values())
    if unpaired:
        raise UserError(f"stages.reward: {unpaired} preference rows are unpaired (one completion labelled desirable or "
                        "undesirable); a reward model trains on pairs. Give prompt/chosen/rejected rows, or train on "
                        "labelled rows with stages.dpo (loss: kto) and set stages.reward: null")
    steps = total_steps(n_pairs, cfg)
    if steps < 1:
        raise UserError(f"stages.reward: {n_pairs} training pairs make no full optimizer step with batch_size "
                        f"{cfg.batch_size}; lower stages.reward.batch_size or generate more pairs")
    heads = f", {cfg.heads} score heads on bootstrap resamples" if cfg.heads > 1 else ""
    result, tok = train_loop.train(
        Objective(), cfg, ctx, init, data, steps, lambda precision: f"training {steps} steps on {cfg.num_workers} "
        f"worker{'s' if cfg.num_workers != 1 else ''} (ZeRO-{cfg.deepspeed.zero_stage}, {precision}, {n_pairs} pairs, "
        f"init from {cfg.init_from}"
        f"{describe(cfg.lora)}{heads})", clock, gold=ctx.pipeline.task.preference.gold)
    out = ctx.out_dir / "model"
    metrics = export(result, out, tok, init, "sequence", cfg.heads)  # a LoRA adapter is merged into `init` here
    gold = f", against the gold labels {metrics['eval_accuracy_gold']:.3f}" if "eval_accuracy_gold" in metrics else ""
    ctx.progress(f"held-out pairwise accuracy {metrics.get('eval_accuracy', float('nan')):.3f}{gold}, "
                 f"mean margin {metrics.get('eval_margin', float('nan')):.3f}")
    ctx.log_metrics(metrics, step=steps)
    return {"reward_model": out}
