"""Where a process's tensors live, decided in that process (issue 68).

Every batch the driver builds is on the CPU (it is built where there may be no GPU at all, and travels through
Ray's object store); every model may be on a GPU. So a batch goes to its model's device at the call
(`to_device(batch, device_of(model))`), and what a call returns goes back on the CPU (`to_cpu`): a CUDA tensor
returned to the driver could not be concatenated with another rank's, and keeps a GPU buffer alive through Ray.
On a CPU both are no-ops (`Tensor.to` returns the tensor itself), so the CPU path is unchanged. The ppo roles use
it; it moves to stages/common/ when the Train stages' batches (sft, reward, dpo) go through it too.

    process_device()            # what this process was given: its first visible CUDA device, else the CPU
    device_of(model)            # a DeepSpeed engine's, a PEFT or HF model's, any module's (its first parameter)
    to_device(batch, device)    # every tensor of a dict moved, anything else kept
    on_device(model)            # a callable that moves its tensor keyword arguments to model's device first
"""

from __future__ import annotations

from typing import Any, Callable


def process_device():
    """The device this process was given: the first CUDA device it sees, else the CPU. Asked in the process that
    computes, never in the driver: Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned an actor or a Train worker
    (and to none for one that asked for none), so what torch sees here is what Ray gave."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
