"""The installed stack works here: Ray, vLLM (CPU), DeepSpeed (CPU) and transformers on the built model.

MLflow is shown working by test_mlflow_server.py and the CLI end-to-end tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The built-in model with larger random weights, so greedy outputs are not one repeated token."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common import models, tasks

    cfg = models.BuiltinModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                                    num_heads=2, num_kv_heads=1, max_position_embeddings=128)
    path = models.build_base_model(tmp_path_factory.mktemp("model"), cfg, tasks.corpus(tasks.TaskConfig(), 0), 0)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4)
    model.save_pretrained(path)
    return path


def _script(name: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / name), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_ray_runs_tasks_and_actors(ray_local):
    import ray

    @ray.remote
    def square(x):
        return x * x

    @ray.remote
    class Counter:
        def __init__(self):
            self.n = 0

        def add(self, k):
            self.n += k
            return self.n

    assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
    counter = Counter.remote()
    assert ray.get([counter.add.remote(2), counter.add.remote(3)]) == [2, 5]


def test_vllm_greedy_equals_hf_greedy(tiny_model):
    result = _script("vllm_greedy.py", str(tiny_model))
    assert result["vllm"] == result["hf"]
    assert len({t for seq in result["vllm"] for t in seq}) > 3  # not a degenerate repeat


def test_deepspeed_zero2_trains_on_cpu_and_resumes_only_from_safe_checkpoints(tiny_model, tmp_path):
    result = _script("ds_step.py", str(tiny_model), "2", str(tmp_path / "ckpt"))
    losses = result["losses"]
    assert losses[-1] < 0.8 * losses[0]
    assert result["resumed_loss"] < 0.8 * losses[0]  # the reloaded weights are the trained ones
    # DeepSpeed's own loader would unpickle anything (weights_only=False): ours refuses the planted object.
    assert "does not allow" in result["refused"] and not result["planted_code_ran"]
