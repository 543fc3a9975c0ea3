"""Training mechanisms shared by the Train stages (Ray Train V2 + DeepSpeed) and PPO's roles.

The one Train loop is `stages.common.train_loop` (sft, reward and dpo each give it their objective); this
module holds the plumbing it and PPO's workers need:
building the `TorchTrainer`, a rank-0 MLflow logger, padding, checkpoints that carry the
DeepSpeed state (optimizer, scheduler) plus the position in the data (with LoRA: the adapter only,
as safetensors), saving a HF model (gathering ZeRO-3 shards first), and scoring with a reward
model (the reward stage's output, read by PPO and batch inference).

Checkpoints: every rank writes its DeepSpeed shard into a local directory and reports it; Ray
Train merges them into one checkpoint under `storage_path/name`. A rerun with the same
`RunConfig(name, storage_path)` (the stage's cache key) resumes from the latest one (docs/architecture.md,
fact 9), so an interrupted stage continues where it stopped instead of starting over.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline import events, faults
from stages.common import in_process
from stages.common.deepspeed import TrainingConfig, backend

if TYPE_CHECKING:
    from pipeline.run_storage import RunStorage

STATE_FILE = "trainer_state.json"
DS_TAG = "ds"


# --------------------------------------------------------------------------- driver side


def fit(loop: Callable[[dict], None], loop_config: dict, tcfg: TrainingConfig, splits: dict[str, Path],
        checkpoints: Path, run_storage: RunStorage, gpu: bool, callbacks: list | tuple = ()):
    """Run `loop` on `tcfg.num_workers` Ray Train workers; return the Ray Train `Result`.

    `splits` names the Parquet directories the workers read (`split(c, name)` on the worker side).
    `loop_config` reaches every worker; it carries `run_storage` under "storage" for workers that
    pull their inputs (`c["storage"].localize(path)`). `callbacks` are Ray Train callbacks, e.g.
    Tune's `TuneReportCallback` inside a sweep's trial.
    """
    from ray.data import ExecutionOptions
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from stages.common.parquet import read_parquet

    direct = direct_splits(splits)
    datasets = {name: read_parquet(path, run_storage) for name, path in splits.items() if name not in direct}

    # With an object store the checkpoints live in the bucket (any node's restarted workers read
    # them there); otherwise in the local (or shared) checkpoint directory.
    storage_path, storage_fs = run_storage.target(checkpoints)
    if storage_fs is None:
        checkpoints.mkdir(parents=True, exist_ok=True)
    # Not split by Ray Train: every worker reads the whole split in file order and keeps its slice
    # of each global batch (`rank_batches`). Ray Data's `streaming_split` (materialised or not)
    # hands blocks to workers in an order that depends on how the read was partitioned at the
    # time, so the same config trained on different batches from run to run: seed 2's SFT policy
    # ended at 0.600 in one run and 0.739 in the next (docs/architecture.md, fact 15). The workers
    # replay their batches from memory after the first pass (`ReplayBatches`).
    for ds in datasets.values():  # every worker reads every split: no progress bars in the forwarded worker logs
        ds.context.enable_progress_bars = False
    if in_process.wanted(tcfg.num_workers, callbacks, storage_fs, gpu):  # one CPU worker: the driver trains
        for ds in datasets.values():  # what DataConfig below says; local mode does not read it
            ds.context.execution_options.preserve_order = True
        return in_process.fit(lambda config: TorchTrainer(
            loop, train_loop_config={**config, "storage": run_storage, "splits": direct},
            torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=0),
            datasets=datasets), loop_config, checkpoints, tcfg.keep_checkpoints, tcfg.max_failures, events.say)
    trainer = TorchTrainer(
        loop,
        train_loop_config={**loop_config, "storage": run_storage, "splits": direct},
        # use_gpu gives every worker a GPU of its own, so NCCL is every worker's backend; each worker chooses its
        # DeepSpeed accelerator from what it sees (devices.set_accelerator, in startup.import_deepspeed)
        torch_config=TorchConfig(backend=backend(gpu)),
        scaling_config=ScalingConfig(num_workers=tcfg.num_workers, use_gpu=gpu,
                                     placement_strategy=tcfg.placement_strategy),
        datasets=datasets,
        # Same order every epoch and every attempt: resuming skips exactly the batches already seen.
        dataset_config=DataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True)),
        run_config=RunConfig(
            name="train",
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            checkpoint_config=CheckpointConfig(num_to_keep=tcfg.keep_checkpoints),
            failure_config=FailureConfig(max_failures=tcfg.max_failures),
            callbacks=list(callbacks),
            # the fault drills (pipeline/faults.py) reach the workers, for resume tests.
            worker_runtime_env={"env_vars": faults.worker_env()},
        ),
    )
    return fit_and_end_controller(trainer)


def fit_and_end_controller(trainer):
    """`trainer.fit()`, with its TrainController ended when it returns, and Ctrl-C left to the pipeline
    (why: pipeline/upstream/ray_train_sigint.py)."""
    from pipeline.upstream.ray_train_sigint import controllers_ended

    workers = getattr(getattr(trainer, "scaling_config", None), "num_workers", "?")
    events.record_start("train_groups", detail=f"{workers} worker(s)")
    with controllers_ended(trainer):
        return trainer.fit()


def direct_splits(splits: dict[str, Path]) -> dict[str, str]:
    """The splits each worker reads straight from their files (`ParquetSplit`): the small ones. A large one
    streams through Ray Data (`fit`)."""
    return {name: str(path) for name, path in splits.items() if parquet_bytes(path) <= DIRECT_READ_MAX_BYTES}


def tokenizer_and_ray(model_dir: Path, ctx):
    """The tokenizer of `model_dir`, loaded while Ray starts (`ctx.ray()`, which stays on the main thread:
    it installs a signal handler): importing transformers is seconds of CPU, and Ray's start-up mostly waits
    on the daemons it spawns, so the two overlap instead of adding up."""
    from concurrent.futures import ThreadPoolExecutor

    from stages.common.models import load_tokenizer

    with ThreadPoolExecutor(1) as loader:
        tok = loader.submit(load_tokenizer, model_dir)
        ctx.ray()
        return tok.result()


def export(result, out: Path, tokenizer, base: Path | None = None, kind: str = "causal",
           num_labels: int = 1) -> dict[str, float]:
    """The final checkpoint's model (+ tokenizer) as an HF directory at `out`; return the final metrics.
    `num_labels`: a sequence classifier's outputs (a reward model's heads).

    A LoRA checkpoint holds the adapter only: it is merged into `base` here (`lora.merge_into`), and
    kept beside the model (`out.parent / "adapter"`) for base + adapter serving."""
    import shutil

    from stages.common import lora

    with result.checkpoint.as_directory() as d:
        adapter = Path(d) / lora.ADAPTER_DIR
        if adapter.is_dir():
            lora.merge_into(base, adapter, kind, out, tokenizer.pad_token_id, num_labels)
            shutil.copytree(adapter, out.parent / lora.ADAPTER_DIR)
            tokenizer.save_pretrained(out.parent / lora.ADAPTER_DIR)
        else:
            shutil.copytree(Path(d) / "hf", out)
    tokenizer.save_pretrained(out)
    return {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}


# --------------------------------------------------------------------------- worker side


def pad(seqs: list, value: int, dtype=None):
    """Right-pad ragged int sequences into a (B, L) tensor; returns (tensor, attention mask)."""
    import torch

    longest = max(len(s) for s in seqs)
    out = torch.full((len(seqs), longest), value, dtype=dtype or torch.long)
    attn = torch.zeros((len(seqs), longest), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s), dtype=out.dtype)
        attn[i, : len(s)] = 1
    return out, attn


def split_bounds(n: int, parts: int) -> list[int]:
    """Where `n` items split into `parts` contiguous, near-equal shares: share r is [b[r], b[r + 1]), and
    the first n % parts shares hold one item more. The one data-parallel split of the project (Train
    workers' slices of a global batch, PPO ranks' and engines' shares)."""
    k, extra = divmod(n, parts)
    return [r * k + min(r, extra) for r in range(parts + 1)]


def rank_slices(batch: dict, rank: int, world: int) -> dict | None:
    """Rank `rank`'s contiguous share of a global batch (column -> array), by `split_bounds`; None when
    nothing is left for it."""
    b = split_bounds(len(next(iter(batch.values()))), world)
    start, stop = b[rank], b[rank + 1]
    return {k: v[start:stop] for k, v in batch.items()} if stop > start else None


def rank_batches(dataset, micro: int, rank: int, world: int, collate_fn: Callable, drop_last: bool = True):
    """This rank's collated micro-batches of a whole (unsplit) Ray Data split, in file order.

    Global micro-batch k is rows [k * micro * world, (k + 1) * micro * world) and rank r trains on its
    r-th slice: the batches are a pure function of the files and `micro * world`, whatever Ray Data's
    block layout, so a rerun trains on exactly the same batches (what `DistributedSampler` gives a
    map-style PyTorch dataset). Each worker reads the whole split; for the token-id Parquet of a
    post-training set that costs far less than the training itself."""
    for batch in dataset.iter_batches(batch_size=micro * world, drop_last=drop_last, batch_format="numpy"):
        mine = rank_slices(batch, rank, world)
        if mine is not None:
            yield collate_fn(mine)


def reward_scores(model, tok, pairs: list[tuple[str, str]], micro: int) -> list[list[float]]:
    """A reward model's scores of each (prompt, response), formatted as in its training data (one
    chat turn each, the data stage's template): one list per pair with a score per head (one
    without `stages.reward.heads`; `ensemble_score` combines them). `model` is an HF sequence
    classifier or a DeepSpeed engine around one. Used by PPO's reward role and by batch inference."""
    import torch

    from stages.common.devices import on_device

    texts = [tok.apply_chat_template([{"role": "user", "content": str(p)}, {"role": "assistant", "content": str(r)}],
                                     tokenize=False) for p, r in pairs]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    # Micro-batches of similar lengths: padding is compute thrown away (a quarter of it on mixed-length
    # answers); the scores go back in the callers' order.
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[list[float]] = [[] for _ in ids]
    call = on_device(model)  # the CPU batches on the model's device (stages/common/devices.py)
    with torch.no_grad():
        for i in range(0, len(order), micro):
            part = order[i : i + micro]
            input_ids, attn = pad([ids[j] for j in part], tok.pad_token_id)
            for j, v in zip(part, call(input_ids=input_ids, attention_mask=attn).logits.float().tolist()):
                out[j] = v
    return out


def ensemble_score(heads: list[float], how: str = "mean", coef: float = 1.0) -> float:
    """One reward from an ensemble's scores of a response (`stages.ppo.rewards.ensemble`): their `mean`,
    their `min` (worst-case optimisation), or `lcb`, mean - coef * std (uncertainty-weighted
    optimisation; std over heads, population form). Coste et al. 2023 ("Reward Model Ensembles Help
    Mitigate Overoptimization") found the conservative two keep the gold reward up longer: where the
    policy drifts off the data the heads disagree, and disagreement is what they penalise. One head:
    its score, whatever `how`."""
    n = len(heads)
    mean = sum(heads) / n
    if how == "mean" or n == 1:
        return mean
    if how == "min":
        return min(heads)
    if how == "lcb":
        return mean - coef * head_spread(heads)
    raise ValueError(f"ensemble: unknown combination {how!r} (mean, min or lcb)")


def head_spread(heads: list[float]) -> float:
    """Population std of an ensemble's scores of one response: how much its heads disagree."""
    mean = sum(heads) / len(heads)
    return (sum((h - mean) ** 2 for h in heads) / len(heads)) ** 0.5


# Splits up to this many bytes of Parquet are read by each worker with pyarrow (`ParquetSplit`).
DIRECT_READ_MAX_BYTES = 256 * 2**20


def parquet_bytes(path: Path) -> int:
    """Size of a split's Parquet files (the driver always holds the run's artifacts locally)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.parquet"))


class ParquetSplit:
    """A small split's Parquet files read by a worker with pyarrow, behind the `iter_batches` of a
    Ray Data dataset (all `rank_batches` calls): the same rows in the same order, in batches of
    the same size.

    Why not Ray Data for these: every worker reads the whole split anyway (docs/architecture.md,
    fact 15), and one Ray Data execution costs 5-20 s of task scheduling on a 2-core machine, and
    minutes on a loaded cluster whose read tasks wait for CPUs, for splits of a few thousand rows
    that pyarrow reads in milliseconds. Splits above `DIRECT_READ_MAX_BYTES` stream through Ray
    Data (`fit`). A node without the run's artifacts pulls the split from the object store first.
    """

    def __init__(self, path: str, run_storage: RunStorage | None = None):
        self.path, self.run_storage = path, run_storage

    def iter_batches(self, batch_size: int, drop_last: bool = False, batch_format: str = "numpy"):
        import pyarrow.parquet as pq

        assert batch_format == "numpy", batch_format
        local = self.run_storage.localize(self.path) if self.run_storage is not None else self.path
        files = sorted(Path(local).glob("*.parquet"))  # Ray Data's file order too
        if not files:
            return
        table = pq.ParquetDataset(files).read()
        n = table.num_rows
        for start in range(0, n - n % batch_size if drop_last else n, batch_size):
            part = table.slice(start, batch_size)
            yield {name: part.column(name).to_numpy(zero_copy_only=False) for name in part.column_names}


def split(c: dict, name: str):
    """On a worker: split `name` of `fit`'s `splits`, to iterate with `ReplayBatches` / `EvalBatches`."""
    if name in c.get("splits", {}):
        return ParquetSplit(c["splits"][name], c["storage"])
    import ray.train

    return ray.train.get_dataset_shard(name)


class ReplayBatches:
    """This rank's collated micro-batches of one split: read through Ray Data on the first complete
    pass, replayed from worker memory after (every epoch, every evaluation).

    Every pass over a Ray Data dataset is a new streaming execution, which costs 15-20 s of
    scheduling on a 2-core machine even for a few thousand rows, and since every rank reads the
    whole split (`rank_batches`) each pass costs that on every rank. The batches are the same at
    every pass (file order, same slicing), so replaying them trains and evaluates exactly as
    streaming would. Only a complete pass is kept (training stops mid-epoch at its last step), and
    a split larger than `max_rows` rows per rank is streamed every time instead of held in memory.
    """

    def __init__(self, dataset, micro: int, collate_fn: Callable, rank: int = 0, world: int = 1,
                 drop_last: bool = True, max_rows: int = 1_000_000) -> None:
        self.dataset, self.micro, self.collate_fn, self.rank, self.world = dataset, micro, collate_fn, rank, world
        self.drop_last, self.max_rows = drop_last, max_rows
        self.batches: list | None = None
        self.passes = 0  # Ray Data executions started (for tests and logs)

    def __iter__(self):
        if self.batches is not None:
            yield from self.batches
            return
        self.passes += 1
        read: list | None = []
        rows = 0
        for batch in rank_batches(self.dataset, self.micro, self.rank, self.world, self.collate_fn,
                                  drop_last=self.drop_last):
            if read is not None:
                rows += len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch)
                if rows <= self.max_rows:
                    read.append(batch)
                else:
                    read = None  # too large to hold: streamed on every pass
            yield batch
        if read is not None:
            self.batches = read  # only a complete pass is kept


def EvalBatches(dataset, micro: int, collate_fn: Callable, rank: int = 0, world: int = 1) -> ReplayBatches:
    """The eval split's `ReplayBatches`: every row is scored (no partial batch dropped)."""
    return ReplayBatches(dataset, micro, collate_fn, rank, world, drop_last=False)


def first_step(clock, log) -> None:
    """At each optimizer step's start: the first one ends the stage's start-up (`events.StartupClock`),
    which rank 0 shows on the console and logs to MLflow at step 0. Reading the first batch is its
    last part (`data`)."""
    if clock.total is not None:
        return
    clock.mark("data")
    clock.done()
    log.log(clock.metrics(), 0)
    log.print(clock.line("first optimizer step"))


def init_engine(model, ds_config: dict):
    """DeepSpeed engine over Ray Train's already-initialised process group."""
    from stages.common.startup import import_deepspeed

    deepspeed = import_deepspeed()

    from stages.common.deepspeed import for_device
    from pipeline.upstream.deepspeed_loads import safe_checkpoint_loads
    from stages.common.devices import process_device

    # Only what trains gets optimizer state (all of it, or a LoRA adapter and its score head); on a GPU torch's
    # AdamW, not the FusedAdam that needs nvcc (`for_device`)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable,
                                           config=for_device(ds_config, process_device()))
    safe_checkpoint_loads(engine)
    return engine


def restore(engine) -> dict:
    """Load the latest reported checkpoint into `engine` (in the driver: the latest `in_process.commit`);
    return its trainer state (or a fresh one)."""
    import contextlib

    import ray.train

    checkpoint = ray.train.get_checkpoint()
    local = in_process.latest() if checkpoint is None and in_process.active() else None
    if checkpoint is None and local is None:
        return {"step": 0, "epoch": 0, "micro_in_epoch": 0}
    with contextlib.nullcontext(str(local)) if local else checkpoint.as_directory() as d:
        load_checkpoint(engine, Path(d))
        return json.loads((Path(d) / STATE_FILE).read_text())


def save_checkpoint(engine, directory: Path, rank: int) -> None:
    """DeepSpeed's state of `engine` (collective); with LoRA the model part is the adapter only, which
    rank 0 also writes as safetensors (`adapter/`), what resuming and merging read."""
    from stages.common import lora

    peft = lora.is_peft(engine.module)
    if peft:
        lora.exclude_tied_frozen_weights(engine)
    engine.save_checkpoint(str(directory), tag=DS_TAG, exclude_frozen_parameters=peft)
    if peft and rank == 0:
        lora.save_adapter(engine.module, Path(directory) / lora.ADAPTER_DIR)


def load_checkpoint(engine, directory: Path) -> None:
    """Counterpart of `save_checkpoint`: optimizer and scheduler state, and the weights. Every file is
    unpickled by the allow-listed `weights_only` load (`upstream.deepspeed_loads.weights_only_loads`), whichever
    checkpoint engine the DeepSpeed config picked."""
    from stages.common import lora
    from pipeline.upstream.deepspeed_loads import weights_only_loads

    peft = lora.is_peft(engine.module)
    with weights_only_loads():
        engine.load_checkpoint(str(directory), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True,
                               load_module_strict=not peft)  # a LoRA checkpoint holds no base weights
    if peft:
        lora.load_adapter(engine.module, Path(directory) / lora.ADAPTER_DIR)


def save_hf(engine, directory: Path, rank: int) -> None:
    """Write the full model in HF format on rank 0 (collective: every rank must call it); a LoRA model
    is written merged (`lora.merged_state_dict`)."""
    import deepspeed

    from stages.common import lora

    params = list(engine.module.parameters())
    zero3 = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero3):
        if rank == 0:
            state = {k: v.detach().cpu().clone() for k, v in lora.merged_state_dict(engine.module).items()}
            lora.base_of(engine.module).save_pretrained(directory, state_dict=state, safe_serialization=True)


def report(engine, state: dict, metrics: dict[str, Any], rank: int, with_checkpoint: bool) -> None:
    """`ray.train.report` from every rank; with a checkpoint: DeepSpeed state, trainer state, HF model."""
    import ray.train
    from ray.train import Checkpoint

    if not with_checkpoint:
        ray.train.report(metrics)
        return
    from stages.common import lora

    def write(d: Path) -> None:
        save_checkpoint(engine, d, rank)
        if not lora.is_peft(engine.module):  # a LoRA adapter is merged by `export`, once, on the driver
            save_hf(engine, d / "hf", rank)
        if rank == 0:
            (d / STATE_FILE).write_text(json.dumps(state))

    if in_process.active():  # Ray Train's local mode keeps no checkpoint of its own
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(in_process.commit(write, state["step"])))
        return
    with tempfile.TemporaryDirectory() as d:
        write(Path(d))
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum floats over all ranks (gloo or NCCL, whichever group Ray Train set up)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
    return t.cpu().tolist()
