"""SFT stage: supervised fine-tuning of the base model on the data stage's conversations.

Runs inside Ray Train V2's `TorchTrainer` (`num_workers` data-parallel ranks, gloo on CPU, NCCL on
GPU) with DeepSpeed ZeRO 0-3 configured from YAML (`stages.common.deepspeed`). Batches come from
the data stage's Parquet through Ray Data (each rank's slice of every global batch,
`training.rank_batches`, so reruns train on the same batches; read once, then replayed from memory
every epoch, `training.ReplayBatches`); the loss
covers only assistant tokens (the data stage's `loss_mask`). Rank 0 logs train loss, learning
rate and tokens/s every step and the eval loss every `eval_every` steps to the stage's MLflow run;
at the end the driver scores greedy answers of the base and the tuned model on held-out prompts
with the task verifier. Checkpoints are reported to Ray Train; an interrupted stage resumes from
the latest one (model, optimizer, scheduler and position in the data).

Run alone: `python -m pipeline run configs/full.yaml --only sft` (after `data`).
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from pipeline import events
from pipeline.errors import UserError
from stages.common.deepspeed import TrainingConfig

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext


class SFTConfig(TrainingConfig):
    """The sft stage: the shared training fields plus evaluation settings."""

    accuracy_prompts: int = Field(200, ge=0, description="Held-out prompts scored by the task verifier at the end (0: skip).")
    max_new_tokens: int = Field(24, ge=1, description="Tokens generated per held-out prompt when scoring accuracy.")
    accuracy_engine: Literal["hf", "vllm"] = Field(
        "hf", description="What generates the held-out answers: 'hf' (transformers `generate` in the driver: no "
        "start-up, right for a few hundred short answers of a small model) or 'vllm' (one vLLM engine actor per "
        "model, base and tuned at once: ~20 s to start, then several times faster; the engines the ppo stage "
        "evaluates with, so both stages' greedy accuracies come from the same kind of engine).")


# --------------------------------------------------------------------------- pure helpers


def collate(batch: dict, pad_id: int) -> dict:
    """Data-stage rows -> tensors; labels are -100 wherever the loss mask is 0. Feed them to the model
    with `forward`, which treats packed rows as what they are.

    Packed rows (`stages.data.pack`) carry `position_ids` restarting at 0 for each conversation. The
    first token of a conversation is never a target (its label is -100): in a packed row the token
    before it is the previous conversation's last, which does not predict it (unpacked, position 0
    is never a target either). Padding at the end of a row gets position 0, one padding token per
    "conversation" of its own. `attention_mask` (1 on real tokens) is kept for counting tokens.
    """
    import torch

    from stages.common.training import pad

    input_ids, attention = pad(batch["input_ids"], pad_id)
    mask, _ = pad(batch["loss_mask"], 0)
    labels = torch.where(mask.bool(), input_ids, torch.full_like(input_ids, -100))
    out = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
    if "position_ids" in batch:  # packed rows: positions restart per conversation
        out["position_ids"], _ = pad(batch["position_ids"], 0)
        labels[out["position_ids"] == 0] = -100
    return out


def forward(model, batch: dict):
    """The model's output (loss, logits) on a `collate`d batch: every forward pass of SFT goes through here.

    A packed batch goes in without its 2-D attention mask and without a KV cache: only then does
    transformers build the block-diagonal causal mask from the restarting `position_ids`
    (`masking_utils.find_packed_sequence_indices`; with a 2-D mask, or with the cache it creates by
    default even in training, it builds a plain causal mask over the whole row, and every packed
    conversation attends to the ones before it). Padding needs no mask: it sits at the end of the row,
    after every real token, and each padding token is a sequence of its own. Tested: a packed row's
    logits equal those of its conversations run alone (eager and sdpa attention).
    """
    if "position_ids" in batch:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=False)
    return model(**batch)


# --------------------------------------------------------------------------- worker loop


def _eval_loss(engine, batches) -> float:
    """Token-weighted mean loss over every rank's eval shard."""
    import torch

    from stages.common.training import all_reduce_sum

    engine.eval()
    total = count = 0.0
    with torch.no_grad():
        for batch in batches:
            n = float((batch["labels"][:, 1:] != -100).sum())
            total += float(forward(engine, batch).loss) * n
            count += n
    engine.train()
    total, count = all_reduce_sum([total, count])
    return total / max(count, 1.0)


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
    cfg = SFTConfig.model_validate(c["cfg"])
    torch.manual_seed(c["seed"])
    log = events.RankZeroLogger(c["tracking_uri"], c["run_id"], rank, c["name"])
    startup.import_deepspeed()  # lean: without the optional imports no rank uses
    clock.mark("imports")
    base = c["storage"].localize(c["base"])  # a node without a shared run_dir pulls it from the object store
    model = models.load_model(base, "causal")
    if cfg.deepspeed.activation_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.lora:
        model = lora.wrap(model, cfg.lora, "causal", cfg.deepspeed.activation_checkpointing)
    clock.mark("model")
    engine = training.init_engine(model, c["ds_config"])
    clock.mark("deepspeed")
    state = training.restore(engine)
    clock.mark("restore")
    log.print(f"DeepSpeed engine ready in {clock.parts['deepspeed']:.1f}s (resuming at step {state['step']})")
    total, pad_id = c["total_steps"], c["pad_id"]
    # This rank's batches of each split, read once and replayed (the same batches at every pass).
    collate_fn = partial(collate, pad_id=pad_id)
    trains = training.ReplayBatches(training.split(c, "train"), cfg.micro_batch_size, collate_fn, rank, world)
    evals = training.EvalBatches(training.split(c, "eval"), cfg.micro_batch_size, collate_fn, rank, world)
    if state["step"] == 0:
        loss0 = _eval_loss(engine, evals)
        log.log({"eval_loss": loss0}, 0)
        log.step(0, total, {"eval_loss": loss0})
        clock.mark("evaluation", counted=False)
    fault_at = int(os.environ.get("PIPELINE_FAULT_AFTER_STEP", "0"))  # fault drills and resume tests
    fault_armed = fault_at > state["step"]
    metrics: dict = {}
    for epoch in range(state["epoch"], cfg.epochs):
        skip = state["micro_in_epoch"] if epoch == state["epoch"] else 0
        busy, tokens, micro = 0.0, 0, 0
        for batch in trains:
            micro += 1
            if micro <= skip:
                continue
            if engine.global_steps >= total:
                break
            training.first_step(clock, log)  # the first one ends the start-up: shown and logged once
            t0 = time.time()
            loss = forward(engine, batch).loss
            engine.backward(loss)
            before = engine.global_steps
            engine.step()
            busy, tokens = busy + time.time() - t0, tokens + int(batch["attention_mask"].sum())
            if engine.global_steps == before:  # still accumulating
                continue
            step = engine.global_steps
            n_tokens, n_busy = training.all_reduce_sum([tokens, busy])
            metrics = {"train_loss": loss.item(), "lr": engine.get_lr()[0], "tokens_per_s": n_tokens / (n_busy / world)}
            busy, tokens = 0.0, 0
            if step % cfg.eval_every == 0 or step == total:
                metrics["eval_loss"] = _eval_loss(engine, evals)
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


def accuracy_warning(base: float, after: float, n: int, lr: float) -> str | None:
    """A warning when SFT left the model worse on held-out prompts than it started: the usual cause
    is a learning rate for a model trained from scratch used on a pretrained one."""
    if after >= base:
        return None
    return (f"warning: SFT lowered held-out greedy accuracy from {base:.3f} to {after:.3f} on {n} prompts; "
            f"stages.sft.lr={lr:g} may be too high for this model (pretrained models usually want 1e-5 to 1e-4)")


def engine_greedy(model_dirs: list[Path], prompt_ids: list[list[int]], max_new_tokens: int, seed: int,
                  storage=None) -> list[tuple[list[str], list[bool]]]:
    """`greedy_generate` of each model, answered by a vLLM engine actor of its own
    (`stages.common.evaluation.engine_answers`): (texts, cut off) per model."""
    from stages.common.evaluation import engine_answers

    outs = engine_answers(model_dirs, prompt_ids, [{"temperature": 0.0, "max_tokens": max_new_tokens}], seed, storage)
    return [([t[0] for t, _ in out[0]], [c[0] for _, c in out[0]]) for out in outs]


def run(cfg: SFTConfig, ctx: StageContext) -> dict[str, Path]:
    """Train with TorchTrainer, export the HF model, score held-out accuracy before and after."""
    from stages.common.deepspeed import deepspeed_config, total_steps, use_bf16, use_gpu
    from stages.common.lora import describe
    from stages.common.models import greedy_accuracy, verified_share
    from stages.common.parquet import read_rows
    from stages.common.training import export, fit, tokenizer_and_ray

    clock = events.StartupClock()
    data, base = ctx.inputs["sft_data"], ctx.inputs["base_model"]
    n_train = json.loads((data / "meta.json").read_text())["rows"]["train"]
    steps = total_steps(n_train, cfg)
    if steps < 1:
        raise UserError(f"stages.sft: {n_train} training rows make no full optimizer step with batch_size "
                        f"{cfg.batch_size}; lower stages.sft.batch_size or generate more data")
    gpu = use_gpu()
    bf16 = use_bf16(cfg.deepspeed, gpu)
    ds_config = deepspeed_config(cfg, steps, bf16)
    ctx.log_dict(ds_config, "deepspeed_config.json")
    clock.mark("driver")
    tok = tokenizer_and_ray(base, ctx)
    clock.mark("ray")  # the tokenizer loaded meanwhile
    clock.processes = cfg.num_workers + 1  # Ray Train's controller and its workers
    ctx.progress(f"training {steps} steps on {cfg.num_workers} workers (ZeRO-{cfg.deepspeed.zero_stage}, "
                 f"{'bf16' if bf16 else 'fp32'}, {n_train} rows{describe(cfg.lora)})")
    result = fit(train_loop, {
        "cfg": cfg.model_dump(mode="json"), "seed": ctx.pipeline.seed, "base": str(base), "ds_config": ds_config,
        "total_steps": steps, "pad_id": tok.pad_token_id, "tracking_uri": ctx.pipeline.tracking_uri,
        "run_id": ctx.run_id, "name": ctx.name, "startup": clock,
    }, cfg, {"train": data / "train", "eval": data / "eval"},
        ctx.checkpoint_dir, ctx.storage, gpu, ctx.train_callbacks())
    out = ctx.out_dir / "model"
    metrics = export(result, out, tok, base, "causal")  # a LoRA adapter is merged into the base here
    prompts = read_rows(ctx.inputs["prompt_data"] / "eval", cfg.accuracy_prompts)
    verifier = ctx.pipeline.task.verifier
    if prompts:
        ctx.progress(f"scoring greedy answers on {len(prompts)} held-out prompts ({cfg.accuracy_engine})")
        if cfg.accuracy_engine == "vllm":
            (base_acc, base_cut), (acc, cut) = (verified_share(*answers, prompts, verifier) for answers in engine_greedy(
                [base, out], [r["prompt_ids"] for r in prompts], cfg.max_new_tokens, ctx.pipeline.seed, ctx.storage))
        else:
            (base_acc, base_cut), (acc, cut) = (greedy_accuracy(d, prompts, cfg.max_new_tokens, verifier)
                                                for d in (base, out))
        metrics.update(base_accuracy=base_acc, base_truncated=base_cut, accuracy=acc, truncated=cut)
        metrics["accuracy_prompts"] = len(prompts)
        ctx.progress(f"accuracy {metrics['base_accuracy']:.3f} (base) -> {metrics['accuracy']:.3f} (sft)")
        if metrics["base_truncated"] or metrics["truncated"]:
            ctx.progress(f"answers cut off at max_new_tokens={cfg.max_new_tokens} (scored as given): "
                         f"{metrics['base_truncated']:.1%} (base), {metrics['truncated']:.1%} (sft)")
        warning = accuracy_warning(metrics["base_accuracy"], metrics["accuracy"], len(prompts), cfg.lr)
        if warning:
            ctx.progress(warning)
            ctx.set_tags({"warning": warning})
    ctx.log_metrics(metrics, step=steps)  # at the last step: per-step curves stay as rank 0 logged them
    return {"sft_model": out}
