"""RL with a tool learns, measured: configs/recipes/tools.yaml (the embedded model on two- and three-digit
multiplication; SFT shows the calculator call on 30% of its answers; GRPO with every rollout a multi-turn
episode against the calculator), one pipeline run per seed, in its own run directory (cached like any run).

Per seed, two ppo runs from the same SFT model (the second a cache hit up to sft):
- with tools: held-out sampled accuracy of the SFT policy with the calculator (before) and of the trained one
  (after), `eval_samples` answers per prompt from the same random stream, and the paired two-sided sign test
  over prompts; tool calls per sampled answer before and after; the ppo stage's and the invocation's time;
- without tools (`stages.ppo.environment=null`, everything else equal): the same measures, single-turn.

    .venv/bin/python bench/tools.py --seeds 0 1 2 --json bench/tools.json
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


def measures(summary: dict) -> dict:
    m, entry = manifest_metrics(summary, "ppo")
    return {
        "eval_prompts": int(m["eval_prompts"]),
        "sampled_before": m["eval_sampled_accuracy_before"], "sampled_after": m["eval_sampled_accuracy"],
        "sampled_up": int(m["eval_sampled_accuracy_improved"]),
        "sampled_down": int(m["eval_sampled_accuracy_worsened"]),
        "sampled_p": m["eval_sampled_accuracy_sign_test_p"],
        "greedy_before": m["eval_accuracy_before"], "greedy_after": m["eval_accuracy"],
        "greedy_p": m["eval_accuracy_sign_test_p"],
        "tool_calls_before": m.get("eval_sampled_tool_calls_before"),
        "tool_calls_per_sample": m.get("eval_sampled_tool_calls"),  # the trained policy's, held out
        "train_tool_calls_per_sample": m.get("tool_calls_per_sample"),  # the last iteration's rollouts
        "ppo_s": entry.get("duration_s"), "wall_s": summary["invocation_s"], "peak_mem_gib": summary["peak_mem_gib"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "recipes" / "tools.yaml")
    ap.add_argument("--runs", type=Path, help="where the seeds' run directories live (default runs/bench-<config>)")
    ap.add_argument("--fresh", action="store_true", help="delete each seed's run directory first")
    ap.add_argument("--no-baseline", action="store_true", help="skip the RL run without tools")
    ap.add_argument("--json", type=Path, help="also write the rows as a JSON list here")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = ap.parse_args()
    runs = args.runs or ROOT / "runs" / f"bench-{args.config.stem}"

    rows, t0 = [], time.time()
    for seed in args.seeds:
        run_dir = runs / f"seed{seed}"
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        summary = run_pipeline(args.config, run_dir, seed, None, args.overrides, to="ppo")
        with_tools = measures(summary)
        algorithm = json.loads((Path(manifest_metrics(summary, "ppo")[1]["artifact"]) / "manifest.json").read_text())[
            "components"]["config"]["stages.ppo"]["algorithm"]
        row = {"seed": seed, "algorithm": algorithm, **with_tools}
        if not args.no_baseline:
            without = measures(run_pipeline(args.config, run_dir, seed, None,
                                            [*args.overrides, "stages.ppo.environment=null"], to="ppo"))
            row["without_tools"] = {k: without[k] for k in ("sampled_before", "sampled_after", "sampled_p",
                                                             "greedy_before", "greedy_after", "ppo_s", "wall_s")}
        rows.append(row)
        print(f"[seed {seed}] sampled {fmt(row['sampled_before'])} -> {fmt(row['sampled_after'])} "
              f"(p {fmt(row['sampled_p'], 2)}) on {row['eval_prompts']}; tool calls "
              f"{fmt(row['tool_calls_before'])} -> {fmt(row['tool_calls_per_sample'])}"
              + (f"; without tools {fmt(row['without_tools']['sampled_after'])}" if "without_tools" in row else ""),
              file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    print(f"# bench/tools.py, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all")
    print(f"# command: {' '.join(['.venv/bin/python', 'bench/tools.py', *sys.argv[1:]])}")
    print("| seed | algorithm | held-out prompts | sampled with tools before → after | up / down | p | tool calls "
          "per answer before → after | without tools: sampled before → after | ppo s (with / without) | run s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        w = r.get("without_tools") or {}
        print(f"| {r['seed']} | {r['algorithm']} | {r['eval_prompts']} | {fmt(r['sampled_before'])} → "
              f"{fmt(r['sampled_after'])} | {r['sampled_up']} / {r['sampled_down']} | {fmt(r['sampled_p'], 2)} | "
              f"{fmt(r['tool_calls_before'])} → {fmt(r['tool_calls_per_sample'])} | "
              f"{fmt(w.get('sampled_before'))} → {fmt(w.get('sampled_after'))} | {fmt(r['ppo_s'], 0)} / "
              f"{fmt(w.get('ppo_s'), 0)} | {fmt(r['wall_s'], 0)} |")


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
