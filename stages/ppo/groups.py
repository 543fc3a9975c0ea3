"""WholeModel / Workhorse: one model placed on a group of Ray actors, driven through a proxy.

    group = ModelGroup("policy", PPOWorker, num_ranks=2, cpus_per_rank=1, gpu=False)
    refs = group.run("setup", spec)              # same call on every rank -> one ref per rank
    refs = group.run_each("train", shards)       # rank r gets shards[r]
    group.get("logprobs", batch)                 # run + ray.get

A model is a *group* of Ray actors (the Workhorses), each holding one rank of it; the group's
ranks form their own torch process group (gloo on CPU, NCCL on GPU, each rank deciding from what Ray
gave it: `stages.common.devices`), so DeepSpeed inside them shards, all-reduces and gathers exactly as under any
launcher. The `ModelGroup` proxy (the WholeModel) fans a method call out to the ranks and hands
back their refs: traffic *between* models is Ray calls between groups, traffic *inside* a model
is collectives. The calls are explicit method names returning refs, like OpenRLHF's
`RayActorGroup.async_run_method` (no dispatch decorators): what runs where reads in the driver.

Placement: one placement group per model, one bundle per rank, strategy from the config (PACK
keeps a model's ranks together, SPREAD puts them on different nodes).
"""

from __future__ import annotations

import os
from typing import Any


class Workhorse:
    """Base of a rank actor: joins the group's process group. Subclasses add the model's methods."""

    def __init__(self, group: str, rank: int, world: int, env: dict[str, str]):
        import time

        from stages.common.devices import set_accelerator

        os.environ.update(env)
        set_accelerator()  # from the GPU Ray gave this actor, or none: read when deepspeed is imported
        self.group, self.rank, self.world = group, rank, world
        self.startup = {"born": time.time()}  # when this process reached its constructor; subclasses add parts

    def timings(self) -> dict[str, float]:
        """This rank's start-up: `born` (a wall-clock time) and the seconds of each part since."""
        return self.startup

    def master_address(self) -> tuple[str, int]:
        """Rank 0 hosts the group's rendezvous: this node's address and the port of the store it opens now.

        The store binds port 0 and keeps it: a port found free and bound later by the process group could be
        taken in between by another role's rendezvous or a Ray process starting at the same time, and the
        group then failed with EADDRINUSE (2026-12-01, one run in the suite)."""
        import datetime

        import ray
        import torch.distributed as dist

        address = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(address, 0, self.world, True, timeout=datetime.timedelta(minutes=30),
                                    wait_for_workers=False)  # the other ranks connect once they have the port
        return address, self._store.port

    def init_process_group(self, address: tuple[str, int]) -> int:
        """Join the group's process group at rank 0's `address` (its `master_address()`, passed as a ref), over NCCL
        when Ray gave this actor a GPU and gloo otherwise (`devices.process_backend`: decided here, not by the
        driver, which may be a CPU-only head)."""
        import datetime

        import torch
        import torch.distributed as dist

        from stages.common.devices import process_backend

        backend = process_backend()

        addr, port = address
        timeout = datetime.timedelta(minutes=30)
        # The env:// names DeepSpeed and torch read; LOCAL_RANK 0 because Ray gives each actor its own GPU.
        os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(self.rank),
                           "WORLD_SIZE": str(self.world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        store = self._store if self.rank == 0 else dist.TCPStore(addr, port, self.world, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        if backend == "gloo":
            import ray

            # Use the cores Ray granted this actor, not every core of the node (co-located ranks).
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
            torch.set_num_threads(max(1, int(cpus)))
        return self.rank

    def pid(self) -> int:
        return os.getpid()


class ModelGroup:
    """Proxy for one model placed on `num_ranks` Workhorse actors (one placement-group bundle each).

    Construction does not block: the placement group is requested, the actors created and their
    process group joined by calls queued on them, so several roles (and the rollout engines) start
    at once. Calls made on the group queue behind that; `ready_refs` (and `pg.ready()`) let the
    caller wait with a timeout. An actor class's `CONCURRENCY_GROUPS` (Ray concurrency groups)
    lets methods marked for another group run beside the default one."""

    def __init__(self, name: str, actor_cls: type, num_ranks: int, cpus_per_rank: float, gpu: float,
                 strategy: str = "PACK", env: dict[str, str] | None = None, runtime_env: dict | None = None,
                 wait: bool = True):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name
        bundle = {"CPU": cpus_per_rank, **({"GPU": float(gpu)} if gpu else {})}  # `gpu`: each rank's share of one
        self.pg = placement_group([bundle] * num_ranks, strategy=strategy, name=f"{name}-group")
        groups = getattr(actor_cls, "CONCURRENCY_GROUPS", None)  # declared at ray.remote, not in .options()
        remote = ray.remote(concurrency_groups=groups)(actor_cls) if groups else ray.remote(actor_cls)
        self.actors = [
            remote.options(num_cpus=cpus_per_rank, num_gpus=float(gpu), runtime_env=runtime_env,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg,
                                                                                placement_group_bundle_index=r))
            .remote(name, r, num_ranks, env or {})
            for r in range(num_ranks)
        ]
        address = self.actors[0].master_address.remote()  # resolved by Ray before the ranks' calls run
        self.ready_refs = [a.init_process_group.remote(address) for a in self.actors]
        if wait:
            ray.get(self.pg.ready(), timeout=300)
            ray.get(self.ready_refs)

    def __len__(self) -> int:
        return len(self.actors)

    def run(self, method: str, *args: Any, **kwargs: Any) -> list:
        """The same call on every rank; one ObjectRef per rank (collective methods need all ranks)."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def run_each(self, method: str, per_rank: list, **kwargs: Any) -> list:
        """Rank r is called with `per_rank[r]` (its data-parallel share); one ObjectRef per rank."""
        if len(per_rank) != len(self.actors):
            raise ValueError(f"{self.name}: {len(per_rank)} shards for {len(self.actors)} ranks")
        return [getattr(a, method).remote(x, **kwargs) for a, x in zip(self.actors, per_rank)]

    def get(self, method: str, *args: Any, **kwargs: Any) -> list:
        import ray

        return ray.get(self.run(method, *args, **kwargs))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        remove_placement_group(self.pg)


def shard(items: list, n: int) -> list[list]:
    """Split `items` into `n` contiguous, near-equal shares (data-parallel split; order kept)."""
    from stages.common.training import split_bounds

    b = split_bounds(len(items), n)
    return [items[b[r] : b[r + 1]] for r in range(n)]
