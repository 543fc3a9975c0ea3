"""Pure parts of the training stages: DeepSpeed config, step counts, Bradley-Terry loss, collation."""

import math

import numpy as np
import pytest
import torch

from conftest import smoke_config
from pipeline.errors import ConfigError
from stages.common.deepspeed import DeepSpeedSection, TrainingConfig, deepspeed_config, merge
from stages.reward import bradley_terry_loss
from stages.reward import collate as reward_collate
from stages.common.deepspeed import total_steps
from stages.sft import collate


def test_bradley_terry_loss_matches_hand_computed_values():
    rc, rr = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    expected = (-math.log(1 / (1 + math.exp(-2))) + math.log(2) - math.log(1 / (1 + math.exp(2)))) / 3
    assert bradley_terry_loss(rc, rr).item() == pytest.approx(expected, rel=1e-6)
    assert bradley_terry_loss(torch.tensor([50.0]), torch.tensor([-50.0])).item() == pytest.approx(0.0, abs=1e-6)


def test_deepspeed_config_from_typed_fields():
    cfg = TrainingConfig(num_workers=2, batch_size=32, micro_batch_size=4, lr=1e-3, warmup_steps=5,
                         deepspeed=DeepSpeedSection(zero_stage=3, offload_params=True, offload_optimizer=True,
                                                    extra={"zero_optimization": {"reduce_bucket_size": 1000}}))
    ds = deepspeed_config(cfg, total_steps=100, bf16=False)
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_batch_size"] == 32
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000  # the raw dict merges over, keeps the rest
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["scheduler"]["params"]["total_num_steps"] == 100
    assert merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {"a": {"b": 1, "c": 3}, "d": 4}


@pytest.mark.parametrize("override, expected", [
    ("stages.sft.deepspeed.zero_stage=4", "stages.sft.deepspeed.zero_stage: input should be 0, 1, 2 or 3"),
    ("stages.sft.batch_size=6", "stages.sft: batch_size (6) must be a multiple of micro_batch_size x num_workers"),
    ("stages.reward.deepspeed.offload_params=true", "offload_params needs zero_stage 3"),
    ("stages.sft.lr=-1", "stages.sft.lr: input should be greater than 0"),
    ("stages.reward.init_from=nothing", "stages.reward.init_from: input should be 'sft' or 'base'"),
    ("stages.reward.lm_loss_weight=-1", "stages.reward.lm_loss_weight: input should be greater than or equal to 0"),
])
def test_bad_training_options_fail_at_validation(tmp_path, override, expected):
    with pytest.raises(ConfigError) as exc:
        smoke_config(tmp_path, override)
    assert expected in str(exc.value)


def test_total_steps():
    cfg = TrainingConfig(num_workers=2, batch_size=16, micro_batch_size=4, epochs=3)
    assert total_steps(100, cfg) == 3 * (50 // 4) // 2  # 12 full micro-batches per worker per epoch, 2 per step
    assert total_steps(100, cfg.model_copy(update={"max_steps": 5})) == 5


def test_collate_masks_labels_and_pads():
    batch = {"input_ids": np.array([np.array([5, 6, 7]), np.array([8, 9])], dtype=object),
             "loss_mask": np.array([np.array([0, 1, 1]), np.array([0, 1])], dtype=object)}
    out = collate(batch, pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    pairs = {"chosen_input_ids": np.array([np.array([1, 2])], dtype=object),
             "chosen_loss_mask": np.array([np.array([0, 1])], dtype=object),
             "rejected_input_ids": np.array([np.array([1, 3, 4])], dtype=object)}
    out = reward_collate(pairs, pad_id=0)
    assert out["input_ids"].tolist() == [[1, 2, 0], [1, 3, 4]]
    assert out["lm_mask"].tolist() == [[0, 1, 0], [0, 0, 0]]  # the chosen answer only


def test_reward_lm_loss_equals_the_causal_lm_loss_of_the_same_weights(tmp_path):
    """The hidden states the hook captures on the classifier, projected through the tied embeddings,
    give exactly the loss HF's causal LM computes for the same checkpoint and labels."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM

    from stages.reward import capture_score_input, lm_head_for, lm_loss

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                      pad_token_id=0)).eval()
    lm.save_pretrained(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 11, 12, 0, 0]])
    att = (ids != 0).long()
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    expected = lm(input_ids=ids, attention_mask=att,
                  labels=torch.where(mask.bool(), ids, torch.full_like(ids, -100))).loss

    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=1).eval()
    captured = capture_score_input(rm)
    rm(input_ids=ids, attention_mask=att)
    head = lm_head_for(rm, str(tmp_path))
    assert head is rm.get_input_embeddings().weight  # tied: the trained embeddings, not a copy
    assert lm_loss(captured["hidden"], head, ids, mask).item() == pytest.approx(expected.item(), rel=1e-5)
    # Tokens outside the mask do not count: changing one moves nothing.
    other = ids.clone()
    other[1, 3] = 30
    rm(input_ids=other, attention_mask=att)
    assert lm_loss(captured["hidden"], head, other, mask).item() == pytest.approx(expected.item(), rel=1e-5)


def test_reward_lm_head_of_an_untied_model_is_the_init_models_lm_head_frozen(tmp_path):
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM

    from stages.reward import lm_head_for

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    lm.save_pretrained(tmp_path)
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=1)
    head = lm_head_for(rm, str(tmp_path))
    assert torch.equal(head, lm.lm_head.weight.detach()) and not head.requires_grad
    assert not torch.equal(head, rm.get_input_embeddings().weight.detach())


def test_reward_lm_loss_refuses_zero3(tmp_path):
    with pytest.raises(ConfigError, match="lm_loss_weight > 0 reads the embedding matrix"):
        smoke_config(tmp_path, "stages.reward.lm_loss_weight=1", "stages.reward.deepspeed.zero_stage=3")


def test_eval_batches_read_the_split_once_and_replay_only_a_complete_pass():
    from stages.common.training import EvalBatches

    class Split:  # a Ray Data dataset's iter_batches, counting executions
        passes = 0

        def iter_batches(self, batch_size, drop_last, batch_format):
            assert batch_format == "numpy" and not drop_last  # every eval row is scored
            Split.passes += 1
            rows = np.arange(5)
            for i in range(0, len(rows), batch_size):
                yield {"x": rows[i:i + batch_size]}

    batches = EvalBatches(Split(), 2, lambda b: [int(r) * 10 for r in b["x"]])
    for _ in batches:  # an interrupted first pass is not kept
        break
    assert Split.passes == 1 and batches.batches is None
    assert list(batches) == [[0, 10], [20, 30], [40]] and Split.passes == 2
    assert list(batches) == [[0, 10], [20, 30], [40]] and Split.passes == 2  # replayed, no new execution
    # two ranks: each scores its contiguous share of every global batch of 4 (split_bounds: the first
    # ranks take the remainder of a short one), so every row is scored exactly once
    rank0, rank1 = (EvalBatches(Split(), 2, lambda b: list(b["x"]), 0, 2),
                    EvalBatches(Split(), 2, lambda b: list(b["x"]), 1, 2))
    assert list(rank0) == [[0, 1], [4]] and list(rank1) == [[2, 3]]


def test_training_batches_are_read_once_and_replayed_every_epoch_unless_too_large():
    from stages.common.training import ReplayBatches

    class Split:
        passes = 0

        def iter_batches(self, batch_size, drop_last, batch_format):
            assert drop_last  # training drops a short last global batch
            Split.passes += 1
            rows = np.arange(7)
            for i in range(0, len(rows) - batch_size + 1, batch_size):
                yield {"x": rows[i:i + batch_size]}

    epochs = ReplayBatches(Split(), 2, lambda b: [int(r) for r in b["x"]])
    seen = [list(epochs) for _ in range(3)]  # three epochs
    assert seen == [[[0, 1], [2, 3], [4, 5]]] * 3 and Split.passes == 1 and epochs.passes == 1
    Split.passes = 0
    big = ReplayBatches(Split(), 2, lambda b: [int(r) for r in b["x"]], max_rows=4)  # 6 rows > 4: streamed
    assert [list(big) for _ in range(2)] == [[[0, 1], [2, 3], [4, 5]]] * 2 and Split.passes == 2
    assert big.batches is None


def test_deepspeed_jit_builds_go_to_this_environment_unless_the_user_chose_a_directory(monkeypatch, tmp_path):
    import os
    import sys
    from pathlib import Path

    from pipeline.upstream.torch_extensions import isolate_jit_builds

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    isolate_jit_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    # the environment's own ninja builds them, whatever PATH the worker was started with
    assert os.environ["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    isolate_jit_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


def test_sft_warns_with_the_numbers_when_it_leaves_the_model_worse_than_it_started():
    from stages.sft import accuracy_warning

    assert accuracy_warning(0.3, 0.3, 16, 5e-5) is None and accuracy_warning(0.3, 0.5, 16, 5e-5) is None
    warning = accuracy_warning(0.3, 0.0, 16, 3e-3)
    assert "from 0.300 to 0.000 on 16 prompts" in warning and "stages.sft.lr=0.003" in warning


def test_greedy_accuracy_counts_answers_cut_off_by_the_length_limit(tmp_path, tokenizer):
    """An answer stopped by max_new_tokens is scored as given and counted, not silently scored wrong."""
    from stages.common import models

    cfg = models.BuiltinModelConfig(vocab_size=320, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                    num_kv_heads=1)
    models.build_model(cfg, tokenizer, seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    texts, cut = models.greedy_generate(tmp_path, [prompt, prompt], 4)
    assert cut == [True, True] and all(texts)  # a random model never ends its turn within 4 tokens
    accuracy, truncated = models.greedy_accuracy(tmp_path, [{"prompt_ids": prompt, "answer": "5"}] * 3, 4)
    assert truncated == 1.0 and accuracy == 0.0


# --------------------------------------------------------------------------- checkpoint loads: weights_only everywhere


class _Planted:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path, marker) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"optimizer_state_dict": _Planted(str(marker)), "param": torch.zeros(2)}, path)


def test_every_deepspeed_checkpoint_load_path_is_weights_only_inside_the_guard(tmp_path, monkeypatch):
    """Each of DeepSpeed 0.19's own loads of a checkpoint file (the engines `checkpoint.writer` and the
    default pick, the universal-checkpoint loads of the optimizers) refuses a planted object inside
    `weights_only_loads` without running it; outside, torch's `load` is torch's own again."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from types import SimpleNamespace

    from deepspeed.checkpoint import universal_checkpoint
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from pipeline.upstream.deepspeed_loads import weights_only_loads

    marker = tmp_path / "planted-code-ran"
    planted = tmp_path / "ckpt" / "mp_rank_00_model_states.pt"
    _plant(planted, marker)
    _plant(tmp_path / "universal" / "zero" / "optimizer_state.pt", marker)  # load_universal: the optimizer's state
    _plant(tmp_path / "universal" / "param" / "fp32.pt", marker)  # and each parameter's folder
    loads = {
        "TorchCheckpointEngine": lambda: TorchCheckpointEngine.load(None, str(planted)),
        "FastCheckpointEngine": lambda: FastCheckpointEngine.load(None, str(planted)),
        "DecoupledCheckpointEngine": lambda: DecoupledCheckpointEngine.load(None, str(planted)),
        "universal optimizer state": lambda: ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir(
            None, "bit16_groups", str(tmp_path / "universal")),
        "universal parameter state": lambda: universal_checkpoint.load_hp_checkpoint_state(
            SimpleNamespace(_hp_mapping=SimpleNamespace()), str(tmp_path / "universal" / "param"), 0, 1),
        "torch.load(weights_only=False)": lambda: torch.load(planted, weights_only=False),
    }
    original = torch.load
    for name, load in loads.items():
        with weights_only_loads():
            with pytest.raises(RuntimeError, match="does not allow"):
                load()
        assert not marker.exists(), f"{name}: the planted object ran"
        assert torch.load is original and torch.serialization.load is original
    # A checkpoint's own contents load (tensors and the allow-listed DeepSpeed classes), also when nested.
    fine = tmp_path / "fine.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "state": {"exp_avg": torch.ones(3)}}, fine)
    with weights_only_loads(), weights_only_loads():
        sd = TorchCheckpointEngine.load(None, str(fine))
    assert isinstance(sd["loss_scaler"], LossScaler) and sd["state"]["exp_avg"].tolist() == [1.0, 1.0, 1.0]
    assert torch.load is original
    # Without the guard DeepSpeed's own engine runs whatever the file holds: what the guard is for.
    TorchCheckpointEngine.load(None, str(planted))
    assert marker.exists()


@pytest.mark.parametrize("override, key", [
    ("stages.sft.deepspeed.extra={checkpoint: {load_universal: true}}",
     "stages.sft.deepspeed.extra.checkpoint.load_universal: not supported"),
    ("stages.reward.deepspeed.extra={datastates_ckpt: {host_cache_size: 16}}",
     "stages.reward.deepspeed.extra.datastates_ckpt: not supported"),
    ("stages.ppo.policy.deepspeed.extra={nebula: {enabled: true}}",
     "stages.ppo.policy.deepspeed.extra.nebula: not supported"),
])
def test_deepspeed_configs_whose_checkpoint_loads_escape_weights_only_are_refused(tmp_path, override, key):
    with pytest.raises(ConfigError) as exc:
        smoke_config(tmp_path, override)
    assert key in str(exc.value) and "remove it" in str(exc.value)


def test_deepspeed_checkpoint_engines_the_guard_covers_are_accepted(tmp_path):
    cfg = smoke_config(tmp_path, "stages.sft.deepspeed.extra={checkpoint: {writer: {type: python, decoupled: true}, "
                                 "use_node_local_storage: true, load_universal: false}, datastates_ckpt: false}")
    assert cfg.stages.sft.deepspeed.extra["checkpoint"]["writer"]["decoupled"] is True


# A real DeepSpeed engine per checkpoint config, in a process of its own: train, save and resume through
# the pipeline's own functions (`training.init_engine`, `save_checkpoint`, `load_checkpoint`), then the same
# checkpoint with a code-running object planted in every file.
_ENGINES_SCRIPT = r'''
import json, os, sys
from pathlib import Path


class _Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def main(out: Path, port: str, configs: dict) -> dict:
    # One rank, as DeepSpeed's launcher describes it (its checkpoint writers read CROSS_SIZE / CROSS_RANK).
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_SIZE="1", CROSS_RANK="0", CROSS_SIZE="1")
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.common import training

    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, extra in configs.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra}
        engine = training.init_engine(model, config)
        batch = torch.randint(0, 64, (2, 12))
        for _ in range(2):
            engine.backward(engine(input_ids=batch, labels=batch).loss)
            engine.step()
        ckpt = out / name
        training.save_checkpoint(engine, ckpt, 0)
        engine.checkpoint_engine.commit(None)  # a decoupled engine writes in a process of its own: wait for it
        trained = engine(input_ids=batch, labels=batch).loss.item()
        training.load_checkpoint(engine, ckpt)  # a checkpoint it wrote loads back
        files = sorted(p.name for p in (ckpt / "ds").iterdir())
        result = {"engine": type(engine.checkpoint_engine).__name__, "files": files,
                  "resumed": engine(input_ids=batch, labels=batch).loss.item() == trained}
        marker = ckpt / "planted-code-ran"
        for f in (ckpt / "ds").iterdir():
            torch.save({"optimizer_state_dict": _Planted(str(marker)), "module": _Planted(str(marker))}, f)
        for how, load in (("engine.load_checkpoint", lambda: engine.load_checkpoint(str(ckpt), tag=training.DS_TAG)),
                          ("training.load_checkpoint", lambda: training.load_checkpoint(engine, ckpt))):
            try:
                load()
                result[how] = ""
            except RuntimeError as exc:
                result[how] = str(exc)
        result["planted_code_ran"] = marker.exists()
        results[name] = result
    return results


if __name__ == "__main__":  # DeepSpeed's decoupled engine starts its writer process by spawn
    print("RESULT " + json.dumps(main(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))))
'''


@pytest.mark.slow
def test_deepspeed_resumes_only_from_safe_checkpoints_whichever_checkpoint_engine_is_configured(tmp_path):
    """Under DeepSpeed's default checkpoint engine, node-local storage and the fast engine of
    `checkpoint.writer` (whose `torch.load` the old per-engine swap never saw): a checkpoint the
    stage wrote resumes, and the same checkpoint with a planted object is refused without running it.
    torch's own default (`weights_only=True` since 2.6) is turned off in the process, as
    `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` does: the safety must not rest on it. Heavy (DeepSpeed):
    run it under `flock /tmp/heavy.lock`."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from conftest import ROOT

    configs = {"default": {}, "node_local": {"checkpoint": {"use_node_local_storage": True}},
               "fast_writer": {"checkpoint": {"writer": {"type": "python", "data_parallel": "replica"}}}}
    script = tmp_path / "engines.py"
    script.write_text(_ENGINES_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), port, json.dumps(configs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT ")).removeprefix("RESULT "))
    assert results["fast_writer"]["engine"] == "FastCheckpointEngine"  # not the one engine the old swap covered
    for name, r in results.items():
        assert r["files"] and r["resumed"], (name, r)
        for how in ("engine.load_checkpoint", "training.load_checkpoint"):
            assert "does not allow" in r[how], (name, how, r)
        assert not r["planted_code_ran"], name


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_first_steps_train_at_the_schedules_lr(schedule, warmup):
    """DeepSpeed's own schedulers, fed our block: without a warm-up the first step trains at the peak lr
    (DeepSpeed's warm-up lasts at least 2 steps from its minimum, which once made a constant-lr job train its
    first two steps at 0 and lr/2); with one, the lr climbs from 0 to the peak at step `warmup`."""
    import torch
    from deepspeed.runtime import lr_schedules

    from stages.common.deepspeed import TrainingConfig, lr_scheduler

    block = lr_scheduler(TrainingConfig(lr=1e-3, lr_schedule=schedule, warmup_steps=warmup, min_lr_ratio=0.1), 20)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = getattr(lr_schedules, block["type"])(opt, **block["params"])
    lrs = []
    for _ in range(5):  # the lr each optimizer step trains at, then the step DeepSpeed takes after it
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    if warmup == 0:
        assert lrs[0] == pytest.approx(1e-3) and lrs[1] == pytest.approx(1e-3, rel=0.05)
    else:  # DeepSpeed's warm-up: two steps at 0, then up to the peak at step warmup + 2
        assert lrs[0] == lrs[1] == 0 and lrs[1] < lrs[2] < lrs[3] < lrs[4] == pytest.approx(1e-3, rel=0.05)
