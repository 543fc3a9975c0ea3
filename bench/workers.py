"""The default's Train stages on one worker (in the driver) against two (Ray Train's worker group).

    .venv/bin/python bench/workers.py --json bench/workers.json
    .venv/bin/python bench/workers.py --stages sft --repeats 2
    .venv/bin/python bench/workers.py --stages dpo        # the DPO recipe's dpo stage (configs/recipes/dpo.yaml)

Issue 60 asks the default's worker count to be chosen by measuring both on the default. Per stage and repeat,
each variant runs the whole stage as the default configures it (`pipeline run configs/full.yaml --only STAGE
--force STAGE`; dpo, which the default lacks, as `configs/recipes/dpo.yaml` does), alternating A B A B in one
invocation so that the machine's drift falls on both, with the **global batch unchanged** (`batch_size`): two
workers of `micro_batch_size` rows each, or one worker whose micro-batch is the whole batch (the same rows per
forward pass on the machine, no gradient accumulation). Upstream artifacts (model, data, and the default's SFT
for the reward model) are prepared once, untimed and cached.

Per stage and variant it prints: the stage's wall time (median over repeats), its start-up, training
tokens/s, processes, and what it learned (held-out loss; SFT's greedy accuracy, the reward model's pair
accuracy), and the ratio of the two variants' wall times from the same repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import DEFAULT, DPO, ROOT, finish, pipeline  # noqa: E402  (bench/startup.py: a run, a bench's close)

CONFIG = {"sft": DEFAULT, "reward": DEFAULT, "dpo": DPO}  # dpo: the recipe's (the default has no dpo stage)

VARIANTS = {"group2": "2 workers, Ray Train's worker group", "local1": "1 worker, in the driver"}
LEARNED = ("eval_loss", "accuracy", "eval_accuracy", "eval_accuracy_gold", "eval_reward_accuracy")


def overrides(stage: str, variant: str) -> list[str]:
    """The variant's settings for `stage`, the global batch as its config (`CONFIG`) has it."""
    import yaml

    section = yaml.safe_load(CONFIG[stage].read_text())["stages"][stage]
    batch = section["batch_size"]
    if variant == "group2":
        return [f"stages.{stage}.num_workers=2", f"stages.{stage}.micro_batch_size={batch // 2}"]
    return [f"stages.{stage}.num_workers=1", f"stages.{stage}.micro_batch_size={batch}"]


def measure(stage: str, variant: str, run_dir: Path) -> dict:
    """One forced run of `stage` under `variant`; its figures from the manifest it wrote."""
    summary = pipeline(CONFIG[stage], run_dir, "--only", stage, "--force", stage, *overrides(stage, variant))
    entry = next(s for s in summary["stages"] if s["name"] == stage)
    metrics = json.loads((Path(entry["artifact"]) / "manifest.json").read_text())["metrics"]
    return {"stage": stage, "variant": variant, "wall_s": entry["duration_s"], "startup_s": metrics.get("startup_s"),
            "processes": int(metrics.get("startup_processes", 0)), "tokens_per_s": metrics.get("tokens_per_s"),
            "steps": metrics.get("step"), "learned": {k: metrics[k] for k in LEARNED if k in metrics}}


def table(rows: list[dict]) -> str:
    lines = ["| stage | variant | processes | wall s (median) | start-up s | tokens/s | learned | wall ratio 2w/1w |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        learned = ", ".join(f"{k} {v:.4f}" for k, v in r["learned"].items())
        ratio = f"{r['ratio']:.2f}x ({', '.join(f'{x:.2f}' for x in r['ratios'])})" if "ratio" in r else ""
        rate = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] is not None else "(not logged)"
        lines.append(f"| {r['stage']} | {VARIANTS[r['variant']]} | {r['processes']} | **{r['wall_s']:.1f}** "
                     f"| {r['startup_s']:.1f} | {rate} | {learned} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", nargs="+", default=["sft", "reward"], choices=sorted(CONFIG))
    ap.add_argument("--repeats", type=int, default=1, help="A B pairs per stage; medians are reported")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "bench-workers")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()

    t0 = time.time()
    if {"sft", "reward"} & set(args.stages):
        pipeline(DEFAULT, args.run_dir, "--to", "reward" if "reward" in args.stages else "sft")
    if "dpo" in args.stages:  # the recipe's model, data and SFT, in a run directory of its own
        pipeline(DPO, args.run_dir / "dpo", "--to", "sft")
    rows = []
    for stage in args.stages:
        runs = {v: [] for v in VARIANTS}
        run_dir = args.run_dir / "dpo" if stage == "dpo" else args.run_dir
        for _ in range(args.repeats):
            for variant in VARIANTS:
                runs[variant].append(measure(stage, variant, run_dir))
                r = runs[variant][-1]
                print(f"{stage} {variant}: {r['wall_s']:.1f}s wall, start-up {r['startup_s']:.1f}s, {r['learned']}",
                      file=sys.stderr, flush=True)
        ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(runs["group2"], runs["local1"])]
        for variant, rs in runs.items():
            median = sorted(rs, key=lambda r: r["wall_s"])[(len(rs) - 1) // 2]
            rows.append({**median, "walls": [r["wall_s"] for r in rs],
                         **({"ratio": statistics.median(ratios), "ratios": ratios} if variant == "local1" else {})})
    finish(t0, table(rows), rows, args.json)


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
