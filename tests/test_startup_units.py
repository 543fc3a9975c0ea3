"""A stage's start-up clock (pipeline.events.StartupClock) and where its figures are shown. No Ray.

The stages' own measurements are checked on the shared command-line run (tests/test_cli_e2e.py)."""

from __future__ import annotations

import pickle

import pytest

from pipeline import events, outcomes
from pipeline.registry import STAGES


def _clock(monkeypatch, times):
    """A clock whose `time.time()` returns `times` in turn (the first is the stage's start)."""
    ticks = iter(times)
    monkeypatch.setattr(events.time, "time", lambda: next(ticks))
    return events.StartupClock()


def test_parts_add_up_to_the_start_up_and_uncounted_work_is_left_out(monkeypatch):
    clock = _clock(monkeypatch, [100.0, 102.0, 108.0, 111.0, 112.5, 112.5])
    clock.mark("ray")  # 2 s
    clock.mark("workers")  # 6 s
    clock.mark("evaluation", counted=False)  # 3 s of held-out work the config asked for
    clock.mark("data")  # 1.5 s
    assert clock.done() == pytest.approx(9.5)  # 12.5 s since the start, less the evaluation
    assert clock.parts == {"ray": 2.0, "workers": 6.0, "evaluation": 3.0, "data": 1.5}
    assert clock.line("first optimizer step") == ("start-up 9.5s to the first optimizer step (ray 2.0s, workers 6.0s, "
                                                  "data 1.5s); evaluation 3.0s not counted")


def test_the_start_up_ends_once_and_a_part_marked_twice_adds_up(monkeypatch):
    clock = _clock(monkeypatch, [0.0, 1.0, 3.0, 4.0, 4.0])
    clock.mark("evaluation", counted=False)
    clock.mark("roles")
    clock.mark("evaluation", counted=False)
    assert clock.done() == pytest.approx(2.0)
    assert clock.done() == pytest.approx(2.0)  # later calls (the metrics at the end of the stage) keep it
    assert clock.parts["evaluation"] == pytest.approx(2.0)


def test_timed_adds_each_blocks_seconds_and_records_them_when_the_block_raises(monkeypatch):
    """The one phase-timing idiom (`with events.timed(stats, "train_s"):`): repeats sum, a raise still counts."""
    ticks = iter([10.0, 12.5, 20.0, 21.0, 30.0, 34.0])
    monkeypatch.setattr(events.time, "time", lambda: next(ticks))
    stats: dict = {"loss": 1.0}
    with events.timed(stats, "backward"):
        pass
    with events.timed(stats, "backward"):
        pass
    assert stats == {"loss": 1.0, "backward": pytest.approx(3.5)}
    with pytest.raises(RuntimeError), events.timed(stats, "optimizer"):
        raise RuntimeError("step failed")
    assert stats["optimizer"] == pytest.approx(4.0)


def test_metrics_name_every_part_and_detail_and_the_clock_travels_to_workers(monkeypatch):
    clock = _clock(monkeypatch, [10.0, 12.0, 15.0, 15.0])
    clock.mark("driver")
    clock = pickle.loads(pickle.dumps(clock))  # as Ray Train's loop config hands it to rank 0
    clock.mark("workers")
    clock.detail("policy_imports", 4.25)
    clock.processes = 3
    assert clock.metrics() == {"startup_s": 5.0, "startup_processes": 3.0, "startup_driver_s": 2.0,
                               "startup_workers_s": 3.0, "startup_policy_imports_s": 4.25}


def test_every_training_stage_shows_its_start_up_in_the_run_summary():
    shown = {spec.name: outcomes.describe(spec.outcomes, {"startup_s": 12.34}) for spec in STAGES}
    assert {name for name, line in shown.items() if line == "start-up 12.3s"} == {"sft", "reward", "dpo", "ppo"}


class _LocalStorage:
    """What a PPO rank asks of the run's storage at set-up, on one machine."""

    @staticmethod
    def localize(path):
        return path


def test_a_frozen_role_without_zero3_is_a_plain_module_with_the_models_own_log_probs(tmp_path):
    """The reference (or reward) role skips DeepSpeed unless ZeRO-3 shards it: same forward passes, no engine."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.ppo.rl import logprobs_from_logits, make_batch
    from stages.ppo.worker import PPOWorker

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    model.save_pretrained(tmp_path)
    worker = PPOWorker("reference", 0, 1, {})
    worker.setup({"role": "reference", "kind": "causal", "model_dir": str(tmp_path), "trainable": False, "pad_id": 0,
                  "seed": 0, "storage": _LocalStorage(), "ds_config": {"zero_optimization": {"stage": 2},
                                                                      "train_micro_batch_size_per_gpu": 2}})
    assert type(worker.engine) is LlamaForCausalLM and not worker.engine.training
    assert not any(p.requires_grad for p in worker.engine.parameters())
    assert worker.timings()["deepspeed"] < 1.0 and worker.timings()["born"] > 0  # no engine was built
    batch = make_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, 2:5]
    expected = logprobs_from_logits(logits, batch["response_ids"])
    assert torch.allclose(worker.logprobs(batch, micro=1), expected, atol=1e-6)


@pytest.mark.slow  # a fresh interpreter importing DeepSpeed and transformers: ~8 s
def test_a_worker_imports_neither_scikit_learn_nor_mlflow_and_mlflow_stays_importable():
    import subprocess
    import sys

    code = ("import sys; from stages.common.startup import import_deepspeed, lean_imports\n"
            "lean_imports(); import_deepspeed()\n"
            "from transformers import LlamaForCausalLM; import transformers.generation\n"
            "print(sorted(m for m in ('sklearn', 'mlflow') if m in sys.modules))\n"
            "import mlflow; print(mlflow.__name__)\n")
    env = {"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=__import__("pathlib").Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "mlflow"], out.stdout
