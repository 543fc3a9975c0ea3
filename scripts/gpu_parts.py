"""The GPU path's parts on a bare CUDA machine: no Ray, no vLLM, only torch and transformers (issue 68).

    pip install deepspeed hjson pydantic          # small pure-Python packages beside torch and transformers
    python scripts/gpu_parts.py --out parts.json  # ~2 minutes on one GPU; exit 1 naming the first part that failed
    python scripts/gpu_parts.py --device cpu      # the same parts on the CPU (gloo): how the suite runs it

What each part proves, each timed, all in one JSON (and one line per part on stderr):

- `process_group`: a single-rank NCCL group (gloo on the CPU) over an in-memory store, and an all-reduce on the
  device: the collective backend the ranks choose (`stages.common.devices.process_backend`) works.
- `deepspeed[zero, precision]`: `deepspeed.initialize` from our own engine config (`stages.common.deepspeed
  .engine_config`, then `for_device`: torch's AdamW, no nvcc) at ZeRO-2 and ZeRO-3, fp32 and bf16, and one step.
- `sft`, `reward`, `ppo_policy`: our sft and reward objectives' forward and backward (`stages.sft.collate` /
  `forward`, `stages.reward.collate` / `_rewards` / `bradley_terry_loss`) and a ppo policy rank (`PPOWorker.setup`,
  `logprobs`, `train_policy`) on batches built on the CPU as the driver builds them, moved to the device the way
  the pipeline moves them (`devices.OnDevice`, the worker's own chunks): a batch left on the CPU fails here with
  "expected all tensors on the same device", as it did in every stage before.
- `zero3_gather`: the peak device memory of gathering a ZeRO-3 model's parameters one at a time (TRL's weight sync)
  and in the weight sync's own chunks (stages/ppo/weight_chunks.py, what both layouts' syncs do) against all at
  once (`GatheredParameters` over the whole model, what the syncs did before).

On the CPU the memory figures are the bytes gathered at once (no allocator statistics there); on a GPU, torch's
`max_memory_allocated`. It imports only what the machine has: `stages.ppo.worker` names Ray for its actor
decorations, so where Ray is absent its name is bound to a stand-in whose decorator returns the method unchanged
and whose every other use raises (nothing here calls Ray).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def ray_stand_in() -> None:
    """`import ray` for `stages.ppo.worker` on a machine without Ray (see the module docstring)."""
    try:
        import ray  # noqa: F401
        return
    except ImportError:
        pass
    stand_in = types.ModuleType("ray")

    def method(**_):
        return lambda f: f

    def absent(*_, **__):
        raise RuntimeError("gpu_parts.py: Ray is not installed here and this part tried to use it")

    stand_in.method, stand_in.get, stand_in.put, stand_in.remote = method, absent, absent, absent
    sys.modules["ray"] = stand_in


class Parts:
    """Runs each part, times it, keeps its figures; the first failure ends the run with its name."""

    def __init__(self, device) -> None:
        self.device, self.results, self.t0 = device, [], time.time()

    def run(self, name: str, fn) -> dict:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        try:
            figures = fn() or {}
        except Exception as exc:
            if os.environ.get("GPU_PARTS_TRACEBACK"):
                import traceback

                traceback.print_exc()
            self.results.append({"part": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                                 "seconds": round(time.time() - t0, 3)})
            print(f"gpu_parts: FAILED {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            raise SystemExit(1)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            figures.setdefault("peak_allocated_mb", round(torch.cuda.max_memory_allocated() / 2**20, 1))
        row = {"part": name, "ok": True, "seconds": round(time.time() - t0, 3), **figures}
        self.results.append(row)
        print(f"gpu_parts: ok {name} {row['seconds']:.2f}s {json.dumps(figures)}", file=sys.stderr)
        return row


def build_model(directory: Path) -> Path:
    """The built-in tiny LLaMA (stages.common.models) with its tokenizer, saved where load_model reads it."""
    from stages.common.models import BuiltinModelConfig, build_base_model

    corpus = [f"What is {a} + {b}? {a + b}" for a in range(30) for b in range(30)]
    return build_base_model(directory, BuiltinModelConfig(hidden_size=64, intermediate_size=128, num_layers=2,
                                                          num_heads=2, num_kv_heads=1, vocab_size=320), corpus, seed=0)


def engine(model, zero: int, bf16: bool, device, lr: float = 1e-4):
    """`deepspeed.initialize` from our own engine config, as a trainable rank does (PPOWorker.setup)."""
    from stages.common.startup import import_deepspeed

    deepspeed = import_deepspeed()  # the venv's JIT-built ops directory, the process's accelerator

    from stages.common.deepspeed import DeepSpeedSection, engine_config, for_device

    config = engine_config(DeepSpeedSection(zero_stage=zero, precision="bf16" if bf16 else "fp32"), micro=2, ranks=1,
                           bf16=bf16, lr=lr, grad_clip=1.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    eng, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=for_device(config, device))
    return eng


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where the parts compute")
    parser.add_argument("--out", type=Path, help="write the JSON here too (it always goes to stdout)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", args.device)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_parts: torch sees no CUDA device here (torch.cuda.is_available() is False); run it on the GPU "
              "machine, or pass --device cpu", file=sys.stderr)
        return 2
    ray_stand_in()
    from stages.common.devices import OnDevice, process_device, to_device

    device = process_device() if args.device == "cuda" else torch.device("cpu")
    parts = Parts(device)
    bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
    work = Path(tempfile.mkdtemp(prefix="gpu-parts-"))

    def process_group():
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        t = torch.ones(4, device=device)
        dist.all_reduce(t)
        return {"backend": dist.get_backend(), "sum": float(t.sum())}

    parts.run("process_group", process_group)
    model_dir = parts.run("build_model", lambda: {"dir": str(build_model(work / "model"))})["dir"]
    from stages.common.models import load_model, load_tokenizer

    tok = load_tokenizer(model_dir)
    pad = tok.pad_token_id
    rows = [tok(f"What is {a} + {a}? {2 * a}")["input_ids"] for a in range(4)]

    for zero in (2, 3):
        for bf16 in (False, True):
            name = f"deepspeed[zero{zero},{'bf16' if bf16 else 'fp32'}]"
            if bf16 and not bf16_ok:
                parts.results.append({"part": name, "ok": None, "note": "bf16 not supported on this device"})
                print(f"gpu_parts: not run {name}: bf16 not supported on this device", file=sys.stderr)
                continue

            def step(zero=zero, bf16=bf16):
                from stages.sft import collate, forward

                eng = engine(load_model(model_dir, "causal"), zero, bf16, device)
                cpu_batch = collate({"input_ids": rows[:2], "loss_mask": [[1] * len(r) for r in rows[:2]]}, pad)
                batch = next(iter(OnDevice([cpu_batch], eng.device)))
                loss = forward(eng, batch).loss
                eng.backward(loss)
                eng.step()
                return {"loss": round(float(loss.detach()), 4), "engine_device": str(eng.device),
                        "optimizer": type(eng.optimizer).__name__}

            parts.run(name, step)

    def sft():
        from stages.sft import collate, forward

        eng = engine(load_model(model_dir, "causal"), 2, bf16_ok, device)
        losses = []
        for cpu_batch in [collate({"input_ids": rows[i:i + 2], "loss_mask": [[1] * len(r) for r in rows[i:i + 2]]},
                                  pad) for i in (0, 2)]:
            loss = forward(eng, to_device(cpu_batch, eng.device)).loss
            eng.backward(loss)
            eng.step()
            losses.append(round(float(loss.detach()), 4))
        return {"losses": losses}

    parts.run("sft", sft)

    def reward():
        from stages.reward import _rewards, bradley_terry_loss, collate

        eng = engine(load_model(model_dir, "reward", pad), 2, bf16_ok, device)
        cpu_batch = collate({"chosen_input_ids": rows[:2], "rejected_input_ids": rows[2:],
                             "chosen_loss_mask": [[1] * len(r) for r in rows[:2]]}, pad)
        rc, rr = _rewards(eng, to_device(cpu_batch, eng.device))
        loss = bradley_terry_loss(rc, rr)
        eng.backward(loss)
        eng.step()
        return {"loss": round(float(loss.detach()), 4)}

    parts.run("reward", reward)

    def ppo_policy():
        from stages.common.deepspeed import DeepSpeedSection, engine_config
        from stages.ppo.rl import make_batch
        from stages.ppo.worker import PPOWorker

        worker = PPOWorker("policy", 0, 1, {})
        config = engine_config(DeepSpeedSection(zero_stage=2, precision="bf16" if bf16_ok else "fp32"), micro=2,
                               ranks=1, bf16=bf16_ok, batch=4, lr=1e-5, grad_clip=1.0)
        worker.setup({"role": "policy", "kind": "causal", "model_dir": model_dir, "trainable": True, "pad_id": pad,
                      "seed": 0, "storage": types.SimpleNamespace(localize=lambda p: p), "ds_config": config,
                      "lora": None, "reference_dir": None})
        batch = make_batch([r[:6] for r in rows], [r[6:] for r in rows], pad)  # the driver's: on the CPU
        old = worker.logprobs(batch, micro=2)
        assert old.device.type == "cpu", f"log-probs came back on {old.device}"
        hp = {"epochs": 1, "micro": 2, "entropy_coef": 0.0, "kl_loss_coef": 0.0,
              "max_len": batch["response_ids"].shape[1],
              "tokens_per_row": 0.0, "agg": "bnpo", "clip_eps": 0.2, "clip_eps_high": 0.2, "level": "token",
              "kl_weighted": False}
        stats = worker.train_policy({**batch, "old_logprobs": old, "ref_logprobs": old,
                                     "advantages": torch.ones_like(old)}, hp)
        return {"policy_loss": round(stats["policy_loss"], 4), "logprobs_on": str(old.device)}

    parts.run("ppo_policy", ppo_policy)

    def zero3_gather():
        import deepspeed

        eng = engine(load_model(model_dir, "causal"), 3, bf16_ok, device)
        params = list(eng.module.parameters())
        sizes = [p.ds_numel * (2 if bf16_ok else 4) for p in params]

        def peak(fn) -> float | None:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                return round((torch.cuda.max_memory_allocated() - base) / 2**20, 3)
            return None  # no allocator statistics on the CPU: the gathered bytes above say it

        def whole():
            with deepspeed.zero.GatheredParameters(params):
                pass

        def per_parameter():
            for p in params:
                with deepspeed.zero.GatheredParameters([p]):
                    pass

        from stages.ppo.weight_chunks import groups, piece_bytes, weight_chunks
        from stages.common.lora import pieces

        # The sync's own chunks (stages/ppo/weight_chunks.py), at a budget of a quarter of this tiny model so that
        # it takes several; at the default (256 MiB) a 135M model is one or two.
        budget = max(1, sum(sizes) // 4)
        chunk_sizes = [sum(piece_bytes(pieces(eng.module)[i][1]) for i in g)
                       for g in groups([piece_bytes(m) for _, m in pieces(eng.module)], budget)]

        def chunked():
            for _ in weight_chunks(eng.module, zero3=True, budget=budget):
                pass

        t0 = time.time()
        whole_mb = peak(whole)
        t1 = time.time()
        per_mb = peak(per_parameter)
        t2 = time.time()
        chunk_mb = peak(chunked)
        t3 = time.time()
        return {"whole_model_gathered_mb": round(sum(sizes) / 2**20, 3),
                "per_parameter_gathered_mb": round(max(sizes) / 2**20, 3),
                "chunked_gathered_mb": round(max(chunk_sizes) / 2**20, 3), "chunks": len(chunk_sizes),
                "whole_model_peak_mb": whole_mb, "per_parameter_peak_mb": per_mb, "chunked_peak_mb": chunk_mb,
                "whole_model_s": round(t1 - t0, 3), "per_parameter_s": round(t2 - t1, 3),
                "chunked_s": round(t3 - t2, 3)}

    parts.run("zero3_gather", zero3_gather)
    report = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "total_s": round(time.time() - parts.t0, 2), "parts": parts.results}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
