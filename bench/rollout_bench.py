"""Rollouts and weight sync of the ppo stage: vLLM engines vs HF generate, zero-copy vs pickled sync.

    .venv/bin/python bench/rollout_bench.py [--hidden 512 --layers 8 --prompts 32 --n 4]

Builds a LLaMA of tens of millions of parameters (the tiny default says nothing about either
question) and measures, in this one run:

1. Generation tokens/s of the stage's rollout engines (`--engines` vLLM engines, one Ray actor
   and one CPU each, prompts split across them as the policy ranks do) against HF `generate` in
   one process with the same number of threads, on the same weights, prompts (varied lengths)
   and sampling (temperature 1, top-p 1, n samples per prompt), for several response lengths.
   Only real response tokens count (up to and including EOS).
2. Weight sync of the full state dict to every engine: the stage's way (one `ray.put` of numpy
   arrays, each engine reads them in place) against pickling the state dict and sending the
   bytes to each engine, which unpickles its own copy. Median of `--repeats`.
3. Sync as a share of a PPO iteration: the real pipeline (sft and reward cut to one step, then
   `--iterations` PPO iterations) at the same model size, read back from the ppo stage's
   MLflow metrics (generate / score / train / sync seconds per iteration).

Prints a markdown block for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "out" / "rollout"  # this script's own scratch space


def build(args) -> Path:
    from stages.common.models import BuiltinModelConfig, build_base_model
    from stages.common.tasks import TaskConfig, corpus

    shape = BuiltinModelConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_layers=args.layers,
                               num_heads=8, num_kv_heads=8, max_position_embeddings=512)
    return build_base_model(OUT / "model", shape, corpus(TaskConfig(), 0), seed=0)


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token prompts of 8-48 tokens (ids above the 3 special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))] for _ in range(count)]


def hf_tokens_per_s(model_dir: Path, prompts: list[list[int]], n: int, max_new: int, threads: int) -> tuple[float, int]:
    """HF generate, sampling n per prompt, prompts left-padded in one batch; (tokens/s, tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id

    def run(batch_prompts, new):
        width = max(len(p) for p in batch_prompts)
        ids = torch.full((len(batch_prompts), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for j, p in enumerate(batch_prompts):
            ids[j, width - len(p):], attn[j, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new, do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=n,
                                 pad_token_id=pad, eos_token_id=eos)
        tokens = 0
        for row in out[:, width:].tolist():  # real tokens: up to and including the first EOS
            tokens += row.index(eos) + 1 if eos in row else len(row)
        return tokens

    run(prompts[:2], 4)  # warm-up
    t0 = time.time()
    tokens = run(prompts, max_new)
    return tokens / (time.time() - t0), tokens


def vllm_tokens_per_s(pool, prompts: list[list[int]], n: int, max_new: int) -> tuple[float, int]:
    import ray

    from stages.ppo.groups import shard

    sampling = {"n": n, "temperature": 1.0, "top_p": 1.0, "max_tokens": max_new, "seed": 0}
    parts = shard(prompts, len(pool.engines))
    t0 = time.time()
    outs = ray.get([e.generate.remote(p, sampling) for e, p in zip(pool.engines, parts)])
    tokens = sum(len(s["ids"]) for part in outs for group in part for s in group)
    return tokens / (time.time() - t0), tokens


def pickled_engine_cls():
    """The rollout engine plus the baseline loader: unpickle a state dict sent as bytes, then load it."""
    from stages.common.engines import RolloutEngine, weights_to_numpy

    class PickledSyncEngine(RolloutEngine):
        def load_pickled(self, blob: bytes) -> float:
            t0 = time.time()
            self.llm.collective_rpc("load_synced_weights", args=(weights_to_numpy(pickle.loads(blob)),))
            self.llm.reset_prefix_cache()
            return time.time() - t0

    return PickledSyncEngine


def sync_seconds(pool, model_dir: Path, repeats: int) -> tuple[float, float, int]:
    """Median seconds of (zero-copy sync, pickled sync) of a changed state dict to every engine; bytes."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common.engines import nbytes, weights_to_numpy

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    zero, pickled, size = [], [], 0
    for r in range(repeats):
        with torch.no_grad():  # new weights each time, as after a policy update
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        sd = model.state_dict()
        t0 = time.time()  # the stage's sync: export to numpy, one put, every engine reads it in place
        weights = weights_to_numpy(sd)
        pool.sync(ray.put(weights))
        zero.append(time.time() - t0)
        size = nbytes(weights)
        t0 = time.time()  # baseline: pickle the state dict to each engine
        ray.get([e.load_pickled.remote(pickle.dumps(sd)) for e in pool.engines])
        pickled.append(time.time() - t0)
    return statistics.median(zero), statistics.median(pickled), size


def iteration_split(args) -> dict[str, float]:
    """Mean per-iteration seconds of the real ppo stage at this model size (sft/reward cut to one step)."""
    from mlflow.tracking import MlflowClient

    run_dir = OUT / "pipeline"
    overrides = [f"run_dir={run_dir}", f"model.builtin.hidden_size={args.hidden}",
                 f"model.builtin.intermediate_size={4 * args.hidden}", f"model.builtin.num_layers={args.layers}",
                 "model.builtin.num_heads=8", "model.builtin.num_kv_heads=8", "stages.data.generate.sft=200",
                 "stages.data.generate.preference=200", "stages.sft.max_steps=1", "stages.sft.accuracy_prompts=0",
                 "stages.reward.max_steps=1", f"stages.ppo.iterations={args.iterations}",
                 "stages.ppo.eval_prompts=0", f"stages.ppo.checkpoint_every={args.iterations}",
                 "mlflow.experiment=bench"]
    subprocess.run([sys.executable, "-m", "pipeline", "run", "configs/recipes/verifier.yaml", *overrides], cwd=ROOT,
                   check=True,
                   capture_output=True)
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("bench")
    ppo = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'ppo'")[0]
    keys = ("generate_s", "score_s", "train_s", "sync_s", "iteration_s", "gen_tokens_per_s", "sync_mb")
    # The first iteration pays one-off warm-up costs (first forward passes, DeepSpeed buffers): skip it.
    hist = {k: [m.value for m in sorted(client.get_metric_history(ppo.info.run_id, k), key=lambda m: m.step)][1:]
            for k in keys}
    return {k: statistics.mean(v) for k, v in hist.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--lengths", default="16,64,128", help="max new tokens per measurement")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=4, help="PPO iterations for the time split (0: skip)")
    ap.add_argument("--engine-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of the engine actors (e.g. LD_PRELOAD=libtcmalloc_minimal.so.4)")
    args = ap.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    model_dir = build(args)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, vocab)
    lengths = [int(x) for x in args.lengths.split(",")]

    print(f"HF generate ({args.engines} threads) ...", flush=True)
    hf = {m: hf_tokens_per_s(model_dir, prompts, args.n, m, args.engines) for m in lengths}

    import ray

    from stages.common.engines import EnginePool, EngineSpec

    ray.init(num_cpus=args.engines, include_dashboard=False, log_to_driver=False)
    pool = None
    try:
        print(f"starting {args.engines} vLLM engines ...", flush=True)
        spec = EngineSpec(max_model_len=512, kv_cache_gb=1.0, env=dict(kv.split("=", 1) for kv in args.engine_env))
        pool = EnginePool(str(model_dir), spec, args.engines, "PACK", engine_cls=pickled_engine_cls())
        vllm_tokens_per_s(pool, prompts[:4], 1, 4)  # warm-up
        vl = {m: vllm_tokens_per_s(pool, prompts, args.n, m) for m in lengths}
        print("weight sync ...", flush=True)
        zero, pickled, size = sync_seconds(pool, model_dir, args.repeats)
    finally:
        if pool is not None:
            pool.shutdown()
        ray.shutdown()
    split = iteration_split(args) if args.iterations else None

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    n_params = size / 4 / 1e6  # fp32 weights, tied head counted once
    gen_rows = "\n".join(
        f"| {m} | {hf[m][1]} / {vl[m][1]} | {hf[m][0]:.0f} | {vl[m][0]:.0f} | **{vl[m][0] / hf[m][0]:.2f}x** |"
        for m in lengths)
    out = f"""
### {time.strftime('%Y-%m-%d')}, {n_params:.1f}M-parameter LLaMA ({cfg.num_hidden_layers} layers, \
hidden {cfg.hidden_size}), {args.prompts} prompts of 8-48 tokens x n={args.n}

Generation (temperature 1, top-p 1), {args.engines} vLLM engines (1 CPU each) vs HF `generate` ({args.engines} threads):

| max new tokens | tokens HF / vLLM | HF tokens/s | vLLM tokens/s | vLLM / HF |
| --- | --- | --- | --- | --- |
{gen_rows}

Weight sync of {size / 2**20:.0f} MiB to {args.engines} engines (median of {args.repeats}):

| method | seconds |
| --- | --- |
| pickled state dict to each engine | {pickled:.2f} |
| zero-copy: one `ray.put`, engines read in place | {zero:.2f} |
| **pickled / zero-copy** | **{pickled / zero:.2f}x** |
"""
    if split:
        share = split["sync_s"] / split["iteration_s"]
        out += f"""
PPO iteration at this size (the ppo settings of configs/recipes/verifier.yaml; mean of iterations 2-{args.iterations}):

| generate s | score s | train s | sync s | iteration s | sync share | generation tokens/s |
| --- | --- | --- | --- | --- | --- | --- |
| {split['generate_s']:.2f} | {split['score_s']:.2f} | {split['train_s']:.2f} | {split['sync_s']:.2f} | \
{split['iteration_s']:.2f} | **{share:.1%}** | {split['gen_tokens_per_s']:.0f} |
"""
    print(out)


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
