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
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from pipeline import events
from pipeline.errors import UserError
from stages.common import train_loop
from stages.common.deepspeed import TrainingConfig, train_check

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext


class SFTConfig(TrainingConfig):
    """The sft stage: the shared training fields plus evaluation settings."""

    accuracy_prompts: int = Field(200, ge=0,
                                  description="Held-out prompts scored by the task verifier at the end (0: skip).")
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


# --------------------------------------------------------------------------- what the Train loop computes


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


class Objective(train_loop.Objective):
    """The language-model loss on assistant tokens; logged per step: the loss, the learning rate and tokens/s
    over all ranks; evaluated: the token-weighted held-out loss."""

    config = SFTConfig

    def collate(self, cfg, c: dict, split: str):
        return partial(collate, pad_id=c["pad_id"])

    def loss(self, engine, batch: dict, micro: int, phases: dict):
        self.last = forward(engine, batch).loss
        self.tokens = getattr(self, "tokens", 0) + int(batch["attention_mask"].sum())
        return self.last

    def step_metrics(self, engine, busy: float, world: int) -> dict:
        from stages.common.training import all_reduce_sum

        n_tokens, n_busy = all_reduce_sum([self.tokens, busy])
        self.tokens = 0
        return {"train_loss": self.last.item(), "lr": engine.get_lr()[0], "tokens_per_s": n_tokens / (n_busy / world)}

    def evaluate(self, engine, batches) -> dict:
        return {"eval_loss": _eval_loss(engine, batches)}


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


def check(pipeline_cfg) -> None:
    """On a local Ray with GPUs, one per worker (a cluster's are counted when the stage starts)."""
    train_check("sft", pipeline_cfg, from_sft=False)


def run(cfg: SFTConfig, ctx: StageContext) -> dict[str, Path]:
    """Train with TorchTrainer, export the HF model, score held-out accuracy before and after."""
    from stages.common.deepspeed import total_steps
    from stages.common.lora import describe
    from stages.common.models import greedy_accuracy, verified_share
    from stages.common.parquet import read_rows
    from stages.common.training import export

    clock = events.StartupClock()
    data, base = ctx.inputs["sft_data"], ctx.inputs["base_model"]
    n_train = json.loads((data / "meta.json").read_text())["rows"]["train"]
    steps = total_steps(n_train, cfg)
    if steps < 1:
        raise UserError(f"stages.sft: {n_train} training rows make no full optimizer step with batch_size "
                        f"{cfg.batch_size}; lower stages.sft.batch_size or generate more data")
    result, tok = train_loop.train(
        Objective(), cfg, ctx, base, data, steps, lambda precision: f"training {steps} steps on {cfg.num_workers} "
        f"worker{'s' if cfg.num_workers != 1 else ''} (ZeRO-{cfg.deepspeed.zero_stage}, {precision}, {n_train} "
        f"rows{describe(cfg.lora)})", clock)
    out = ctx.out_dir / "model"
    metrics = export(result, out, tok, base, "causal")  # a LoRA adapter is merged into the base here
    prompts = read_rows(ctx.inputs["prompt_data"] / "eval", cfg.accuracy_prompts)
    verifier = ctx.pipeline.task.verifier
    if prompts:
        ctx.progress(f"scoring greedy answers on {len(prompts)} held-out prompts ({cfg.accuracy_engine})")
        if cfg.accuracy_engine == "vllm":
            ctx.ray()  # the engines are Ray actors; one worker trained without Ray (train_loop.train)
            (base_acc, base_cut), (acc, cut) = (verified_share(*answers, prompts, verifier)
                                                for answers in engine_greedy(
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
