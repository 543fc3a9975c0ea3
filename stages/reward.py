"""Reward stage: a Bradley-Terry reward model trained on the preference pairs.

Same runtime shape as `stages.sft` (Ray Train V2 `TorchTrainer`, DeepSpeed ZeRO from YAML, Ray
Data shards, checkpoints that resume): the loop is repeated here rather than shared through hooks,
because what it computes differs. The model is a sequence classifier with one output per score
head (`AutoModelForSequenceClassification`, `num_labels=heads`, 1 by default) initialised from the
SFT model by default;
chosen and rejected answers go through one forward pass and the loss is
`-log sigmoid(r_chosen - r_rejected)`. Evaluation: pairwise accuracy (share of held-out pairs
with r_chosen > r_rejected) and mean margin. With `heads: K` the classifier has K outputs, each a
reward model of its own trained on a bootstrap resample of the pairs (`bootstrap_weights`), and
evaluation reads their mean; PPO combines them conservatively (`training.ensemble_score`). Heads on
one backbone rather than K separate models: K times cheaper (Zhang et al. 2024, "Improving
Reinforcement Learning from Human Feedback with Efficient Reward Model Ensemble"). The price: heads
share every feature, and on the gold task their spread fell as the policy drifted (bench/RESULTS.md,
2026-11-28), so they guard less than separately trained models would. With a gold preference (`task.preference.gold`), the
held-out pairs are also re-labelled by the gold function and `eval_accuracy_gold` reported beside
`eval_accuracy`, which is against the data's (noisy) labels: a reward model that learned the
preference rather than the noise scores higher against gold than against its own labels.

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
import os
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from pipeline import events
from pipeline.errors import UserError
from stages.common.deepspeed import TrainingConfig, needs_sft, without_sft

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


# --------------------------------------------------------------------------- pure helpers


def bradley_terry_loss(r_chosen, r_rejected, weights=None):
    """Mean of -log sigmoid(r_chosen - r_rejected): the pair's log-likelihood under Bradley-Terry.

    Scores (B,) or (B, K) for K heads; with `weights` (the shape of the scores: each head's bootstrap
    weights) it is the weighted mean over every (pair, head), sum(w * nll) / sum(w)."""
    import torch.nn.functional as F

    nll = -F.logsigmoid(r_chosen - r_rejected)
    if weights is None:
        return nll.mean()
    return (nll * weights).sum() / weights.sum().clamp(min=1.0)


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


# --------------------------------------------------------------------------- worker loop


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


def train_loop(c: dict) -> None:
    """One Ray Train worker: DeepSpeed engine, resume, train, eval, checkpoint."""
    clock = c["startup"]  # events.StartupClock, started with the stage on the driver
    clock.mark("workers")  # Ray Train's controller, the worker processes, their process group
    from stages.common import startup

    startup.lean_imports()  # before anything loads transformers (stages/common/startup.py)
    import torch

    from stages.common import lora, models, training

    rank, world = training.worker_rank()
    training.set_threads(world)
    cfg = RewardConfig.model_validate(c["cfg"])
    torch.manual_seed(c["seed"])
    log = events.RankZeroLogger(c["tracking_uri"], c["run_id"], rank, c["name"])
    startup.import_deepspeed()  # lean: without the optional imports no rank uses
    clock.mark("imports")
    init = c["storage"].localize(c["init"])  # a node without a shared run_dir pulls it from the object store
    model = models.load_model(init, "sequence", c["pad_id"], cfg.heads)
    if cfg.deepspeed.activation_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.lora:  # an adapter on the backbone; the score head trains in full
        model = lora.wrap(model, cfg.lora, "sequence", cfg.deepspeed.activation_checkpointing)
    head, captured = None, {}
    if cfg.lm_loss_weight > 0:  # after wrapping: LoRA replaces the score head by the copy it trains
        head, captured = lm_head_for(lora.base_of(model), init), capture_score_input(lora.base_of(model))
    clock.mark("model")
    engine = training.init_engine(model, c["ds_config"])
    clock.mark("deepspeed")
    state = training.restore(engine)
    clock.mark("restore")
    total, pad_id = c["total_steps"], c["pad_id"]
    # This rank's batches of each split, read once and replayed (the same batches at every pass).
    collate_fn = partial(collate, pad_id=pad_id)
    trains = training.ReplayBatches(training.split(c, "train"), cfg.micro_batch_size, collate_fn, rank, world)
    evals = training.EvalBatches(training.split(c, "eval"), cfg.micro_batch_size,
                                 partial(collate_eval, pad_id=pad_id, gold_spec=c.get("gold")), rank, world)
    if state["step"] == 0:
        first = _evaluate(engine, evals)
        log.log(first, 0)
        log.step(0, total, first)
        clock.mark("evaluation", counted=False)
    fault_at = int(os.environ.get("PIPELINE_FAULT_AFTER_STEP", "0"))
    fault_armed = fault_at > state["step"]
    metrics: dict = {}
    for epoch in range(state["epoch"], cfg.epochs):
        skip = state["micro_in_epoch"] if epoch == state["epoch"] else 0
        busy, micro = 0.0, 0
        for batch in trains:
            micro += 1
            if micro <= skip:
                continue
            if engine.global_steps >= total:
                break
            training.first_step(clock, log)  # the first one ends the start-up: shown and logged once
            t0 = time.time()
            rc, rr = _rewards(engine, batch)
            weights = torch.tensor(bootstrap_weights(batch["pair_key"], cfg.heads, c["seed"]), dtype=rc.dtype,
                                   device=rc.device)
            loss = bt = bradley_terry_loss(rc, rr, weights)
            if head is not None:
                lm = lm_loss(captured.pop("hidden"), head, batch["input_ids"], batch["lm_mask"])
                loss = bt + cfg.lm_loss_weight * lm
            engine.backward(loss)
            before = engine.global_steps
            engine.step()
            busy += time.time() - t0
            if engine.global_steps == before:
                continue
            step = engine.global_steps
            metrics = {"train_loss": bt.item(), "train_accuracy": float((rc.mean(-1) > rr.mean(-1)).float().mean()),
                       "lr": engine.get_lr()[0], "step_time_s": busy}
            if head is not None:
                metrics["train_lm_loss"] = lm.item()
            busy = 0.0
            if step % cfg.eval_every == 0 or step == total:
                metrics.update(_evaluate(engine, evals))
            log.log(metrics, step)
            log.step(step, total, metrics)  # every step goes to MLflow; the console shows progress
            state = {"step": step, "epoch": epoch, "micro_in_epoch": micro}
            if step == total:
                metrics.update(training.peak_memory(rank, world))
            if step % cfg.checkpoint_every == 0 or step == total:
                training.report(engine, state, {"step": step, **metrics, **clock.metrics()}, rank, with_checkpoint=True)
                if fault_armed and step >= fault_at:
                    raise RuntimeError(f"injected fault after step {step} (PIPELINE_FAULT_AFTER_STEP)")
            elif "eval_loss" in metrics:  # eval results reach a sweep's scheduler (ASHA) between checkpoints
                training.report(engine, state, {"step": step, **metrics}, rank, with_checkpoint=False)
        state = {"step": engine.global_steps, "epoch": epoch + 1, "micro_in_epoch": 0}
        if engine.global_steps >= total:
            break
    if not metrics:  # resumed after the last step: report the final state again so the run ends on it
        training.report(engine, state, {"step": engine.global_steps, **training.peak_memory(rank, world)}, rank,
                        with_checkpoint=True)


# --------------------------------------------------------------------------- the stage


def check(pipeline_cfg) -> None:
    """`init_from: sft` needs an sft stage."""
    needs_sft("reward", pipeline_cfg)


wire = without_sft  # without an sft stage, it starts from the base model


def run(cfg: RewardConfig, ctx: StageContext) -> dict[str, Path]:
    """Train with TorchTrainer and export the HF sequence-classification model."""
    from stages.common.deepspeed import deepspeed_config, total_steps, use_bf16, use_gpu
    from stages.common.training import export, fit, tokenizer_and_ray
    from stages.common.lora import describe

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
    gpu = use_gpu()
    bf16 = use_bf16(cfg.deepspeed, gpu)
    ds_config = deepspeed_config(cfg, steps, bf16)
    ctx.log_dict(ds_config, "deepspeed_config.json")
    clock.mark("driver")
    tok = tokenizer_and_ray(init, ctx)
    clock.mark("ray")  # the tokenizer loaded meanwhile
    clock.processes = cfg.num_workers + 1  # Ray Train's controller and its workers
    heads = f", {cfg.heads} score heads on bootstrap resamples" if cfg.heads > 1 else ""
    ctx.progress(f"training {steps} steps on {cfg.num_workers} workers (ZeRO-{cfg.deepspeed.zero_stage}, "
                 f"{'bf16' if bf16 else 'fp32'}, {n_pairs} pairs, init from {cfg.init_from}{describe(cfg.lora)}{heads})")
    result = fit(train_loop, {
        "cfg": cfg.model_dump(mode="json"), "seed": ctx.pipeline.seed, "init": str(init), "ds_config": ds_config,
        "total_steps": steps, "pad_id": tok.pad_token_id, "tracking_uri": ctx.pipeline.tracking_uri,
        "run_id": ctx.run_id, "name": ctx.name, "startup": clock, "gold": ctx.pipeline.task.preference.gold,
    }, cfg, {"train": data / "train", "eval": data / "eval"},
        ctx.checkpoint_dir, ctx.storage, gpu, ctx.train_callbacks())
    out = ctx.out_dir / "model"
    metrics = export(result, out, tok, init, "sequence", cfg.heads)  # a LoRA adapter is merged into `init` here
    gold = f", against the gold labels {metrics['eval_accuracy_gold']:.3f}" if "eval_accuracy_gold" in metrics else ""
    ctx.progress(f"held-out pairwise accuracy {metrics.get('eval_accuracy', float('nan')):.3f}{gold}, "
                 f"mean margin {metrics.get('eval_margin', float('nan')):.3f}")
    ctx.log_metrics(metrics, step=steps)
    return {"reward_model": out}
