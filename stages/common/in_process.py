"""One-worker training in the driver: Ray Train's local mode, with what local mode leaves out put back.

A Train stage with `num_workers: 1` paid for a worker group it did not need: Ray Train's controller
actor, one worker process importing torch and DeepSpeed again, their placement group (8.8 s of the
DPO bench's 25.9 s start-up, issue 60). Ray Train 2.60 runs the training function in the calling
process when `ScalingConfig(num_workers=0)` (`LocalTorchController`): the same `TorchTrainer` API,
`ray.train.get_context()` says rank 0 of 1, `ray.train.report` keeps the last metrics and checkpoint.
What its local mode does not do, and this module does:

- **A process group.** DeepSpeed needs one (`deepspeed.initialize`), local mode makes none: a gloo
  group of one rank over an in-memory store (`HashStore`: no port to collide with another run's),
  torn down when the fit ends, and the rank variables DeepSpeed reads (`RANK`, `LOCAL_RANK`, ...).
- **Checkpoints that outlive the fit, and resume.** Local mode keeps the reported checkpoint object
  only (a temporary directory the loop deletes) and `get_checkpoint()` is always None: each checkpoint
  is written under `<checkpoints>/in_process/` instead (a temporary directory renamed into place, the
  last `keep_checkpoints` kept), and `latest()` is what a rerun resumes from.
- **Retries.** `FailureConfig(max_failures)` is not used by local mode: `fit` runs the loop up to
  `max_failures + 1` times, each attempt from the newest checkpoint, on a fresh copy of its config
  (as a restarted worker gets one).
- **The driver as it was.** The loop seeds torch and sets its thread count; the driver goes on to
  other stages, so the random states, the thread count and the environment are put back, and Ray
  Train's record that this process is a worker is cleared.

Not here: a training run on a cluster, with an object store, or inside a Tune trial (its callbacks
need the controller) keeps the worker group (`training.fit` decides).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

GROUP_ENV = "PIPELINE_TRAIN_GROUP"  # "1": a one-worker stage still starts a worker group (tests, benches)
LATEST = "latest.json"
_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}

_active: dict | None = None  # {"dir": Path, "keep": int} while a fit runs in this process


def wanted(num_workers: int, callbacks, storage_fs, gpu: bool = False) -> bool:
    """Whether a Train stage's loop runs in the driver: one worker on the CPU, no Ray Train callbacks (a Tune
    trial's reporter needs the controller), checkpoints on this machine's filesystem, and not forced off.

    Never on a GPU (`gpu`: the stage asks Ray for GPUs): the driver would take GPU 0 without a Ray reservation and
    keep its CUDA context and cached memory after the stage, so a ppo rank, an engine or a serve replica Ray later
    placed on that GPU would fail vLLM's free-memory check. A one-worker GPU stage is a Ray Train worker holding its
    GPU by reservation, and gives it back when it ends."""
    return (num_workers == 1 and not gpu and not callbacks and storage_fs is None
            and os.environ.get(GROUP_ENV) != "1")


def active() -> bool:
    """True inside an in-process fit (the loop asks: its checkpoints go through `commit` and `latest`)."""
    return _active is not None


def fit(make_trainer: Callable[[dict], object], loop_config: dict, checkpoints: Path, keep: int, max_failures: int,
        log: Callable[[str], None]):
    """Run `make_trainer(config).fit()` in this process, up to `max_failures + 1` times; its Ray Train Result.
    On the CPU only (`wanted`): a gloo process group, DeepSpeed's CPU accelerator."""
    import ray.cloudpickle as pickle

    global _active
    directory = checkpoints / "in_process"
    directory.mkdir(parents=True, exist_ok=True)
    frozen = pickle.dumps(loop_config)  # each attempt starts from the config as it was, as a new worker would
    for attempt in range(max_failures + 1):
        _active = {"dir": directory, "keep": keep}
        try:
            with _driver_kept({"DS_ACCELERATOR": "cpu"}), _process_group():
                return make_trainer(pickle.loads(frozen)).fit()
        except Exception as exc:  # noqa: BLE001 - a failed attempt; KeyboardInterrupt is the runner's
            if attempt == max_failures:
                raise
            log(f"training failed ({type(exc).__name__}: {exc}); attempt {attempt + 2} of {max_failures + 1} "
                "resumes from the last checkpoint")
            exc.__traceback__ = None  # its frames hold the failed attempt's model and optimizer
        finally:
            _active = None
            _forget_train_session()
            import gc

            gc.collect()


@contextlib.contextmanager
def _process_group():
    """A gloo process group of one rank for DeepSpeed, over an in-memory store (no port), destroyed after."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        import deepspeed.comm

        from pipeline.upstream.deepspeed_groups import release_cached_groups

        if dist.is_initialized():
            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's references to the group
        release_cached_groups()  # the group may have been destroyed by torch's call instead (Ray Train's)


@contextlib.contextmanager
def _driver_kept(env: dict[str, str]):
    """The driver's random states, torch thread count and environment, as they were before the loop ran;
    meanwhile the environment a one-rank worker has (its rank variables, which DeepSpeed reads, and `env`)."""
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_num_threads()
    saved = dict(os.environ)
    os.environ.update({**_RANK_ENV, **env})
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        torch.set_num_threads(states[3])
        os.environ.clear()
        os.environ.update(saved)


def _forget_train_session() -> None:
    """Ray Train's local mode leaves its train-function utilities set (pipeline/upstream/ray_train_session.py)."""
    from pipeline.upstream.ray_train_session import forget_train_session

    forget_train_session()


# --------------------------------------------------------------------------- checkpoints (the loop's side)


def commit(write: Callable[[Path], None], step: int) -> Path:
    """A checkpoint written by `write(directory)` into a temporary directory, renamed into place as
    `checkpoint_<step>` once complete and named in `latest.json`; older ones beyond `keep` are removed.
    A checkpoint half-written when the process died is never the latest."""
    directory = _active["dir"]
    tmp = directory / f".tmp-checkpoint_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    final = directory / f"checkpoint_{step:06d}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    named = directory / f".{LATEST}.tmp"
    named.write_text(json.dumps({"checkpoint": final.name, "step": step}))
    os.replace(named, directory / LATEST)
    older = sorted(p for p in directory.glob("checkpoint_*") if p != final)
    for old in older[:max(len(older) - (_active["keep"] - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest() -> Path | None:
    """The newest complete in-process checkpoint (`commit`), or None."""
    try:
        name = json.loads((_active["dir"] / LATEST).read_text())["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = _active["dir"] / name
    return path if path.is_dir() else None
