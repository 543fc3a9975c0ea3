"""The Train stages' one loop: sft, reward and dpo each hand it an `Objective`, what they compute.

Driver side, `train`: the DeepSpeed config (logged to the stage's run), Ray and the tokenizer, the progress
line, the `TorchTrainer` (`training.fit`). Worker side, `worker`, on every Ray Train rank: lean imports, the
rank's threads, the config, the seed, the rank-0 logger, DeepSpeed; the objective's model, the engine, the
restored state; the objective's batches (and anything it prepares, DPO's reference); an evaluation at step
0; epochs of micro-batches, skipping those a resumed attempt already trained on; at every optimizer step the
objective's metrics, an evaluation every `eval_every`, a checkpoint (and the fault drill) every
`checkpoint_every` and at the end; the final state reported again when an attempt resumes after the last
step. Written once, the three stages cannot drift apart in how they resume, evaluate or checkpoint; each
stage module keeps only its own math (`tests/test_train_loop.py` holds their trajectories to what the
three separate loops gave).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline import events, faults
from stages.common import in_process

if TYPE_CHECKING:
    from pipeline.stage import StageContext


class Objective:
    """What a Train stage computes. A stage subclasses it (in its own module: the instance is pickled to the
    workers, each of which then holds its own) and overrides what differs from these defaults."""

    config: type  # the stage's TrainingConfig subclass (the workers receive the section as JSON)
    kind = "causal"  # the model class `models.load_model` builds: "causal" or "sequence"
    phases = False  # log rank 0's seconds in each phase of the steps (`<phase>_s`; DPO's reference costs time)

    def start(self, cfg, c: dict) -> None:
        """On the worker, first: the validated config and the worker's `c` (seed, pad id), kept for the rest."""
        self.cfg, self.c = cfg, c

    def model(self, cfg, c: dict, init: Path):
        """The model to train, from `init`: activation checkpointing and LoRA as configured."""
        from stages.common import lora, models

        model = models.load_model(init, self.kind, *self.model_args(cfg, c))
        if cfg.deepspeed.activation_checkpointing:
            model.gradient_checkpointing_enable()
        if cfg.lora:
            model = lora.wrap(model, cfg.lora, self.kind, cfg.deepspeed.activation_checkpointing)
        return model

    def model_args(self, cfg, c: dict) -> tuple:
        """Further arguments of `models.load_model` (the reward model's pad id and heads)."""
        return ()

    def collate(self, cfg, c: dict, split: str) -> Callable:
        """A micro-batch's rows to tensors, per split (`train` or `eval`)."""
        raise NotImplementedError

    def prepare(self, engine, cfg, c: dict, init: Path, splits: dict, state: dict, log, clock, rank: int,
                world: int) -> None:
        """After the engine and the batches, before step 0's evaluation (DPO: its reference)."""

    def loss(self, engine, batch: dict, micro: int, phases: dict[str, float]):
        """A micro-batch's loss (`micro`: its index in the epoch, from 1); it keeps what it logs of it."""
        raise NotImplementedError

    def step_metrics(self, engine, busy: float, world: int) -> dict[str, float]:
        """At an optimizer step, on every rank (it may all-reduce): the metrics of the micro-batches since the
        last one (`busy`: seconds computing them), then forget them."""
        raise NotImplementedError

    def evaluate(self, engine, batches) -> dict[str, float]:
        """Held-out metrics over every rank's eval batches."""
        raise NotImplementedError

    def state(self) -> dict:
        """Kept in the trainer state beside each checkpoint (DPO: every rank's precomputed reference)."""
        return {}


# --------------------------------------------------------------------------- driver side


def train(objective: Objective, cfg, ctx: StageContext, init: Path, data: Path, steps: int,
          line: Callable[[str], str], clock, **extra: Any):
    """Run the objective on `cfg.num_workers` Ray Train workers over `data`'s train and eval splits; (the Ray
    Train `Result`, the tokenizer). `line(precision)` says what trains, for the progress line; `extra` reaches
    the workers' `c`."""
    from stages.common.deepspeed import deepspeed_config, use_bf16
    from stages.common.devices import check_workers, run_gpus
    from stages.common.models import load_tokenizer
    from stages.common.training import direct_splits, fit, tokenizer_and_ray

    have = run_gpus(ctx)  # the Ray cluster's GPUs (or the local Ray's to be), never this driver's own
    gpu = have > 0
    if gpu:  # refused now, with the count, rather than a placement group waiting for GPUs that never come
        check_workers(ctx.name.split()[0], cfg.num_workers, have)
    bf16 = use_bf16(cfg.deepspeed, gpu)
    ds_config = deepspeed_config(cfg, steps, bf16)
    ctx.log_dict(ds_config, "deepspeed_config.json")
    clock.mark("driver")
    # Ray Train's controller and its workers; none when one worker trains in this process (in_process.py)
    local = in_process.wanted(cfg.num_workers, ctx.train_callbacks(), ctx.storage.target(ctx.checkpoint_dir)[1])
    splits = {"train": data / "train", "eval": data / "eval"}
    # Ray itself only for a worker group or a split that streams through Ray Data: one worker reading its
    # files trains without it (a later step that needs Ray, e.g. vLLM's evaluation, starts it then)
    tok = tokenizer_and_ray(init, ctx) if not local or direct_splits(splits).keys() != splits.keys() \
        else load_tokenizer(init)
    clock.mark("ray")  # the tokenizer loaded meanwhile
    clock.processes = 0 if local else cfg.num_workers + 1
    ctx.progress(line("bf16" if bf16 else "fp32") + (", in this process" if local else ""))
    result = fit(worker, {
        "objective": objective, "cfg": cfg.model_dump(mode="json"), "seed": ctx.pipeline.seed, "init": str(init),
        "ds_config": ds_config, "total_steps": steps, "pad_id": tok.pad_token_id,
        "tracking_uri": ctx.pipeline.tracking_uri, "run_id": ctx.run_id, "name": ctx.name, "startup": clock, **extra,
    }, cfg, splits, ctx.checkpoint_dir, ctx.storage, gpu,
        ctx.train_callbacks())
    return result, tok


# --------------------------------------------------------------------------- worker side


def worker(c: dict) -> None:
    """One Ray Train worker: DeepSpeed engine, resume, train, evaluate, checkpoint."""
    clock = c["startup"]  # events.StartupClock, started with the stage on the driver
    clock.mark("workers")  # Ray Train's controller, the worker processes, their process group
    from stages.common import startup

    if not in_process.active():  # the driver keeps its imports as they are
        startup.lean_imports()  # before anything loads transformers (stages/common/startup.py)
    import torch

    from stages.common import devices, training

    objective: Objective = c["objective"]
    rank, world = worker_rank()
    set_threads(world)
    cfg = objective.config.model_validate(c["cfg"])
    objective.start(cfg, c)
    torch.manual_seed(c["seed"])
    log = events.RankZeroLogger(c["tracking_uri"], c["run_id"], rank, c["name"])
    startup.import_deepspeed()  # lean: without the optional imports no rank uses
    clock.mark("imports")
    init = c["storage"].localize(c["init"])  # a node without a shared run_dir pulls it from the object store
    model = objective.model(cfg, c, init)
    clock.mark("model")
    engine = training.init_engine(model, c["ds_config"])
    clock.mark("deepspeed")
    state = training.restore(engine)
    clock.mark("restore")
    log.print(f"DeepSpeed engine ready in {clock.parts['deepspeed']:.1f}s (resuming at step {state['step']})")
    total = c["total_steps"]
    # This rank's batches of each split, read once and replayed (the same batches at every pass), each one moved
    # to the engine's device as it is used (built on the CPU: stages/common/devices.py)
    device = devices.device_of(engine)
    trains = devices.OnDevice(training.ReplayBatches(training.split(c, "train"), cfg.micro_batch_size,
                                                     objective.collate(cfg, c, "train"), rank, world), device)
    evals = devices.OnDevice(training.EvalBatches(training.split(c, "eval"), cfg.micro_batch_size,
                                                  objective.collate(cfg, c, "eval"), rank, world), device)
    objective.prepare(engine, cfg, c, init, {"train": trains, "eval": evals}, state, log, clock, rank, world)
    if state["step"] == 0:
        first = objective.evaluate(engine, evals)
        log.log(first, 0)
        log.step(0, total, first)
        clock.mark("evaluation", counted=False)
    fault_at = faults.number("AFTER_STEP", 0)  # fault drills and resume tests
    fault_armed = fault_at > state["step"]
    metrics: dict = {}
    for epoch in range(state["epoch"], cfg.epochs):
        skip = state["micro_in_epoch"] if epoch == state["epoch"] else 0
        busy, micro, phases = 0.0, 0, {}
        for batch in trains:
            micro += 1
            if micro <= skip:
                continue
            if engine.global_steps >= total:
                break
            training.first_step(clock, log)  # the first one ends the start-up: shown and logged once
            began = time.time()
            loss = objective.loss(engine, batch, micro, phases)
            with events.timed(phases, "backward"):
                engine.backward(loss)  # ZeRO's gradient reduction between ranks happens in here
            before = engine.global_steps
            with events.timed(phases, "optimizer"):
                engine.step()
            busy += time.time() - began
            if engine.global_steps == before:  # still accumulating
                continue
            step = engine.global_steps
            metrics = objective.step_metrics(engine, busy, world)
            if objective.phases:
                metrics |= {f"{phase}_s": seconds for phase, seconds in phases.items()}  # rank 0's time in each
            busy, phases = 0.0, {}
            if step % cfg.eval_every == 0 or step == total:
                metrics.update(objective.evaluate(engine, evals))
            log.log(metrics, step)
            log.step(step, total, metrics)  # every step goes to MLflow; the console shows progress
            state = {"step": step, "epoch": epoch, "micro_in_epoch": micro, **objective.state()}
            if step == total:
                metrics.update(peak_memory(rank, world))
            if step % cfg.checkpoint_every == 0 or step == total:
                training.report(engine, state, {"step": step, **metrics, **clock.metrics()}, rank, with_checkpoint=True)
                if fault_armed and step >= fault_at:
                    faults.inject("AFTER_STEP", f"after step {step}")
            elif "eval_loss" in metrics:  # eval results reach a sweep's scheduler (ASHA) between checkpoints
                training.report(engine, state, {"step": step, **metrics}, rank, with_checkpoint=False)
        state = {"step": engine.global_steps, "epoch": epoch + 1, "micro_in_epoch": 0, **objective.state()}
        if engine.global_steps >= total:
            break
    if not metrics:  # resumed after the last step: report the final state again so the run ends on it
        training.report(engine, state, {"step": engine.global_steps, **peak_memory(rank, world)}, rank,
                        with_checkpoint=True)


def worker_rank() -> tuple[int, int]:
    import ray.train

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


def peak_memory(rank: int, world: int) -> dict[str, float]:
    """Peak resident memory of every worker, in MB (collective: every rank must call it)."""
    import resource

    from stages.common import training

    slots = [0.0] * world
    slots[rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {f"peak_rss_mb_rank{r}": v for r, v in enumerate(training.all_reduce_sum(slots))}


def set_threads(world_size: int) -> None:
    """Split the machine's cores between co-located workers instead of oversubscribing them."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
