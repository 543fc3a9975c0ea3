"""Where a batch computes (issue 68; stages/ppo/devices.py): every batch the driver builds on the CPU reaches its
model's device at the call, and what a call returns comes back on the CPU. No GPU here, so the model's device is
`meta`: a module on it refuses inputs elsewhere, as a module on a GPU does ("expected all tensors on the same
device"). No Ray."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stages.common import devices
from stages.ppo.rl import make_batch

META = torch.device("meta")


def _same_device(module: torch.nn.Module, *tensors) -> None:
    for t in tensors:
        if t.device != module.weight.device:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found {t.device} and "
                               f"{module.weight.device}")


class MetaLM(torch.nn.Module):
    """A causal LM on the meta device: checks its inputs' device and answers logits there."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab, 4, device=META))
        self.seen: list[torch.device] = []

    def forward(self, input_ids, attention_mask, position_ids):
        _same_device(self, input_ids, attention_mask, position_ids)
        self.seen.append(input_ids.device)
        return SimpleNamespace(logits=torch.empty(*input_ids.shape, self.weight.shape[0], device=META))


class MetaBackbone(MetaLM):
    def forward(self, input_ids, attention_mask, position_ids):
        _same_device(self, input_ids, attention_mask, position_ids)
        self.seen.append(input_ids.device)
        return SimpleNamespace(last_hidden_state=torch.empty(*input_ids.shape, 4, device=META))


class MetaCritic(torch.nn.Module):
    """A critic engine as the worker sees one: `.module` with a backbone (`.model`) and a score head."""

    def __init__(self):
        super().__init__()
        self.module = torch.nn.Module()
        self.module.model = MetaBackbone()
        self.module.score = torch.nn.Linear(4, 1, device=META)


@pytest.fixture
def batch():
    return make_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], pad_id=0)


@pytest.fixture
def came_back(monkeypatch):
    """What the worker handed back to the driver: to_cpu's arguments (a meta tensor holds no data to copy, so the
    copy is replaced by an empty CPU tensor of the same shape)."""
    seen = []

    def to_cpu(value):
        seen.append(value.device)
        return torch.zeros(value.shape)

    monkeypatch.setattr(devices, "to_cpu", to_cpu)
    return seen


def test_the_policys_and_the_references_batches_reach_their_device_and_come_back_on_the_cpu(batch, came_back):
    from stages.ppo.worker import PPOWorker  # imports ray: not at collection (it sets RAY_CLIENT_MODE)

    worker = PPOWorker("policy", 0, 1, {})
    worker.engine, worker.reference = MetaLM(), MetaLM()
    logp = worker.logprobs(batch, micro=1)
    assert worker.engine.seen == [META, META]  # each micro-batch moved to the model's device
    assert logp.device.type == "cpu" and logp.shape == batch["response_ids"].shape and came_back == [META]
    worker.ref_logprobs(batch, micro=2)
    assert worker.reference.seen == [META] and came_back == [META, META]
    with pytest.raises(RuntimeError, match="same device"):  # what the driver's batch did before: CPU tensors
        worker.engine(batch["input_ids"], batch["attention_mask"], batch["position_ids"])


def test_the_critics_batches_reach_its_device_and_values_come_back_on_the_cpu(batch, came_back):
    from stages.ppo.worker import PPOWorker

    worker = PPOWorker("critic", 0, 1, {})
    worker.engine = MetaCritic()
    values = worker.values(batch, micro=2)
    assert worker.engine.module.model.seen == [META] and came_back == [META]
    assert values.device.type == "cpu" and values.shape == batch["response_ids"].shape


def test_training_micro_batches_and_chunks_are_on_the_models_device(batch):
    from stages.ppo.worker import _chunks, _micro_batches

    generator = torch.Generator().manual_seed(0)
    for part in list(_micro_batches(batch, 1, generator, META)) + list(_chunks(batch, 1, META)):
        assert {v.device for v in part.values() if torch.is_tensor(v)} == {META}
        assert part["prompt_width"] == batch["prompt_width"]  # scalars kept as they are
    on_cpu = next(_chunks(batch, 2, torch.device("cpu")))
    assert on_cpu["input_ids"] is not None and on_cpu["input_ids"].data_ptr() == batch["input_ids"].data_ptr()


def test_helpers_that_build_cpu_batches_call_the_model_on_its_device():
    model = MetaLM()
    ids = torch.ones(1, 3, dtype=torch.long)
    devices.on_device(model)(input_ids=ids, attention_mask=ids, position_ids=ids)
    assert model.seen == [META]
    assert devices.device_of(SimpleNamespace(device=META, parameters=lambda: iter(()))) == META  # an engine's
    assert devices.device_of(torch.nn.ReLU()).type == "cpu"  # nothing to place: the CPU
    assert devices.to_cpu((torch.ones(1), [torch.ones(1)], 3))[2] == 3


def test_a_process_computes_on_the_device_it_was_given(monkeypatch):
    """Asked in the process: what Ray's CUDA_VISIBLE_DEVICES leaves it (none here: the CPU)."""
    assert devices.process_device().type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert devices.process_device() == torch.device("cuda", 0)


def test_the_optimizer_needs_no_compiler_on_a_gpu_and_is_unchanged_on_a_cpu(monkeypatch):
    """DeepSpeed's own choice (`DeepSpeedEngine.get_optimizer_configuration`) for the config a rank initialises:
    torch's AdamW on a CUDA device (FusedAdam JIT-compiles CUDA code with nvcc), as before on a CPU (its FusedAdam
    is the CPU op built at set-up). A user's own torch_adam in deepspeed.extra is kept."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.engine import DeepSpeedEngine

    from stages.common.deepspeed import DeepSpeedSection, engine_config, for_device

    def chosen(config: dict):
        engine = SimpleNamespace(zero_use_cpu_optimizer=lambda: False, zenflow=False)
        return DeepSpeedEngine.get_optimizer_configuration(engine, dict(config["optimizer"]["params"]), True)[0]

    config = engine_config(DeepSpeedSection(), micro=2, ranks=1, bf16=True, lr=1e-4)
    assert chosen(for_device(config, torch.device("cuda", 0))) is torch.optim.AdamW
    assert for_device(config, torch.device("cpu")) == config and chosen(config).__name__ == "FusedAdam"
    frozen = engine_config(DeepSpeedSection(), micro=2, ranks=1, bf16=True)  # no optimizer: nothing to choose
    assert for_device(frozen, torch.device("cuda", 0)) == frozen
    own = engine_config(DeepSpeedSection(extra={"optimizer": {"params": {"torch_adam": False}}}), 2, 1, True, lr=1e-4)
    assert for_device(own, torch.device("cuda", 0))["optimizer"]["params"]["torch_adam"] is False


def test_an_engines_memory_share_follows_where_it_runs():
    """Issue 68: 0.3 of a GPU an engine has to itself wasted most of it. Configured: as configured."""
    from stages.ppo.config import PPOConfig
    from stages.ppo.layouts.colocated import Colocated
    from stages.ppo.layouts.separate import Separate
    from stages.ppo.roles import memory_share

    rollout = PPOConfig().rollout
    assert memory_share(rollout, Separate, gpu=True) == 0.9  # its own GPU
    assert memory_share(rollout, Colocated, gpu=True) == 0.3  # beside the rank's training, as TRL's colocate mode
    assert memory_share(rollout, Separate, gpu=False) == memory_share(rollout, Colocated, gpu=False) == 0.3  # RAM
    assert memory_share(PPOConfig.model_validate({"rollout": {"gpu_memory_utilization": 0.5}}).rollout,
                        Separate, gpu=True) == 0.5
