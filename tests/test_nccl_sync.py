"""`rollout.sync_transport: nccl` (stages/ppo/nccl_sync.py), proven on a CPU as far as one allows: NCCL itself needs
GPUs, so vLLM's NCCL calls (the trainer's endpoint and packed broadcast) are replaced by a stand-in wire, and
everything around them is vLLM's own: its trainer engine drives the round, its client's calls reach our engine, its
sender checks our source's declared metadata against what it yields, its EngineArgs take our engine arguments.
No GPU run of this transport exists; none is claimed."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch

from stages.common import lora
from stages.common.engines import distinct


def _tiny(lora_kind: str | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    if lora_kind:
        model = lora.wrap(model, lora.LoraSection(r=4, alpha=8), lora_kind)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)  # adapters away from their zero start: merging matters
    return model


class Wire:
    """Stands in for NCCL: what the trainer's packed broadcast sends, in order (vLLM's producer applies
    `post_iter_func` to each (name, tensor) and broadcasts the packed result)."""

    def __init__(self):
        self.groups, self.sent = [], []

    def endpoint(self, init_info, rank=0):
        self.groups.append((init_info.master_port, init_info.world_size, rank))
        return SimpleNamespace(destroy=lambda: None)

    def producer(self, iterator, group, src, post_iter_func, **_):
        assert src == 0
        self.sent.append([(name, post_iter_func((name, t)).clone()) for name, t in iterator])


class Client:
    """vLLM's RayVLLMWeightSyncClient, recording what it would ask one engine to do."""

    calls: list = []

    def __init__(self, handle):
        self.handle = handle

    def init_weight_transfer_engine(self, init_info):
        self.calls.append((self.handle, "init", init_info))

    def start_weight_update(self):
        self.calls.append((self.handle, "start", None))

    def update_weights(self, update_info):
        self.calls.append((self.handle, "update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append((self.handle, "finish", None))


@pytest.fixture
def wire(monkeypatch):
    from vllm.distributed.weight_transfer import clients, nccl_engine

    w = Wire()
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", w.endpoint)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", w.producer)
    monkeypatch.setattr(clients, "RayVLLMWeightSyncClient", Client)
    Client.calls = []
    return w


@pytest.mark.parametrize("lora_kind", [None, "causal"])
def test_the_policy_source_yields_what_it_declares_the_merged_weights_each_walk(lora_kind):
    """vLLM sizes the engine's receive buffers from `metadata()` and sends what iteration yields; its own sender
    check (`_checked_iter`) accepts ours, twice (a sync per iteration), and what it yields is the merged policy."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from stages.ppo.nccl_sync import policy_source

    model = _tiny(lora_kind)
    expected = distinct(lora.merged_state_dict(model))
    source = policy_source(model, zero3=False)
    for _ in range(2):
        got = dict(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
        assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert "lm_head.weight" not in got and not any("lora_" in k for k in got)  # tied once, merged


def test_a_round_goes_start_update_broadcast_finish_into_each_engines_own_group(wire):
    """Rank 0 opens one group per engine (rank 0 + the engine's tensor-parallel workers, at rank offset 1) and,
    each sync, drives vLLM's round for each engine: start, update (the names, dtypes and shapes the engine will
    receive), the broadcast of exactly those tensors, finish."""
    from stages.ppo.nccl_sync import Senders

    model = _tiny("causal")
    expected = distinct(lora.merged_state_dict(model))
    senders = Senders(model, zero3=False, rank=0)
    senders.connect({0: "engine-0", 1: "engine-1"}, world_size=3)
    inits = [c for c in Client.calls if c[1] == "init"]
    assert [h for h, *_ in inits] == ["engine-0", "engine-1"]
    assert all(i["rank_offset"] == 1 and i["world_size"] == 3 for *_, i in inits)
    assert len({port for port, *_ in wire.groups}) == 2 and all(w == 3 and r == 0 for _, w, r in wire.groups)
    Client.calls.clear()
    seconds, sent = senders.send([0, 1])
    assert [(h, what) for h, what, _ in Client.calls] == [
        (h, what) for h in ("engine-0", "engine-1") for what in ("start", "update", "finish")]
    update = Client.calls[1][2]
    assert update["names"] == list(expected)
    assert update["shapes"] == [list(t.shape) for t in expected.values()]
    assert update["dtype_names"] == ["float32"] * len(expected)
    assert len(wire.sent) == 2  # each engine got the whole model
    for round_ in wire.sent:
        assert [n for n, _ in round_] == list(expected) and all(torch.equal(t, expected[n]) for n, t in round_)
    assert sent == sum(t.numel() * 4 for t in expected.values()) and seconds >= 0


def test_without_zero3_only_rank_0_takes_part_and_under_it_every_rank_walks_in_step(wire, monkeypatch):
    """The gathers are collectives: under ZeRO-3 rank 1 holds non-sending engines that walk the weights each sync
    (gathering with rank 0) and never call an engine; without ZeRO-3 rank 1 has nothing to do."""
    import contextlib

    import deepspeed

    from stages.ppo.nccl_sync import Senders

    gathers = []

    @contextlib.contextmanager
    def gathered(params, modifier_rank=None, enabled=True):
        gathers.append(enabled)
        yield

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", gathered)
    idle = Senders(_tiny(None), zero3=False, rank=1)
    idle.connect({0: "engine-0"}, world_size=2)
    assert idle.send([0]) is None and not idle.engines and not gathers
    walker = Senders(_tiny(None), zero3=True, rank=1)
    walker.connect({0: "engine-0", 1: "engine-1"}, world_size=2)
    assert walker.send([0, 1]) is None
    assert not Client.calls and not wire.groups and not wire.sent  # no group, no call, no broadcast
    assert gathers and all(gathers)
    walks = len(gathers)
    walker.send([0, 1])
    assert len(gathers) == walks * 5 // 3  # the metadata walked once (kept), then one walk per engine per sync


class FakeLLM:
    """vLLM's `LLM`, recording its `collective_rpc` calls and refusing any other but the prefix-cache reset."""

    def __init__(self):
        self.calls = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, kwargs or {}))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", {}))


def test_the_engine_answers_every_call_vllms_client_makes_and_tags_its_version():
    """Every method vLLM's RayVLLMWeightSyncClient calls on an engine actor exists on ours (read from the client's
    source: a rename in vLLM fails here) and reaches a method of vLLM's own Worker (the CPU worker's too) with the
    keywords that method takes, as vLLM's AsyncLLM sends them; the round ends with the prefix cache cleared, and the
    version tags what the engine generates next."""
    import cloudpickle
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.v1.worker.cpu_worker import CPUWorker

    from stages.common.engines import RolloutEngine
    from stages.ppo.episodes import AgentEngine
    from stages.ppo.nccl_sync import engine_class

    called = set(re.findall(r"h\.(\w+)\.remote", inspect.getsource(RayVLLMWeightSyncClient)))
    assert {"init_weight_transfer_engine", "update_weights", "finish_weight_update"} <= called
    for base in (RolloutEngine, AgentEngine):
        cls = engine_class(base)
        assert issubclass(cls, base) and all(callable(getattr(cls, name, None)) for name in called)
        assert cloudpickle.loads(cloudpickle.dumps(cls)).__mro__[1:] == cls.__mro__[1:]  # as Ray ships it
    engine = object.__new__(engine_class(RolloutEngine))
    engine.llm, engine.version = FakeLLM(), 0
    engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"master_port": 1}))
    engine.start_weight_update()
    engine.update_weights(WeightTransferUpdateRequest(update_info={"names": ["w"]}))
    engine.finish_weight_update()
    engine.shutdown_weight_transfer_engine()
    engine.update_weight_version(3)
    assert [n for n, _ in engine.llm.calls] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                               "finish_weight_update", "reset_prefix_cache",
                                               "shutdown_weight_transfer_engine"]
    assert engine.llm.calls[0][1] == {"init_info": {"master_port": 1}}
    assert engine.llm.calls[2][1] == {"update_info": {"names": ["w"]}}
    for method, kwargs in engine.llm.calls[:-2] + engine.llm.calls[-1:]:  # each a worker method taking those keys
        params = inspect.signature(getattr(CPUWorker, method)).parameters
        assert set(kwargs) <= set(params) and all(p.default is not p.empty for n, p in params.items()
                                                  if n != "self" and n not in kwargs)
    assert engine.version == 3


def test_the_engine_is_built_with_vllms_transfer_config():
    from vllm.engine.arg_utils import EngineArgs

    from stages.common.engines import EngineSpec, llm_kwargs

    kwargs = llm_kwargs("m", EngineSpec(max_model_len=8, gpu=True, weight_transfer="nccl"), 0)
    assert EngineArgs(**kwargs).weight_transfer_config.backend == "nccl"  # vLLM's own arguments take it
    assert "weight_transfer_config" not in llm_kwargs("m", EngineSpec(max_model_len=8, gpu=True), 0)


def _ppo(**kw):
    from stages.ppo.config import PPOConfig

    return PPOConfig.model_validate(kw)


def test_nccl_is_refused_where_it_cannot_run(monkeypatch):
    """Colocated (no transport there), a GPU fraction (NCCL cannot join two ranks on one GPU), a Ray without GPUs
    (at load and at the stage's start); accepted in layout separate with a GPU a process."""
    import ray

    from pipeline.config import load_config
    from pipeline.errors import UserError
    from stages.ppo.roles import _check_cluster

    nccl = {"sync_transport": "nccl"}
    assert _ppo(layout="separate", rollout=nccl).rollout.sync_transport == "nccl"
    assert _ppo().rollout.sync_transport == "object_store"
    with pytest.raises(ValueError, match="in layout colocated each rank's engine takes its trainer's tensors"):
        _ppo(layout="colocated", rollout=nccl)
    with pytest.raises(ValueError, match="NCCL cannot join two processes on one GPU, but gpus_per_process is 0.5"):
        _ppo(layout="separate", gpus_per_process=0.5, rollout=nccl)
    with pytest.raises(ValueError, match="object_store"):
        _ppo(layout="separate", rollout={"sync_transport": "ipc"})
    with pytest.raises(UserError, match="sync_transport is nccl, but the Ray cluster has no GPUs"):
        load_config("configs/smoke.yaml", ["ray.num_gpus=0", "stages.ppo.layout=separate",
                                           "stages.ppo.rollout.sync_transport=nccl"])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64})
    with pytest.raises(UserError, match="sync_transport is nccl, but the Ray cluster has no GPUs"):
        _check_cluster(_ppo(layout="separate", rollout=nccl), gpu=False)


class Policy:
    def __init__(self):
        self.calls = []

    def get(self, method, *args):
        self.calls.append((method, *args))
        return [[0.5, 1024]] if method == "send_weights" else [None]


class Engine:
    def __init__(self):
        self.versions = []
        self.update_weight_version = SimpleNamespace(remote=self.versions.append)


def test_the_driver_connects_once_sends_each_sync_and_brings_a_restarted_engine_up_to_date(monkeypatch):
    """NcclSync: the first sync connects the policy ranks to every engine, later syncs only send; an engine the
    pool restarts (`EnginePool.revive` -> `resync`) gets a new group and the last weights, tagged with their
    version, not the object store's (which holds nothing with this transport)."""
    import ray

    from stages.common.engines import EnginePool
    from stages.ppo.nccl_sync import NcclSync

    monkeypatch.setattr(ray, "get", lambda x, **_: x)
    pool = SimpleNamespace(engines=[Engine(), Engine()], resync=None)
    policy = Policy()
    sync = NcclSync(policy, pool, world_size=2)
    sync.resync([0])  # a restart before any sync: the engine starts from the policy's own model
    assert not policy.calls
    assert sync.sync(1) == (0.5, 1024)
    assert sync.sync(2) == (0.5, 1024)
    assert [c[0] for c in policy.calls] == ["connect_engines", "send_weights", "send_weights"]
    assert list(policy.calls[0][1]) == [0, 1] and policy.calls[0][2] == 2
    assert [e.versions for e in pool.engines] == [[1, 2], [1, 2]]
    policy.calls.clear()
    # EnginePool.revive on a pool whose engine 1 died: restarted, then handed to resync (not load_weights)
    real = EnginePool.__new__(EnginePool)
    dead = SimpleNamespace(ping=SimpleNamespace(remote=lambda: (_ for _ in ()).throw(ray.exceptions.RayActorError())))
    alive = SimpleNamespace(ping=SimpleNamespace(remote=lambda: 1))
    real.engines, real.restarts, real.weights_ref, real.version = [alive, dead], 0, None, None
    fresh = Engine()
    fresh.ping = alive.ping
    monkeypatch.setattr(ray, "kill", lambda actor: None)
    real._start = lambda i: fresh
    pool.engines, real.resync = real.engines, sync.resync
    assert real.revive() == [1] and real.engines[1] is fresh
    assert [c[0] for c in policy.calls] == ["connect_engines", "send_weights"]
    assert list(policy.calls[0][1]) == [1] and policy.calls[1][1] == [1]
    assert fresh.versions == [2]
