"""What the ppo stage asks Ray for: one bundle per rank and per engine, by layout and by whether the cluster has GPUs.

The driver decides only what to ask for (from the cluster's GPUs, `devices.cluster_gpus`); each process then computes
on what Ray gave it (`devices.process_device`). One function says what is asked (`bundles`), so the stage's placement
groups, the CPU and GPU counts checked at load and at start, and their tests read the same numbers:

- layout **colocated**: one bundle per policy rank, holding every role and the rank's own engine;
- layout **separate**: a bundle per rank of each role that has ranks of its own (the reference has none when it is
  the LoRA policy's adapter switched off or sits in the policy ranks), and one per rollout engine.

Each layout's module says its own (`bundles`, `refuse`: stages/ppo/layouts/).

On GPUs every bundle holds `gpus_per_process` of a GPU: 1 gives each process a GPU of its own; a fraction packs
several on one (0.25: four processes a GPU, as OpenRLHF's colocate_all; then set rollout.gpu_memory_utilization so
that the engines leave room for the trainers). An engine of `rollout.tensor_parallel_size` N holds N whole GPUs.
What a layout cannot place or hold is refused at validation (`fits_layout`).
"""

from __future__ import annotations


def bundles(cfg, gpu: bool) -> dict[str, list[dict[str, float]]]:
    """Each process group's bundles (`{"CPU": n, "GPU": share}`), as the stage asks Ray for them: its layout's."""
    from stages.ppo.layouts import layout_of

    return layout_of(cfg).bundles(cfg, gpu)


def needed(cfg, resource: str) -> float:
    """The logical CPUs ("CPU") or GPUs ("GPU") the stage reserves at once, on a cluster with GPUs."""
    return sum(b.get(resource, 0) for group in bundles(cfg, True).values() for b in group)


def shortfall(cfg, gpus: float, error: type[Exception] | None = None) -> None:
    """Refuse, naming the count, a stage whose processes need more GPUs than the cluster's `gpus` (on GPUs only);
    `error`: ValueError in a config's check hook, else UserError."""
    from stages.common.devices import check_gpus

    processes = sum(len(group) for group in bundles(cfg, True).values())
    check_gpus(needed(cfg, "GPU"), gpus, f"stages.ppo: {processes} processes (layout {cfg.layout}) at "
               f"gpus_per_process {cfg.gpus_per_process:g}", "use fewer ranks or engines, a fraction "
               "gpus_per_process (several processes a GPU), layout colocated, a larger cluster, or ray.num_gpus: 0 "
               "to run on the CPU", error)


def on_cpu(cfg, error: type[Exception] | None = None) -> None:
    """Refuse what needs GPUs on a cluster without them (`error` as in `shortfall`)."""
    from pipeline.errors import UserError

    if cfg.rollout.tensor_parallel_size > 1:
        raise (error or UserError)(f"stages.ppo.rollout.tensor_parallel_size is {cfg.rollout.tensor_parallel_size}, "
                                   "but the Ray cluster has no GPUs (vLLM's CPU engines here run one process "
                                   "each); set it to 1, or run on GPUs")
    if cfg.rollout.sync_transport == "nccl":
        raise (error or UserError)("stages.ppo.rollout.sync_transport is nccl, but the Ray cluster has no GPUs (NCCL "
                                   "joins GPUs); set it to object_store, or run on GPUs")


def fits_layout(cfg) -> None:
    """What cannot be placed, then what the layout cannot do (its `refuse`), refused at validation with the
    reason and the fix (docs/architecture.md, docs/rl.md)."""
    from stages.ppo.layouts import layout_of

    tp = cfg.rollout.tensor_parallel_size
    if tp > 1 and cfg.gpus_per_process != 1:
        raise ValueError(f"rollout.tensor_parallel_size {tp}: each of an engine's {tp} shards needs a GPU of its own, "
                         f"but gpus_per_process is {cfg.gpus_per_process:g}; set gpus_per_process: 1, or "
                         "rollout.tensor_parallel_size: 1")
    if cfg.rollout.sync_transport == "nccl" and cfg.gpus_per_process != 1:
        raise ValueError(f"rollout.sync_transport nccl: NCCL cannot join two processes on one GPU, but "
                         f"gpus_per_process is {cfg.gpus_per_process:g}; set gpus_per_process: 1, or "
                         "rollout.sync_transport: object_store")
    layout_of(cfg).refuse(cfg)
