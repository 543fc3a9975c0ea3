"""Where a process's tensors live, decided in that process (issue 68).

Every batch the driver builds is on the CPU (it is built where there may be no GPU at all, and travels through
Ray's object store); every model may be on a GPU. So a batch goes to its model's device at the call
(`to_device(batch, device_of(model))`), and what a call returns goes back on the CPU (`to_cpu`): a CUDA tensor
returned to the driver could not be concatenated with another rank's, and keeps a GPU buffer alive through Ray.
On a CPU both are no-ops (`Tensor.to` returns the tensor itself), so the CPU path is unchanged. The ppo roles and
the Train stages' loop (sft, reward, dpo: `OnDevice` around their replayed batches) use it.

Two sides, never mixed:

- **In the process that computes**, what Ray gave it decides: `process_device()`, `process_backend()` (NCCL with
  a GPU, gloo without) and `set_accelerator()` (DeepSpeed's accelerator, chosen before deepspeed is imported).
  Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned an actor or a Train worker (none for one that asked for
  none), so a GPU worker of a CPU-only head still gets NCCL and CUDA, and a CPU worker on a GPU node gloo and CPU.
- **In the driver**, only what to ask Ray for: `cluster_gpus()` (the Ray cluster's GPUs, never the driver's own
  hardware), `check_gpus()` (a stage needing more GPUs than the cluster has is refused with the count, before
  anything is placed: a placement group Ray can never fill would otherwise wait until a timeout).

    process_device()            # what this process was given: its first visible CUDA device, else the CPU
    device_of(model)            # a DeepSpeed engine's, a PEFT or HF model's, any module's (its first parameter)
    to_device(batch, device)    # every tensor of a dict moved, anything else kept
    on_device(model)            # a callable that moves its tensor keyword arguments to model's device first
"""

from __future__ import annotations

import os
from typing import Any, Callable


def process_device():
    """The device this process was given: the first CUDA device it sees, else the CPU. Asked in the process that
    computes, never in the driver: Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned an actor or a Train worker
    (and to none for one that asked for none), so what torch sees here is what Ray gave."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def process_backend() -> str:
    """The process group's backend for this process: NCCL when Ray gave it a GPU, gloo otherwise."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def set_accelerator() -> str:
    """Choose DeepSpeed's accelerator for this process from what it sees, before deepspeed is imported (DeepSpeed
    reads DS_ACCELERATOR once, at import, and would otherwise probe for CUDA itself, and fall back to the CPU
    accelerator without saying so). A value already set (by the user) is kept. Returns the accelerator's name."""
    import torch

    return os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def cluster_gpus() -> float:
    """The GPUs of the Ray cluster this driver is connected to (`ray.cluster_resources()`); 0 without Ray. What a
    stage asks Ray for follows from this, never from `torch.cuda.is_available()` here: the driver may be a
    CPU-only head of GPU workers, or a GPU machine whose local Ray was given none (`ray.num_gpus: 0`)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def check_gpus(need: float, have: float, what: str, fix: str, error: type[Exception] | None = None) -> None:
    """Refuse a stage that needs more GPUs than the cluster has, naming the shortfall and the fix (`what`: the
    config key that decides the need and what needs them; `fix`: what to change; `error`: the exception's class,
    ValueError in a config's check hook, else UserError)."""
    if need > have + 1e-9:  # fractional shares add up in floating point
        from pipeline.errors import UserError

        raise (error or UserError)(f"{what} need {need:g} GPUs but the Ray cluster has {have:g} ({need - have:g} "
                                   f"short); {fix}")


def device_of(model: Any):
    """The device a model computes on: a DeepSpeed engine's or an HF model's `device`, else its first
    parameter's (a plain module), else the CPU (a module without parameters)."""
    import torch

    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def to_device(batch: dict, device) -> dict:
    """`batch` with every tensor on `device` (non-blocking: pinned or not, the copy is ordered before its use on
    the device's stream); other entries as they are."""
    import torch

    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def to_cpu(value):
    """A result for the driver: a tensor (or the tensors of a tuple or list) on the CPU."""
    import torch

    if torch.is_tensor(value):
        return value.cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(to_cpu(v) for v in value)
    return value


def on_device(model: Any) -> Callable:
    """`model` called with its tensor keyword arguments on its own device (for helpers that build CPU batches and
    call the model, such as `training.reward_scores`)."""
    device = device_of(model)

    def call(**kwargs):
        return model(**to_device(kwargs, device))

    return call


class OnDevice:
    """An iterable of batches (a Train stage's `ReplayBatches`) yielded on `device`. The batches stay on the CPU in
    between (replayed from worker memory every epoch): only the micro-batch in use occupies the device."""

    def __init__(self, batches, device) -> None:
        self.batches, self.device = batches, device

    def __iter__(self):
        for batch in self.batches:
            yield to_device(batch, self.device) if isinstance(batch, dict) else batch


def run_gpus(ctx) -> float:
    """The GPUs of the Ray a stage runs on (`ctx`: its StageContext): the joined cluster's, else those of the
    local Ray the run starts (`ray.local_gpus()`: `ray.num_gpus`, or what Ray detects); a configured cluster not
    joined yet is joined first (`ctx.ray()`). A stage asks Ray for GPUs exactly when this is above 0."""
    import ray

    if not ray.is_initialized():
        local = ctx.pipeline.ray.local_gpus()
        if local is not None:
            return float(local)
        ctx.ray()
    return cluster_gpus()


def check_workers(stage: str, num_workers: int, gpus: float, error: type[Exception] | None = None) -> None:
    """A Train stage on GPUs holds one per worker (Ray Train's `use_gpu`): refused when the cluster has fewer."""
    check_gpus(num_workers, gpus, f"stages.{stage}.num_workers: {num_workers} workers",
               "use fewer workers, a larger cluster, or ray.num_gpus: 0 to train on the CPU", error)


def check_local_workers(pipeline_cfg, stage: str) -> None:
    """A Train stage's `check` hook: on a local Ray with GPUs, as many as its workers, refused at load (a cluster's
    GPUs are counted when the stage starts, `train_loop.train`)."""
    cfg = getattr(pipeline_cfg.stages, stage, None)
    gpus = pipeline_cfg.ray.local_gpus() if cfg is not None else None
    if gpus:
        check_workers(stage, cfg.num_workers, gpus, ValueError)
