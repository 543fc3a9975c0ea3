"""DPO learns, measured: configs/recipes/dpo.yaml (the embedded model and task: SFT, then DPO on the generated
preference pairs, the correct answer chosen over a plausible wrong one) or configs/recipes/dpo-real.yaml
(SmolLM2-135M-Instruct with LoRA), one pipeline run per seed up to the dpo stage, in its own run directory
(cached like any run).

From each run's dpo manifest: the held-out implicit-reward pairwise accuracy at step 0 (the start model: every
implicit reward 0, a tie, scored a half) and at the end; the held-out task accuracy of the start model and the
DPO model, greedy and sampled (`eval_samples` answers per prompt, the same random stream), each with the paired
two-sided sign test over prompts; the DPO stage's own time (`dpo_s`, from its manifest) and the invocation's.

    .venv/bin/python bench/dpo.py --seeds 0 1 2 --json bench/dpo.json
    .venv/bin/python bench/dpo.py --config configs/recipes/dpo-real.yaml --seeds 0 --json bench/dpo_real.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from learning import fmt, manifest_metrics, run_pipeline  # bench/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent


def pairs_curve(tracking_uri: str, run_id: str) -> list[list[float]]:
    """[step, held-out implicit-reward accuracy, seconds since the dpo stage's MLflow run started] per evaluation."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    start = client.get_run(run_id).info.start_time
    history = client.get_metric_history(run_id, "eval_reward_accuracy")
    first: dict[int, tuple[float, int]] = {}  # the stage logs its final metrics again at the end: keep the worker's
    for h in sorted(history, key=lambda h: h.timestamp):
        first.setdefault(h.step, (h.value, h.timestamp))
    return [[step, value, round((ts - start) / 1000, 1)] for step, (value, ts) in sorted(first.items())]


def row(seed: int, summary: dict) -> dict:
    m, entry = manifest_metrics(summary, "dpo")
    manifest = json.loads((Path(entry["artifact"]) / "manifest.json").read_text())
    curve = pairs_curve(summary["tracking_uri"], entry["mlflow_run_id"])
    return {
        "seed": seed, "loss": manifest["components"]["config"]["stages.dpo"]["loss"],
        "pairs_accuracy_start": curve[0][1] if curve else None,
        "pairs_accuracy": m["eval_reward_accuracy"], "pairs_margin": m["eval_reward_margin"],
        "pairs_curve": curve, "eval_prompts": int(m["eval_prompts"]),
        "greedy_before": m["eval_accuracy_before"], "greedy_after": m["eval_accuracy"],
        "greedy_up": int(m["eval_accuracy_improved"]), "greedy_down": int(m["eval_accuracy_worsened"]),
        "greedy_p": m["eval_accuracy_sign_test_p"],
        "sampled_before": m.get("eval_sampled_accuracy_before"), "sampled_after": m.get("eval_sampled_accuracy"),
        "sampled_p": m.get("eval_sampled_accuracy_sign_test_p"), "steps": int(m["step"]),
        "dpo_s": entry.get("duration_s"), "stages_run": [s["name"] for s in summary["stages"] if s["status"] == "miss"],
        "wall_s": summary["invocation_s"], "peak_mem_gib": summary["peak_mem_gib"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "recipes" / "dpo.yaml")
    ap.add_argument("--runs", type=Path, help="where the seeds' run directories live (default runs/bench-<config>)")
    ap.add_argument("--fresh", action="store_true", help="delete each seed's run directory first")
    ap.add_argument("--json", type=Path, help="also write the rows as a JSON list here")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = ap.parse_args()
    runs = args.runs or ROOT / "runs" / f"bench-{args.config.stem}"

    rows, t0 = [], time.time()
    for seed in args.seeds:
        run_dir = runs / f"seed{seed}"
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        summary = run_pipeline(args.config, run_dir, seed, None, args.overrides, to="dpo")
        rows.append(row(seed, summary))
        r = rows[-1]
        print(f"[seed {seed}] pairs {fmt(r['pairs_accuracy_start'])} -> {fmt(r['pairs_accuracy'])}; greedy "
              f"{fmt(r['greedy_before'])} -> {fmt(r['greedy_after'])} (p {fmt(r['greedy_p'], 2)}) on "
              f"{r['eval_prompts']}",
              file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    print(f"# bench/dpo.py, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all")
    print(f"# command: {' '.join(['.venv/bin/python', 'bench/dpo.py', *sys.argv[1:]])}")
    print("| seed | loss | held-out pairs: implicit-reward accuracy start → end | held-out prompts | greedy before → "
          "after | up / down | p | sampled before → after | p | DPO s | run s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['seed']} | {r['loss']} | {fmt(r['pairs_accuracy_start'])} → {fmt(r['pairs_accuracy'])} | "
              f"{r['eval_prompts']} | {fmt(r['greedy_before'])} → {fmt(r['greedy_after'])} | {r['greedy_up']} / "
              f"{r['greedy_down']} | {fmt(r['greedy_p'], 2)} | {fmt(r['sampled_before'])} → "
              f"{fmt(r['sampled_after'])} | "
              f"{fmt(r['sampled_p'], 2)} | {fmt(r['dpo_s'], 0)} | {fmt(r['wall_s'], 0)} |")


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
