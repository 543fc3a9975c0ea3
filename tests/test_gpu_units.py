"""The GPU path's decisions, proven on a CPU (issue 68): where a Train stage's batches compute, who decides a
process's device, backend and DeepSpeed accelerator (the process, from what Ray gave it), what the driver asks Ray
for (by layout and by the cluster's GPUs, refused with the count when they are short), one-worker training kept out
of the driver on GPUs, the engines' dtype, and the colocated engine's sleep and wake order (against a recording
fake of vLLM's calls). No GPU and no Ray here: a module on the `meta` device refuses inputs elsewhere, as one on a
GPU does, and torch's CUDA queries are patched where a process is to see a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stages.common import devices

META = torch.device("meta")


class MetaClassifier(torch.nn.Module):
    """A sequence classifier on the meta device that refuses inputs on another device."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, 4, device=META))
        self.seen: list[torch.device] = []

    def forward(self, input_ids, attention_mask):
        for t in (input_ids, attention_mask):
            if t.device != self.weight.device:
                raise RuntimeError("Expected all tensors to be on the same device")
        self.seen.append(input_ids.device)
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], 1))  # a CPU answer: .tolist() needs data


def _cuda(monkeypatch, available: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


# --------------------------------------------------------------------------- a Train stage's batches


def test_a_train_stages_batches_reach_the_engines_device_and_stay_on_the_cpu_between_passes():
    """train_loop.worker wraps each split's ReplayBatches in OnDevice(engine's device): every micro-batch the
    objective's loss and evaluation see is on the model's device, the replayed ones kept on the CPU."""
    from stages.common.training import ReplayBatches

    rows = [{"input_ids": torch.ones(2, 3, dtype=torch.long), "n": 2}] * 3
    replay = ReplayBatches(None, 2, lambda x: x)
    replay.batches = rows  # as after a complete first pass
    on = devices.OnDevice(replay, META)
    for _ in range(2):  # every epoch
        seen = list(on)
        assert [b["input_ids"].device for b in seen] == [META] * 3 and seen[0]["n"] == 2
    assert {b["input_ids"].device.type for b in replay.batches} == {"cpu"}


def test_the_train_loop_hands_the_objective_its_batches_on_the_engines_device():
    """The loop's own wiring, read from its code object: it builds both splits' batches through OnDevice."""
    import inspect

    from stages.common import train_loop

    source = inspect.getsource(train_loop.worker)
    assert source.count("devices.OnDevice(training.") == 2 and "device_of(engine)" in source


def test_reward_scores_call_the_model_on_its_device():
    """PPO's reward role and batch inference score with `training.reward_scores`: CPU batches, a model anywhere."""
    from stages.common.training import reward_scores

    class Tok:  # what reward_scores asks of a tokenizer: the chat template, token ids, the pad id
        pad_token_id = 0

        def apply_chat_template(self, messages, tokenize):
            return " ".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [1 + len(w) for w in text.split()]}

    model = MetaClassifier()
    scores = reward_scores(model, Tok(), [("a", "b"), ("c", "d e")], micro=1)
    assert model.seen == [META, META] and scores == [[0.0], [0.0]]


def test_the_train_stages_engine_never_needs_a_compiler_on_a_gpu(monkeypatch):
    """init_engine gives DeepSpeed `for_device(config, the process's device)`: torch's AdamW on CUDA."""
    from stages.common import training

    seen = {}

    class FakeDeepSpeed:
        @staticmethod
        def initialize(model, model_parameters, config):
            seen["config"] = config
            return SimpleNamespace(load_checkpoint=lambda *a, **k: None), None, None, None

    monkeypatch.setattr("stages.common.startup.import_deepspeed", lambda: FakeDeepSpeed)
    _cuda(monkeypatch)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    training.init_engine(torch.nn.Linear(2, 2), config)
    assert seen["config"]["optimizer"]["params"]["torch_adam"] is True
    _cuda(monkeypatch, False)
    training.init_engine(torch.nn.Linear(2, 2), config)
    assert "torch_adam" not in seen["config"]["optimizer"]["params"]  # the CPU path as before


# --------------------------------------------------------------------------- decided in the process


def test_a_process_chooses_its_backend_and_accelerator_from_what_it_sees(monkeypatch):
    """Not the driver's choice: a GPU worker of a CPU-only head gets NCCL and CUDA, a CPU one gloo and CPU; a value
    the user set for DS_ACCELERATOR is kept."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    _cuda(monkeypatch)
    assert devices.process_backend() == "nccl" and devices.set_accelerator() == "cuda"
    monkeypatch.delenv("DS_ACCELERATOR")
    _cuda(monkeypatch, False)
    assert devices.process_backend() == "gloo" and devices.set_accelerator() == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    assert devices.set_accelerator() == "xpu"


def test_a_ppo_rank_sets_its_accelerator_in_its_own_process(monkeypatch):
    """Workhorse (every ppo rank's base) chooses DS_ACCELERATOR when Ray starts it: the driver passes none."""
    from stages.ppo.groups import Workhorse

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    _cuda(monkeypatch)
    Workhorse("policy", 0, 1, {})
    import os

    assert os.environ["DS_ACCELERATOR"] == "cuda"


def test_deepspeed_is_imported_with_the_processs_own_accelerator(monkeypatch):
    from stages.common import startup

    chosen = []
    monkeypatch.setattr(devices, "set_accelerator", lambda: chosen.append(1) or "cpu")
    startup.import_deepspeed()
    assert chosen == [1]


# --------------------------------------------------------------------------- what the driver asks Ray for


def test_one_worker_training_stays_out_of_the_driver_on_gpus():
    from stages.common import in_process

    assert in_process.wanted(1, [], None) and in_process.wanted(1, [], None, gpu=False)
    assert not in_process.wanted(1, [], None, gpu=True)  # a Ray Train worker holds the GPU by reservation


def test_the_driver_counts_the_rays_gpus_never_its_own(monkeypatch):
    """A local Ray's: ray.num_gpus, else Ray's own detection (CUDA_VISIBLE_DEVICES here); a cluster's: joined first,
    then its resources. torch.cuda in the driver is never asked."""
    from pipeline import cluster
    from pipeline.config import RayConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("the driver asked its own hardware"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster.detected_gpus.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    try:
        assert RayConfig().local_gpus() == 2 and RayConfig(num_gpus=0).local_gpus() == 0
    finally:
        cluster.detected_gpus.cache_clear()
    assert RayConfig(address="auto").local_gpus() is None
    joined = []

    def ctx(ray_cfg):
        return SimpleNamespace(pipeline=SimpleNamespace(ray=ray_cfg), ray=lambda: joined.append(1))

    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: bool(joined))  # not yet (the suite's own Ray aside)
    assert devices.run_gpus(ctx(RayConfig(num_gpus=3))) == 3.0 and not joined
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64, "GPU": 8})
    assert devices.run_gpus(ctx(RayConfig(address="ray://head:10001"))) == 8.0 and joined == [1]


def _ppo(**kw):
    from stages.ppo.config import PPOConfig

    return PPOConfig.model_validate(kw)


def test_the_bundles_asked_of_ray_follow_the_layout_and_the_gpus():
    from stages.ppo.placement import bundles, needed

    colocated = _ppo(layout="colocated", policy={"num_ranks": 2})
    assert bundles(colocated, True) == {"policy": [{"CPU": 1, "GPU": 1.0}] * 2}  # engines inside the ranks
    assert bundles(colocated, False) == {"policy": [{"CPU": 1}] * 2}
    separate = _ppo(layout="separate", gpus_per_process=0.25, rewards={"model_weight": 1.0})
    got = bundles(separate, True)
    assert set(got) == {"policy", "reference", "critic", "reward", "engines"}
    assert all(b["GPU"] == 0.25 for group in got.values() for b in group)
    assert len(got["engines"]) == separate.rollout.num_engines
    assert needed(separate, "GPU") == 0.25 * sum(len(g) for g in got.values())
    assert needed(separate, "CPU") == separate.cpus_needed()
    assert all("GPU" not in b for group in bundles(separate, False).values() for b in group)
    grpo = _ppo(layout="separate", algorithm="grpo", policy={"lora": {"r": 4}}, rewards={"model_weight": 0})
    assert set(bundles(grpo, True)) == {"policy", "engines"}  # no critic, reference = adapter off, no reward model


def test_a_tensor_parallel_engine_asks_for_whole_gpus_and_is_refused_where_it_cannot_run(monkeypatch):
    """rollout.tensor_parallel_size N: each separate engine holds N GPUs and runs vLLM's multiprocessing executor over
    them; refused in the colocated layout, with a GPU fraction, and on a Ray without GPUs (at load and at start)."""
    import ray

    from pipeline.config import load_config
    from pipeline.errors import UserError
    from stages.common.engines import EngineSpec, llm_kwargs
    from stages.ppo.placement import bundles, needed
    from stages.ppo.roles import _check_cluster

    cfg = _ppo(layout="separate", rollout={"tensor_parallel_size": 2, "num_engines": 2})
    assert bundles(cfg, True)["engines"] == [{"CPU": 1.0, "GPU": 2.0}] * 2
    assert all(b == {"CPU": 1, "GPU": 1.0} for b in bundles(cfg, True)["policy"])  # the trainers keep one each
    assert needed(cfg, "GPU") == needed(_ppo(layout="separate", rollout={"num_engines": 2}), "GPU") + 2
    spec = EngineSpec(max_model_len=8, gpu=True, tensor_parallel_size=2)
    assert spec.gpus() == 2 and EngineSpec(max_model_len=8, tensor_parallel_size=2).gpus() == 0
    kwargs = llm_kwargs("m", spec, 0)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "mp"
    assert "tensor_parallel_size" not in llm_kwargs("m", EngineSpec(max_model_len=8, gpu=True), 0)
    with pytest.raises(ValueError, match="tensor_parallel_size 2: in layout colocated"):
        _ppo(layout="colocated", rollout={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="needs a GPU of its own, but gpus_per_process is 0.5"):
        _ppo(layout="separate", gpus_per_process=0.5, rollout={"tensor_parallel_size": 2})
    tp = ["stages.ppo.layout=separate", "stages.ppo.rollout.tensor_parallel_size=2", "stages.ppo.rollout.num_engines=1"]
    with pytest.raises(UserError, match="tensor_parallel_size is 2, but the Ray cluster has no GPUs"):
        load_config("configs/smoke.yaml", ["ray.num_gpus=0", *tp])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64})
    with pytest.raises(UserError, match="tensor_parallel_size is 2, but the Ray cluster has no GPUs"):
        _check_cluster(cfg, gpu=False)


def test_each_role_and_engine_asks_ray_for_its_bundle(monkeypatch):
    """What start_role and the engine pool ask Ray for is what placement.bundles says."""
    import stages.ppo.groups as groups
    from stages.common.engines import EngineSpec
    from stages.ppo.placement import bundles
    from stages.ppo.layouts.separate import start_role

    asked = {}

    class Group:
        def __init__(self, name, cls, n, cpus, gpu, strategy, env=None, runtime_env=None, wait=True):
            asked[name] = [{"CPU": cpus, **({"GPU": float(gpu)} if gpu else {})}] * n

        def run(self, *a):
            return []

    monkeypatch.setattr(groups, "ModelGroup", Group)
    cfg = _ppo(layout="separate", gpus_per_process=0.5, critic={"num_ranks": 2})
    for gpu in (True, False):
        for name, role in (("policy", cfg.policy), ("critic", cfg.critic)):
            start_role(name, role, "causal", "m", cfg, True, gpu, 0, 0, None)
            assert asked[name] == bundles(cfg, gpu)[name]
    spec = EngineSpec(max_model_len=8, gpu=True, gpu_share=cfg.gpus_per_process)
    assert {"CPU": spec.num_cpus, "GPU": spec.gpus()} == bundles(cfg, True)["engines"][0]


def test_a_gpu_shortfall_is_refused_at_load_with_the_count(monkeypatch):
    """A local Ray with 2 GPUs: ppo's separate layout needing 5 and an sft of 4 workers are refused by the config,
    naming what is short; a fraction per process, the colocated layout or ray.num_gpus: 0 pass."""
    from pipeline.config import load_config
    from pipeline.errors import UserError

    with pytest.raises(UserError, match=r"stages.ppo: 6 processes \(layout separate\).*need 6 GPUs but the Ray "
                                        r"cluster has 2 \(4 short\)"):
        load_config("configs/smoke.yaml", ["ray.num_gpus=2", "stages.ppo.layout=separate",
                                           "stages.ppo.rollout.num_engines=1", "stages.sft.num_workers=1",
                                           "stages.reward.num_workers=1"])
    with pytest.raises(UserError, match=r"stages.sft.num_workers: 4 workers need 4 GPUs .* \(2 short\)"):
        load_config("configs/smoke.yaml", ["ray.num_gpus=2", "stages.sft.num_workers=4"])
    ok = ["stages.sft.num_workers=1", "stages.reward.num_workers=1"]
    load_config("configs/smoke.yaml", ["ray.num_gpus=2", "stages.ppo.layout=separate",
                                       "stages.ppo.gpus_per_process=0.25", "stages.ppo.rollout.num_engines=1", *ok])
    load_config("configs/smoke.yaml", ["ray.num_gpus=0", "stages.sft.num_workers=4"])


def test_a_clusters_gpu_shortfall_is_refused_before_anything_is_placed(monkeypatch):
    import ray

    from pipeline.errors import UserError
    from stages.ppo.roles import _check_cluster

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64, "GPU": 1})
    cfg = _ppo(layout="colocated", policy={"num_ranks": 2})
    with pytest.raises(UserError, match=r"need 2 GPUs but the Ray cluster has 1 \(1 short\)"):
        _check_cluster(cfg, gpu=True)
    _check_cluster(cfg, gpu=False)  # on CPUs the GPUs are not asked for


def test_the_engines_compute_in_the_policys_precision():
    from stages.ppo.roles import engine_dtype

    cfg = _ppo()
    assert engine_dtype(cfg.policy, gpu=True) == "bfloat16"  # 'auto' on GPUs; vLLM's flash backends need it
    assert engine_dtype(cfg.policy, gpu=False) == "float32"  # the CPU path as before
    fp32 = _ppo(policy={"deepspeed": {"precision": "fp32"}})
    assert engine_dtype(fp32.policy, gpu=True) == "float32"


def test_the_engines_token_budget_reaches_vllm_and_a_cpu_budget_below_a_prompt_is_refused():
    from pipeline.errors import UserError
    from stages.common.engines import EngineSpec, llm_kwargs
    from stages.ppo.roles import batched_tokens

    assert "max_num_batched_tokens" not in llm_kwargs("m", EngineSpec(max_model_len=64), 0)  # vLLM's default
    kwargs = llm_kwargs("m", EngineSpec(max_model_len=64, max_num_batched_tokens=512), 0)
    assert kwargs["max_num_batched_tokens"] == 512 and kwargs["max_num_seqs"] == 256  # vLLM: budget >= max_num_seqs
    assert llm_kwargs("m", EngineSpec(max_model_len=64, max_num_batched_tokens=64), 0)["max_num_seqs"] == 64
    assert batched_tokens(_ppo().rollout, 100, gpu=False) is None
    short = _ppo(rollout={"max_num_batched_tokens": 64}).rollout
    assert batched_tokens(short, 100, gpu=True) == 64  # chunked prefill on GPUs splits a longer prompt
    with pytest.raises(UserError, match="max_num_batched_tokens is 64.*at least 100"):
        batched_tokens(short, 100, gpu=False)


# --------------------------------------------------------------------------- the colocated engine's sleep cycle


class RecordingLLM:
    """vLLM's `LLM.sleep` / `wake_up` as calls, and what memory would hold."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.weights = "disk"  # where the engine's weights are: "gpu", "cpu" (offloaded), None (discarded)

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.weights = "cpu" if level == 1 else None

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        if tags is None or "weights" in tags:
            self.weights = "gpu" if self.weights == "cpu" else "allocated"


def _iteration(cycle, llm, generated):
    cycle.generate(lambda: generated.append(llm.weights),
                   reload=lambda: cycle.load(lambda: setattr(llm, "weights", "gpu")))
    cycle.load(lambda: setattr(llm, "weights", "gpu"))  # the sync after the update


def test_level_2_discards_the_weights_and_the_sync_loads_them_in_trls_order():
    from stages.ppo.sleep import SleepCycle

    llm, generated = RecordingLLM(), []
    cycle = SleepCycle(llm, level=2, enabled=True)
    cycle.start()
    for _ in range(2):
        _iteration(cycle, llm, generated)
    assert llm.calls == [("sleep", 1),  # built: asleep, its weights from disk kept
                         ("wake_up", None), ("sleep", 2),  # iteration 1's generation, then nothing copied out
                         ("wake_up", ("weights",)),  # the sync: memory for the weights, then the load
                         ("wake_up", ("kv_cache",)), ("sleep", 2),  # iteration 2: only the cache to wake
                         ("wake_up", ("weights",))]
    assert generated == ["gpu", "gpu"]  # every generation on loaded weights


def test_level_1_copies_the_weights_out_and_back_as_before():
    from stages.ppo.sleep import SleepCycle

    llm, generated = RecordingLLM(), []
    cycle = SleepCycle(llm, level=1, enabled=True)
    cycle.start()
    _iteration(cycle, llm, generated)
    assert llm.calls == [("sleep", 1), ("wake_up", None), ("sleep", 1), ("wake_up", ("weights",)), ("sleep", 1)]
    assert generated == ["gpu"]


def test_a_generation_after_discarded_weights_reloads_them_first():
    """Level 2, two generations without a sync between (the held-out evaluation after the rollouts)."""
    from stages.ppo.sleep import SleepCycle

    llm, generated, reloads = RecordingLLM(), [], []
    cycle = SleepCycle(llm, level=2, enabled=True)
    cycle.start()

    def reload():
        reloads.append(1)
        cycle.load(lambda: setattr(llm, "weights", "gpu"))

    for _ in range(2):
        cycle.generate(lambda: generated.append(llm.weights), reload)
    assert reloads == [1] and generated == ["gpu", "gpu"]


def test_on_a_cpu_or_without_sleep_mode_nothing_is_called():
    from stages.ppo.sleep import SleepCycle

    llm = RecordingLLM()
    cycle = SleepCycle(llm, level=2, enabled=False)
    cycle.start()
    assert cycle.generate(lambda: "out", reload=lambda: pytest.fail("reloaded")) == "out"
    cycle.load(lambda: None)
    assert llm.calls == []
