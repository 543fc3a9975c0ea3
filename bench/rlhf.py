"""RLHF from the learned reward alone: does PPO / GRPO whose only reward is the reward model raise a gold
preference it never sees?

The recipe `configs/recipes/rlhf.yaml` labels the generated preference pairs with the task's gold
preference (`task.preference.gold: explained`, 15% of labels flipped), trains the reward model on
them and runs RL with `rewards: {rule_weight: 0, model_weight: 1}`. Per seed, model, data, SFT and
the reward model run once and the RL stage once per algorithm (only `stages.ppo.algorithm`
changes). Every held-out prompt (problems never seen in training, in any wording) is answered with
`eval_samples` samples by the SFT policy and by the trained one; the gold function judges every
pair of answers of a prompt (ties count a half), and a two-sided sign test over prompts (won vs
lost) gives `gold_winrate_p`. Correctness is the verifier's sampled accuracy before and after.

    .venv/bin/python bench/rlhf.py --seeds 0 1 2 --algorithms ppo grpo --json /tmp/rlhf.json
    .venv/bin/python bench/rlhf.py --seeds 0 --algorithms grpo --plot docs/images/overoptimisation.png

Runs are cached like any pipeline run (`--fresh` starts from empty run directories); extra
`key=value` arguments are config overrides for every run (e.g. `stages.ppo.iterations=240
stages.ppo.kl.coef=0.005` for the long over-optimisation run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from learning import ALGORITHMS, fmt, manifest_metrics, run_pipeline  # bench/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("seed", "algorithm", "eval_prompts", "rm_accuracy_noisy", "rm_accuracy_gold", "gold_winrate",
        "gold_winrate_p", "accuracy_before", "accuracy_after", "kl_final", "wall_s")


def row(seed: int, algorithm: str, summary: dict) -> dict:
    rl, entry = manifest_metrics(summary, "ppo")
    rm, _ = manifest_metrics(summary, "reward")
    return {
        "seed": seed, "algorithm": algorithm, "eval_prompts": int(rl["eval_prompts"]),
        "rm_accuracy_noisy": rm["eval_accuracy"], "rm_accuracy_gold": rm.get("eval_accuracy_gold"),
        "gold_winrate": rl["gold_winrate"], "gold_winrate_p": rl["gold_winrate_p"],
        "accuracy_before": rl["eval_sampled_accuracy_before"], "accuracy_after": rl["eval_sampled_accuracy"],
        "kl_final": rl["kl"], "wall_s": entry["duration_s"] if entry["status"] == "miss" else None,
        # beyond the required keys
        "gold_won": int(rl["gold_winrate_wins"]), "gold_lost": int(rl["gold_winrate_losses"]),
        "gold_before": rl.get("eval_sampled_gold_before"), "gold_after": rl.get("eval_sampled_gold"),
        "greedy_before": rl["eval_accuracy_before"], "greedy_after": rl["eval_accuracy"],
        "accuracy_p": rl["eval_sampled_accuracy_sign_test_p"], "kl_max": rl.get("kl_max"),
        "artifact": entry["artifact"], "invocation_s": summary["invocation_s"],
    }


def table(rows: list[dict]) -> str:
    head = ("| seed | algorithm | eval prompts | RM acc noisy / gold | gold win-rate | won / lost | p | gold SFT → RL "
            "| sampled acc SFT → RL | greedy acc SFT → RL | KL final | RL wall s |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['algorithm']} | {r['eval_prompts']} | {fmt(r['rm_accuracy_noisy'])} / "
                     f"{fmt(r['rm_accuracy_gold'])} | {fmt(r['gold_winrate'])} | {r['gold_won']} / {r['gold_lost']} | "
                     f"{fmt(r['gold_winrate_p'], 2)} | {fmt(r['gold_before'])} → {fmt(r['gold_after'])} | "
                     f"{fmt(r['accuracy_before'])} → {fmt(r['accuracy_after'])} | {fmt(r['greedy_before'])} → "
                     f"{fmt(r['greedy_after'])} | {fmt(r['kl_final'], 2)} | {fmt(r['wall_s'], 0)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algorithms", nargs="+", default=["ppo", "grpo"], choices=ALGORITHMS)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "recipes" / "rlhf.yaml")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-rlhf",
                    help="one run directory per seed is made under it")
    ap.add_argument("--fresh", action="store_true", help="delete each seed's run directory first")
    ap.add_argument("--json", type=Path, help="also write the rows as a JSON list here")
    ap.add_argument("--plot", type=Path, help="copy the first row's over-optimisation plot here")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = ap.parse_args()

    rows, t0 = [], time.time()
    for seed in args.seeds:
        run_dir = args.runs / f"seed{seed}"
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        for alg in args.algorithms:
            rows.append(row(seed, alg, run_pipeline(args.config, run_dir, seed, alg, args.overrides)))
            r = rows[-1]
            print(f"[seed {seed} {alg}] gold win-rate {r['gold_winrate']:.3f} (p {r['gold_winrate_p']:.2g}), sampled "
                  f"accuracy {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}, RM noisy/gold "
                  f"{r['rm_accuracy_noisy']:.3f}/{fmt(r['rm_accuracy_gold'])}", file=sys.stderr, flush=True)
            if args.json:  # written as it goes: a long bench that is stopped keeps its finished rows
                args.json.write_text(json.dumps(rows, indent=2))
    if args.plot and rows:
        plot = Path(rows[0]["artifact"]) / "overoptimisation.png"
        if plot.exists():
            args.plot.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plot, args.plot)
    print(f"# bench/rlhf.py, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all")
    print(f"# command: {' '.join(['.venv/bin/python', 'bench/rlhf.py', *sys.argv[1:]])}")
    print(table(rows))


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
