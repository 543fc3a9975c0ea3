"""`rollout.sync_transport: nccl`: the policy's weights from rank 0's GPU straight into each engine's GPUs.

The default transport (`object_store`) copies the merged weights to host memory on rank 0, puts them into Ray's
object store, and each engine copies them up to its GPU: two host copies of the model per sync, and the host
link twice. On GPUs OpenRLHF instead broadcasts each parameter from the trainer's rank 0 into an NCCL group of
rank 0 and the engines' workers. vLLM 0.32 ships that as its own API (`vllm.distributed.weight_transfer`): the
engine side is `LLM(weight_transfer_config={"backend": "nccl"})` and its workers' control calls
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`), the trainer
side `NCCLTrainerWeightTransferEngine`, which packs the tensors into buffers and broadcasts them while the
engine's workers receive them into a layerwise reload. This module only wires those parts to ours:

    PolicySource   the policy's merged weights as vLLM's `WeightSource`: `weight_chunks`, a tensor at a time
    Senders        a policy rank's trainer engines, one per rollout engine (`PPOWorker.connect_engines`)
    NcclEndpoint   mixed into the rollout engine's class: the calls vLLM's `RayVLLMWeightSyncClient` makes
    NcclSync       the driver's side: connects (again for a restarted engine), sends, tags the version

One NCCL group per engine, not one for all: vLLM numbers an engine's workers in the group by their data-parallel
index, and independent engines are all index 0. So a sync walks the policy's weights once per engine (under
ZeRO-3 every walk gathers chunk by chunk again, all ranks in step; without it only rank 0 walks).

What the transport needs (refused at validation, `placement.fits_layout`/`on_cpu`): GPUs (NCCL), layout separate
(a colocated engine takes the tensors in its own process already) and `gpus_per_process: 1` (NCCL cannot put two
ranks of one group on the same GPU). An engine that dies during a broadcast leaves rank 0 waiting in NCCL, which
has no timeout; the object store path has no such wait, which is one reason it stays the default.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Iterable


def policy_source(model, zero3: bool):
    """The policy's weights as vLLM's `WeightSource` (imported here: only a GPU run with this transport needs vLLM
    in a policy rank)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from stages.ppo.weight_chunks import weight_chunks

    class PolicySource(WeightSource):
        """`weight_chunks`'s chunks, a tensor at a time; `metadata()` from the first walk, kept (names, dtypes and
        shapes never change during a run; vLLM sizes the engine's receive buffers from it)."""

        def __init__(self):
            self.meta: list | None = None

        def metadata(self) -> list:
            if self.meta is None:  # under ZeRO-3 a collective like any walk: every rank asks for it in step
                self.meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self]
            return self.meta

        def __iter__(self):
            for chunk in weight_chunks(model, zero3):
                for name, tensor in chunk.items():
                    # Under ZeRO-3 a chunk is released when the next is gathered, and vLLM's packing may still hold
                    # the tensor for its buffer then: a copy of one tensor keeps it whole.
                    yield name, tensor.detach().clone() if zero3 else tensor.detach()

    return PolicySource()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Senders:
    """A policy rank's side of every engine's group: vLLM's trainer engine per rollout engine. Rank 0 sends; under
    ZeRO-3 the other ranks hold non-sending engines that only walk the weights (the gathers are collectives)."""

    def __init__(self, model, zero3: bool, rank: int):
        self.rank, self.zero3 = rank, zero3
        self.source = policy_source(model, zero3)
        self.engines: dict[int, Any] = {}

    def wanted(self) -> bool:
        return self.rank == 0 or self.zero3

    def connect(self, handles: dict[int, Any], world_size: int) -> None:
        """Join each given engine's new group (an old group of the same index, a restarted engine's, is closed)."""
        import ray
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if not self.wanted():
            return
        for index, handle in handles.items():
            old = self.engines.pop(index, None)
            if old is not None:
                old.shutdown()
            info = NCCLTrainerInitInfo(master_address=ray.util.get_node_ip_address(), master_port=free_port(),
                                       world_size=world_size, rank=self.rank)
            self.engines[index] = WeightTransferTrainerFactory.trainer_init(
                info, client=RayVLLMWeightSyncClient(handle), source=self.source)

    def send(self, indices: Iterable[int]) -> list | None:
        """The weights into each engine in `indices`; rank 0 returns [seconds, bytes sent to one engine]."""
        if not self.wanted():
            return None
        t0 = time.time()
        for index in indices:
            self.engines[index].send_weights()
        sent = sum(m.dtype.itemsize * _numel(m.shape) for m in self.source.metadata())
        return [time.time() - t0, sent] if self.rank == 0 else None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class NcclEndpoint:
    """Mixed into the rollout engine's class (`engine_class`): the calls vLLM's `RayVLLMWeightSyncClient` makes on
    each engine actor. vLLM's synchronous `LLM` has no such methods (its `AsyncLLM` has): like `AsyncLLM`, each goes
    to the engine's workers by `collective_rpc`, where vLLM's `Worker` holds the `NCCLWeightTransferEngine`."""

    def init_weight_transfer_engine(self, request) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": request.init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, request) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": request.update_info})

    def finish_weight_update(self) -> None:
        self.llm.collective_rpc("finish_weight_update")
        self.llm.reset_prefix_cache()  # no KV block computed with the old weights is reused

    def update_weight_version(self, version) -> None:
        """Tags what the engine generates from now on, as `RolloutEngine.load_weights(..., version)` does."""
        self.version = int(version)


def engine_class(base: type) -> type:
    """`base` (the rollout engine's class) taking weights over NCCL."""
    return type(f"Nccl{base.__name__}", (NcclEndpoint, base), {})


class NcclSync:
    """The driver's side of the transport (`Session.sync_weights`): connects the policy ranks to every engine's
    group at the first sync, again to an engine the pool restarts (`EnginePool.resync`, which also resends it the
    last weights), and has the ranks send."""

    def __init__(self, policy, pool, world_size: int):
        self.policy, self.pool, self.world_size = policy, pool, world_size
        self.connected, self.version = False, None
        pool.resync = self.resync

    def sync(self, version: int) -> tuple[float, int]:
        """The policy's weights into every engine, tagged `version`: (seconds, bytes each engine took)."""
        everyone = list(range(len(self.pool.engines)))
        if not self.connected:
            self._connect(everyone)
        self.version = version
        return self._send(everyone)

    def resync(self, dead: list[int]) -> None:
        if self.connected:
            self._connect(dead)
            if self.version is not None:
                self._send(dead)

    def _connect(self, indices: list[int]) -> None:
        self.policy.get("connect_engines", {i: self.pool.engines[i] for i in indices}, self.world_size)
        self.connected = True

    def _send(self, indices: list[int]) -> tuple[float, int]:
        import ray

        seconds, sent = self.policy.get("send_weights", indices)[0]
        ray.get([self.pool.engines[i].update_weight_version.remote(self.version) for i in indices])
        return seconds, sent
