"""Upstream defect: DeepSpeed unpickles its checkpoints with `torch.load(weights_only=False)`, so a tampered
checkpoint runs code in every rank on resume.

Targets: DeepSpeed 0.19 (`TorchCheckpointEngine.load` passes `weights_only=False`; the fast and decoupled engines of
`checkpoint.writer` take torch's default, which `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` turns off; the optimizers'
universal-checkpoint loads pass `weights_only=False`). No upstream issue filed from here.
Removable when: every DeepSpeed load is weights-only; the test that says so is
`tests/test_upstream.py::test_deepspeed_still_unpickles_checkpoints_with_weights_only_false` (and
`tests/test_training_units.py::test_every_deepspeed_checkpoint_load_path_is_weights_only_inside_the_guard` shows the
guard holds on each load path).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

# The non-tensor objects DeepSpeed 0.19 pickles into its checkpoints (ZeRO 0-3, fp32 and bf16),
# found by loading each kind with `weights_only=True` and reading torch's "Unsupported global".
CHECKPOINT_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum",
                      "deepspeed.utils.tensor_fragment.fragment_address")

_guard = {"depth": 0, "load": None}  # `weights_only_loads`: how many are open, and torch's own `load`
_guard_lock = threading.Lock()


def _torch_load():
    """torch's own `torch.load`, also while `weights_only_loads` has replaced it."""
    import torch

    return _guard["load"] or torch.load


def _allowed_load(f, map_location=None, **kwargs):
    """torch's `load` of `f` with `weights_only=True`, allowing `CHECKPOINT_GLOBALS` besides tensors and containers."""
    import importlib
    import pickle

    import torch

    allowed = [getattr(importlib.import_module(m), a) for m, _, a in (g.rpartition(".") for g in CHECKPOINT_GLOBALS)]
    with torch.serialization.safe_globals(allowed):
        try:
            return _torch_load()(f, map_location=map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            name = getattr(f, "name", f)
            raise RuntimeError(f"{name}: this checkpoint holds a Python object that loading it safely "
                               f"(weights_only) does not allow ({str(exc).splitlines()[-3:]}); a checkpoint this "
                               "pipeline wrote never does, so it was written by something else: delete it "
                               "(or rerun the stage with --force) to train from scratch") from None


def load_weights_only(path: str, map_location=None):
    """`torch.load` of one DeepSpeed checkpoint file with `weights_only=True`: tensors, containers and
    the few DeepSpeed classes above, never arbitrary code (a pickle can run any on load)."""
    return _allowed_load(path, map_location)


def _forced_load(f=None, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
    """What `torch.load` is inside `weights_only_loads`: `_allowed_load`, whatever the caller asked for
    (DeepSpeed passes `weights_only=False`; a `pickle_module` is ignored, the safe unpickler is torch's own)."""
    return _allowed_load(f, map_location, **kwargs)


@contextmanager
def weights_only_loads():
    """For its duration, every `torch.load` in this process is `load_weights_only`'s allow-listed
    `weights_only=True` load, whatever the caller passes.

    Why at torch's level: DeepSpeed 0.19 unpickles checkpoints in many places, all through `torch.load`
    looked up on the module at call time: its `TorchCheckpointEngine` (`weights_only=False`), the fast and
    decoupled engines of `checkpoint.writer` (torch's default), and the optimizers' own loads of
    universal checkpoints (`weights_only=False`). Swapping one engine's `load` left the others to
    torch's default (no allow-list, and off with `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`) or to
    `weights_only=False` (docs/architecture.md, fact 16). Loads run on every rank at the same point, never
    beside other work that loads pickles; nested and re-entered uses restore torch's `load` once the
    outermost one ends."""
    import torch
    import torch.serialization

    with _guard_lock:
        if _guard["depth"] == 0:
            _guard["load"] = torch.load
            torch.load = torch.serialization.load = _forced_load
        _guard["depth"] += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guard["depth"] -= 1
            if _guard["depth"] == 0:
                torch.load = torch.serialization.load = _guard["load"]
                _guard["load"] = None


def safe_checkpoint_loads(engine) -> None:
    """Make every `engine.load_checkpoint` run inside `weights_only_loads` (patched on the instance),
    whichever checkpoint engine the DeepSpeed config picked.

    Why not DeepSpeed's own: its `TorchCheckpointEngine.load` calls `torch.load(weights_only=False)`
    unconditionally, and universal-checkpoint loading does the same in the optimizers, so a tampered
    checkpoint in run_dir or the bucket would run code in every rank. Configs whose loads this does not
    vouch for (`datastates_ckpt`, `checkpoint.load_universal`, `nebula`) are refused at validation
    (`unsafe_checkpoint_keys`)."""
    import functools

    load = engine.load_checkpoint
    if getattr(load, "weights_only_loads", False):
        return

    @functools.wraps(load)
    def load_checkpoint(*args, **kwargs):
        with weights_only_loads():
            return load(*args, **kwargs)

    load_checkpoint.weights_only_loads = True
    engine.load_checkpoint = load_checkpoint
