"""Does on-policy distillation bring the SFT student to its teacher, and faster than GRPO from the same start?

The default (`configs/full.yaml`: the embedded task with the gold preference), per seed, in one run directory
per seed (model, data, SFT and reward model shared by the three runs of a seed):
  1. teacher: the default's own RL stage (PPO on the reward model and the verifier); its policy is the teacher
     (the issue's "RL-trained policy": same architecture and tokenizer).
  2. distill: the ppo stage again from the same SFT policy, `algorithm: grpo` with only the teacher's per-token
     reward (`stages.ppo.distill.teacher`, no verifier, no reward model), `--iterations` iterations.
  3. grpo: the ppo stage from the same SFT policy, `algorithm: grpo` on the default's rewards, same iterations.
Per run, from the ppo stage's manifest: every held-out prompt's sampled accuracy before (the SFT policy) and
after, with the paired sign test; the gold win-rate against the SFT policy's answers and its sign test; the
stage's minutes. Rows carry `seed`, `method`, `eval_prompts`, `sampled_before`, `sampled_after`, `sampled_p`,
`gold_winrate`, `gold_winrate_p`, `minutes`, `wall_s`; accuracy per training minute is
(sampled_after - sampled_before) / minutes.

    .venv/bin/python bench/distill.py --seeds 0 1 2 --json bench/distill.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import ROOT, manifest_metrics, run_pipeline  # noqa: E402

KEYS = ("seed", "method", "eval_prompts", "sampled_before", "sampled_after", "sampled_p", "gold_winrate",
        "gold_winrate_p", "minutes", "wall_s")


def row(seed: int, method: str, summary: dict) -> dict:
    rl, entry = manifest_metrics(summary, "ppo")
    wall = entry["duration_s"] if entry["status"] == "miss" else None
    return {"seed": seed, "method": method, "eval_prompts": int(rl["eval_prompts"]),
            "sampled_before": rl["eval_sampled_accuracy_before"], "sampled_after": rl["eval_sampled_accuracy"],
            "sampled_p": rl["eval_sampled_accuracy_sign_test_p"], "gold_winrate": rl.get("gold_winrate"),
            "gold_winrate_p": rl.get("gold_winrate_p"), "minutes": wall / 60 if wall else None, "wall_s": wall,
            "reverse_kl_last": rl.get("distill_reverse_kl"), "artifact": entry["artifact"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "full.yaml")
    ap.add_argument("--iterations", type=int, default=30, help="ppo iterations of the distill and grpo runs")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-distill")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    rows, t0 = [], time.time()
    for seed in args.seeds:
        run_dir = args.runs / f"seed{seed}"
        teacher_run = run_pipeline(args.config, run_dir, seed, None, [])
        rows.append(row(seed, "teacher", teacher_run))
        teacher = Path(rows[-1]["artifact"]) / "model"
        same = [f"stages.ppo.iterations={args.iterations}", f"stages.ppo.checkpoint_every={args.iterations}"]
        methods = {
            "distill": ["stages.ppo.algorithm=grpo", f"stages.ppo.distill.teacher={teacher}",
                        "stages.ppo.rewards.rule_weight=0", "stages.ppo.rewards.model_weight=0", *same],
            "grpo": ["stages.ppo.algorithm=grpo", *same],
        }
        for method, overrides in methods.items():
            rows.append(row(seed, method, run_pipeline(args.config, run_dir, seed, None, overrides)))
            r = rows[-1]
            print(f"[seed {seed} {method}] sampled {r['sampled_before']:.3f} -> {r['sampled_after']:.3f} "
                  f"(p {r['sampled_p']:.2g}), gold win-rate {r['gold_winrate']}", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))
    print(f"# bench/distill.py, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all")
    print(f"# command: {' '.join(['.venv/bin/python', 'bench/distill.py', *sys.argv[1:]])}")
    for r in rows:
        print({k: r[k] for k in KEYS})


if __name__ == "__main__":
    main()
