"""SFT training throughput and memory: DeepSpeed ZeRO 0/2/3 on Ray Train vs a plain torch loop.

    .venv/bin/python bench/train_bench.py [--hidden 512 --layers 8 --steps 30]

Builds a model of tens of millions of parameters (the tiny default says nothing about ZeRO),
runs the sft stage on the same generated data under ZeRO 0, 2 and 3 (2 workers), and a plain
single-process torch AdamW loop over the same rows and batch size. Reports training tokens/s
(ratios against the plain loop, measured in this run) and each worker's peak resident memory.
Prints a markdown block for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def plain_loop(run_dir: Path, steps: int, batch: int) -> float:
    """tokens/s of a single-process torch loop on the sft stage's rows and base model."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common.models import load_tokenizer
    from stages.sft import collate

    base = glob.glob(str(run_dir / "artifacts/model/*/model"))[0]
    rows = pq.ParquetDataset(
        sorted(glob.glob(str(run_dir / "artifacts/data/*/sft/train/*.parquet")))).read().to_pylist()
    tok = load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, busy = 0, 0.0
    for step in range(steps):
        chunk = rows[(step * batch) % len(rows):][:batch]
        b = collate({"input_ids": [r["input_ids"] for r in chunk], "loss_mask": [r["loss_mask"] for r in chunk]},
                    tok.pad_token_id)
        t0 = time.time()
        loss = model(**b).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step:  # the first step pays one-off allocation costs
            busy += time.time() - t0
            tokens += int(b["attention_mask"].sum())
    return tokens / busy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    run_dir = ROOT / "bench" / "out" / "train"
    shutil.rmtree(run_dir, ignore_errors=True)  # bench/out is this script's own scratch space
    common = [f"run_dir={run_dir}", f"model.builtin.hidden_size={args.hidden}",
              f"model.builtin.intermediate_size={4 * args.hidden}", f"model.builtin.num_layers={args.layers}",
              "model.builtin.num_heads=8", "model.builtin.num_kv_heads=8", "stages.data.generate.sft=4000",
              f"stages.sft.max_steps={args.steps}", "stages.sft.batch_size=16", "stages.sft.micro_batch_size=8",
              "stages.sft.eval_every=100000", "stages.sft.checkpoint_every=100000", "stages.sft.accuracy_prompts=0",
              "mlflow.experiment=bench"]
    results = {}
    for zero in (0, 2, 3):
        cmd = [sys.executable, "-m", "pipeline", "run", "configs/recipes/verifier.yaml", "--to", "sft", *common,
               f"stages.sft.deepspeed.zero_stage={zero}"]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        manifest = json.loads(max((run_dir / "artifacts/sft").glob("*/manifest.json"),
                                  key=lambda p: p.stat().st_mtime).read_text())
        results[zero] = manifest["metrics"]
    n_params = json.loads(
        next((run_dir / "artifacts/model").glob("*/manifest.json")).read_text())["metrics"]["num_parameters"]
    plain = plain_loop(run_dir, args.steps, 16)
    plain_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = "\n".join(
        f"| ZeRO-{z} (2 workers) | {m['tokens_per_s']:.0f} | {m['tokens_per_s'] / plain:.2f}x | "
        + " / ".join(f"{m[k]:.0f}" for k in sorted(m) if k.startswith("peak_rss_mb_rank")) + " |"
        for z, m in results.items())
    print(f"""
### SFT training, {n_params / 1e6:.1f}M-parameter LLaMA, {args.steps} steps of 16 sequences, {time.strftime('%Y-%m-%d')}

| run | tokens/s | vs plain loop | peak RSS per worker, MB |
| --- | --- | --- | --- |
{rows}
| plain torch loop (1 process) | {plain:.0f} | 1.00x | {plain_rss:.0f} (whole bench process) |
""")


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
