"""GRPO, DAPO, GSPO and CISPO on the embedded task: the same start, rewards and budget, every seed.

For each seed, the pipeline of `--config` (default `configs/full.yaml`) up to the RL stage (model, data, SFT
and reward model shared, one run directory per seed), then the ppo stage once per method with
`stages.ppo.algorithm: grpo` and only the method's objective changed (docs/objectives.md):
  grpo   the defaults (loss_type bnpo, symmetric clip 0.2, token ratios)
  dapo   loss_type dapo, clip_eps_high 0.28, dynamic sampling (2 refills at most), the overlong penalty
  gspo   importance_sampling sequence, loss_type grpo, clip 3e-4 / 4e-4
  cispo  loss_type cispo (the weight capped at 5.0)
Every run also plots the held-out curve every 5 iterations on 256 prompts, as bench/distill.py's runs do; both
benches keep their runs in `runs/bench-rl/seed<N>` by default, so one's model, data, SFT and reward model
(and the plain grpo run, identical in both) are the other's cache hits.
Per run, from its manifest: held-out sampled accuracy before and after with the paired sign test, the gold
win-rate against the SFT policy (with a gold preference), the last iteration's KL to the reference and
entropy, and the stage's minutes. Rows carry `seed`, `method`, `eval_prompts`, `sampled_before`,
`sampled_after`, `sampled_p`, `gold_winrate`, `gold_winrate_p`, `minutes`, `wall_s` (and `kl`, `entropy`).

    .venv/bin/python bench/objectives.py --seeds 0 1 2 --json bench/objectives.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import ROOT, manifest_metrics, run_pipeline  # noqa: E402

SAME = ["stages.ppo.eval_every=5", "stages.ppo.curve_prompts=256"]  # bench/distill.py's curve
METHODS = {
    "grpo": [],
    "dapo": ["stages.ppo.loss_type=dapo", "stages.ppo.clip_eps_high=0.28", "stages.ppo.dynamic_sampling.enabled=true",
             "stages.ppo.overlong.cache=4"],
    "gspo": ["stages.ppo.importance_sampling=sequence", "stages.ppo.loss_type=grpo", "stages.ppo.clip_eps=0.0003",
             "stages.ppo.clip_eps_high=0.0004"],
    "cispo": ["stages.ppo.loss_type=cispo"],
}
KEYS = ("seed", "method", "eval_prompts", "sampled_before", "sampled_after", "sampled_p", "gold_winrate",
        "gold_winrate_p", "minutes", "wall_s", "kl", "entropy")


def row(seed: int, method: str, summary: dict) -> dict:
    rl, entry = manifest_metrics(summary, "ppo")
    wall = entry["duration_s"] if entry["status"] == "miss" else None
    return {"seed": seed, "method": method, "eval_prompts": int(rl["eval_prompts"]),
            "sampled_before": rl["eval_sampled_accuracy_before"], "sampled_after": rl["eval_sampled_accuracy"],
            "sampled_p": rl["eval_sampled_accuracy_sign_test_p"], "gold_winrate": rl.get("gold_winrate"),
            "gold_winrate_p": rl.get("gold_winrate_p"), "minutes": wall / 60 if wall else None, "wall_s": wall,
            "kl": rl.get("kl"), "entropy": rl.get("entropy")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "full.yaml")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-rl")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = ap.parse_args()

    rows, t0 = [], time.time()
    for seed in args.seeds:
        for method in args.methods:
            summary = run_pipeline(args.config, args.runs / f"seed{seed}", seed, "grpo",
                                   [*SAME, *METHODS[method], *args.overrides])
            rows.append(row(seed, method, summary))
            r = rows[-1]
            print(f"[seed {seed} {method}] sampled {r['sampled_before']:.3f} -> {r['sampled_after']:.3f} "
                  f"(p {r['sampled_p']:.2g}), gold win-rate {r['gold_winrate']}", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))
    print(f"# bench/objectives.py, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all")
    print(f"# command: {' '.join(['.venv/bin/python', 'bench/objectives.py', *sys.argv[1:]])}")
    for r in rows:
        print({k: r[k] for k in KEYS})


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
