"""Data stage throughput: Ray Data against one process doing the same work, and a cached rerun.

    .venv/bin/python bench/data_bench.py [--rows 20000]

Measures, in one run on this machine:
  1. the data stage through the pipeline (Ray Data: validate, dedupe, template, tokenize with an
     actor pool, mask, split, Parquet), from its manifest's duration (includes starting Ray);
  2. a single-process baseline on the same rows with the same functions (check_row, Tokenize,
     split_of), deduplicating with a set and writing Parquet with pyarrow;
  3. the wall time of `python -m pipeline run` when every stage is cached.
Prints a markdown block for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def single_process(rows_by_kind: dict, tokenizer_path: str, cfg, seed: int, out: Path) -> int:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from stages.data.formats import check_row
    from stages.data.steps import Tokenize, _table, split_of

    tok = Tokenize(tokenizer_path, cfg.max_len, cfg.system_prompt)
    written = 0
    for kind, rows in rows_by_kind.items():
        seen, out_rows = set(), []
        for row in rows:
            good, err = check_row(kind, row)
            if err:
                continue
            payload = json.dumps(good, sort_keys=True)
            if payload in seen:
                continue
            seen.add(payload)
            tokenized, fits = tok._row(kind, good)
            if fits:
                out_rows.append({**tokenized, "kind": kind, "split": split_of(good["key"], seed, cfg.eval_fraction)})
        table = _table(out_rows)
        for split in ("train", "eval"):
            part = table.filter(pc.equal(table["split"], split))
            (out / kind).mkdir(parents=True, exist_ok=True)
            pq.write_table(part, out / kind / f"{split}.parquet")
        written += len(out_rows)
    return written


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000, help="SFT rows (preference and prompt rows: half and a quarter)")
    args = ap.parse_args()
    run_dir = ROOT / "bench" / "out" / "data"
    shutil.rmtree(run_dir, ignore_errors=True)  # bench/out is this script's own scratch space
    n_sft, n_pref, n_prompts = args.rows, args.rows // 2, args.rows // 4
    overrides = [f"run_dir={run_dir}", f"stages.data.generate.sft={n_sft}",
                 f"stages.data.generate.preference={n_pref}", f"stages.data.generate.prompts={n_prompts}"]
    cmd = [sys.executable, "-m", "pipeline", "run", "configs/recipes/verifier.yaml", "--to", "data", *overrides]

    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    first_wall = time.time() - t0
    manifest = json.loads(next((run_dir / "artifacts" / "data").glob("*/manifest.json")).read_text())
    ray_s = manifest["duration_s"]
    n_in = n_sft + n_pref + n_prompts

    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    cached_wall = time.time() - t0

    from pipeline.config import load_config
    from stages.common import tasks

    cfg = load_config(ROOT / "configs" / "recipes" / "verifier.yaml", overrides)
    rows = {"sft": tasks.sft_rows(n_sft, cfg.seed, cfg.task),
            "preference": tasks.preference_rows(n_pref, cfg.seed, cfg.task),
            "prompts": tasks.prompt_rows(n_prompts, cfg.seed, cfg.task)}
    tokenizer = next((run_dir / "artifacts" / "model").glob("*/model"))
    t0 = time.time()
    written = single_process(rows, str(tokenizer), cfg.stages.data, cfg.seed, run_dir / "single")
    single_s = time.time() - t0

    ray_written = sum(manifest["metrics"][f"{k}_{s}_rows"] for k in ("sft", "preference", "prompts")
                      for s in ("train", "eval"))
    print(f"""
### Data stage, {n_in} raw rows ({n_sft} sft, {n_pref} preference, {n_prompts} prompts), {time.strftime('%Y-%m-%d')}

Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}.

| measure | value |
| --- | --- |
| Ray Data stage (incl. Ray start), s | {ray_s:.1f} |
| Ray Data rows/s (raw rows in) | {n_in / ray_s:.0f} |
| single process, same work, s | {single_s:.1f} |
| single process rows/s | {n_in / single_s:.0f} |
| **Ray Data / single-process throughput** | **{single_s / ray_s:.2f}x** |
| rows written (Ray / single) | {ray_written} / {written} |
| first `run --to data` wall (model + data), s | {first_wall:.1f} |
| fully cached rerun wall, s | {cached_wall:.1f} |
""")


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
