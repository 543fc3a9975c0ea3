"""A user's own job on a real model, measured: configs/recipes/own-job-real.yaml (SmolLM2-135M-Instruct with
LoRA; ShareGPT SFT chats, RL prompts in the user's columns with an `aliases` column the reward reads, a held-out
eval file of their own; `task.verifier: exact`; no reward stage, GRPO on the rule reward).

Per seed: the pipeline up to ppo in its own run directory (cached like any run), then from the manifests:
the base model's and the SFT model's greedy accuracy on the held-out questions (the sft stage scores both),
and the held-out sampled accuracy before and after RL (4 samples per question, the same random stream) with
the paired two-sided sign test over questions.

    .venv/bin/python bench/own_job.py --seed 0 --json /tmp/own_job.json
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
KEYS = ("seed", "eval_prompts", "base_greedy", "sft_greedy", "sampled_before", "sampled_after", "sampled_p",
        "stages_run", "wall_s")


def row(seed: int, summary: dict) -> dict:
    rl, _ = manifest_metrics(summary, "ppo")
    sft, _ = manifest_metrics(summary, "sft")
    return {
        "seed": seed, "eval_prompts": int(rl["eval_prompts"]), "base_greedy": sft["base_accuracy"],
        "sft_greedy": sft["accuracy"], "sampled_before": rl["eval_sampled_accuracy_before"],
        "sampled_after": rl["eval_sampled_accuracy"], "sampled_p": rl["eval_sampled_accuracy_sign_test_p"],
        "stages_run": [s["name"] for s in summary["stages"] if s["status"] == "miss"],
        "wall_s": summary["invocation_s"],
        # beyond the required keys
        "sampled_up": int(rl["eval_sampled_accuracy_improved"]),
        "sampled_down": int(rl["eval_sampled_accuracy_worsened"]),
        "greedy_before": rl["eval_accuracy_before"], "greedy_after": rl["eval_accuracy"],
        "greedy_p": rl["eval_accuracy_sign_test_p"], "rule_reward_last": rl.get("rule_reward_mean"),
        "rule_timeouts": rl.get("rule_timeouts"), "rule_errors": rl.get("rule_errors"),
        "sft_eval_rows": sft.get("accuracy_prompts"), "peak_mem_gib": summary["peak_mem_gib"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, nargs="+", default=[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "recipes" / "own-job-real.yaml")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-own-job")
    ap.add_argument("--fresh", action="store_true", help="delete each seed's run directory first")
    ap.add_argument("--json", type=Path, help="also write the rows as a JSON list here")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = ap.parse_args()

    rows, t0 = [], time.time()
    for seed in args.seed:
        run_dir = args.runs / f"seed{seed}"
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        rows.append(row(seed, run_pipeline(args.config, run_dir, seed, "grpo", args.overrides)))
        r = rows[-1]
        print(f"[seed {seed}] greedy base {r['base_greedy']:.3f} -> sft {r['sft_greedy']:.3f}; sampled "
              f"{r['sampled_before']:.3f} -> {r['sampled_after']:.3f} (p {r['sampled_p']:.2g}) on {r['eval_prompts']}",
              file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    print(f"# bench/own_job.py, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all")
    print(f"# command: {' '.join(['.venv/bin/python', 'bench/own_job.py', *sys.argv[1:]])}")
    print("| seed | held-out | greedy base → SFT | sampled before → after RL | up / down | p | greedy RL | stages run "
          "| wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['seed']} | {r['eval_prompts']} | {fmt(r['base_greedy'])} → {fmt(r['sft_greedy'])} | "
              f"{fmt(r['sampled_before'])} → {fmt(r['sampled_after'])} | {r['sampled_up']} / {r['sampled_down']} | "
              f"{fmt(r['sampled_p'], 2)} | {fmt(r['greedy_before'])} → {fmt(r['greedy_after'])} | "
              f"{', '.join(r['stages_run'])} | {fmt(r['wall_s'], 0)} |")


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
