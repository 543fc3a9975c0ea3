"""Does on-policy distillation bring the SFT student to its teacher, and faster than GRPO from the same start?

The default (`configs/full.yaml`: the embedded task with the gold preference), per seed, in one run directory
per seed, `runs/bench-rl/seed<N>` (model, data, SFT and reward model shared by the three runs of a seed, and
with bench/objectives.py, whose grpo run is this one's):
  1. teacher: the default's own RL stage (PPO on the reward model and the verifier); its policy is the teacher
     (the issue's "RL-trained policy": same architecture and tokenizer). `--teacher-overrides` changes the
     teacher's run only (e.g. `stages.sft.epochs=9`: a longer SFT before the same RL, a stronger teacher with
     the same tokenizer); the students still start from the config's SFT policy.
  2. distill: the ppo stage again from the same SFT policy, `algorithm: grpo` with only the teacher's per-token
     reward (`stages.ppo.distill.teacher`, no verifier, no reward model), `--iterations` iterations.
  3. grpo: the ppo stage from the same SFT policy, `algorithm: grpo` on the default's rewards, same iterations.
  4. grpo+distill (only with `--methods`): grpo's rewards and the teacher's per-token term together.
Per run, from the ppo stage's manifest: every held-out prompt's sampled accuracy before (the SFT policy) and
after, with the paired sign test; the gold win-rate against the SFT policy's answers and its sign test; the
stage's minutes. Rows carry `seed`, `method`, `eval_prompts`, `sampled_before`, `sampled_after`, `sampled_p`,
`gold_winrate`, `gold_winrate_p`, `minutes`, `wall_s`, and `train_minutes`: from the held-out curve's first
point (iteration 0, before any update) to its last (the last iteration), from the points' MLflow timestamps,
so the stage's start-up and its two full held-out evaluations are left out. Accuracy per training minute is
(sampled_after - sampled_before) / train_minutes. `--plot`: the curve's held-out sampled accuracy
(`curve_prompts` prompts x 4 samples, every 5 iterations) against training minutes, distill and grpo, per seed.

    .venv/bin/python bench/distill.py --seeds 0 1 2 --json bench/distill.json --plot docs/images/distill.png
    .venv/bin/python bench/distill.py --seeds 0 1 2 --teacher-overrides stages.sft.epochs=9 \
        --json bench/distill_strong.json --plot docs/images/distill_strong.png      # the stronger teacher
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
        "gold_winrate_p", "minutes", "wall_s", "train_minutes")
# The distill and grpo runs: a held-out curve point every 5 iterations on 256 prompts (bench/objectives.py's too).
SAME = ["stages.ppo.eval_every=5", "stages.ppo.curve_prompts=256"]


def plot(rows: list[dict], path: Path) -> None:
    """Held-out sampled accuracy against training minutes: distill (solid) and grpo (dashed), one colour a seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    seeds = sorted({r["seed"] for r in rows})
    for r in rows:
        if r["method"] in ("distill", "grpo") and r["curve"]:
            x, y = zip(*r["curve"])
            ax.plot(x, y, "o-" if r["method"] == "distill" else "s--", color=f"C{seeds.index(r['seed'])}",
                    label=f"seed {r['seed']} {r['method']}", markersize=3)
    ax.set_xlabel("training minutes (from iteration 0)")
    ax.set_ylabel("held-out sampled accuracy (curve prompts)")
    ax.set_title("on-policy distillation vs GRPO from the same SFT policy")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curve(summary: dict, entry: dict) -> list[tuple[float, float]]:
    """The held-out curve's (training minutes, sampled accuracy) points of a ppo stage's MLflow run."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(summary["tracking_uri"]).get_metric_history(entry["mlflow_run_id"], "heldout_accuracy")
    points = sorted((m.step, m.timestamp, m.value) for m in history)
    return [((t - points[0][1]) / 60000, v) for _, t, v in points]


def row(seed: int, method: str, summary: dict) -> dict:
    rl, entry = manifest_metrics(summary, "ppo")
    wall = entry["duration_s"] if entry["status"] == "miss" else None
    points = curve(summary, entry) if entry.get("mlflow_run_id") else []
    return {"train_minutes": points[-1][0] if points else None, "curve": points, "seed": seed, "method": method,
            "eval_prompts": int(rl["eval_prompts"]),
            "sampled_before": rl["eval_sampled_accuracy_before"], "sampled_after": rl["eval_sampled_accuracy"],
            "sampled_p": rl["eval_sampled_accuracy_sign_test_p"], "gold_winrate": rl.get("gold_winrate"),
            "gold_winrate_p": rl.get("gold_winrate_p"), "minutes": wall / 60 if wall else None, "wall_s": wall,
            "reverse_kl_last": rl.get("distill_reverse_kl"), "artifact": entry["artifact"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "full.yaml")
    ap.add_argument("--methods", nargs="+", default=["distill", "grpo"], choices=["distill", "grpo", "grpo+distill"],
                    help="the runs after the teacher's (its row is printed every time; a cached run's minutes "
                         "are empty)")
    ap.add_argument("--iterations", type=int, default=30, help="ppo iterations of the distill and grpo runs")
    ap.add_argument("--teacher-overrides", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides of the teacher's run only, e.g. stages.sft.epochs=9: a stronger teacher "
                         "(its own sft, reward and ppo artifacts in the same run directory; the students keep "
                         "the config's SFT policy)")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-rl")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="the accuracy-per-training-minute plot (PNG)")
    args = ap.parse_args()

    rows, t0 = [], time.time()
    teacher_of = {"teacher_overrides": args.teacher_overrides}  # every row says which teacher it had
    for seed in args.seeds:
        run_dir = args.runs / f"seed{seed}"
        teacher_run = run_pipeline(args.config, run_dir, seed, None, args.teacher_overrides)
        rows.append(row(seed, "teacher", teacher_run) | teacher_of)
        teacher = Path(rows[-1]["artifact"]) / "model"
        same = [*SAME, f"stages.ppo.iterations={args.iterations}"]
        methods = {
            "distill": ["stages.ppo.algorithm=grpo", f"stages.ppo.distill.teacher={teacher}",
                        "stages.ppo.rewards.rule_weight=0", "stages.ppo.rewards.model_weight=0", *same],
            "grpo": ["stages.ppo.algorithm=grpo", *same],
            # the teacher added to GRPO's own rewards (verifier and reward model): distillation mixed in
            "grpo+distill": ["stages.ppo.algorithm=grpo", f"stages.ppo.distill.teacher={teacher}", *same],
        }
        for method in args.methods:
            overrides = methods[method]
            rows.append(row(seed, method, run_pipeline(args.config, run_dir, seed, None, overrides)) | teacher_of)
            r = rows[-1]
            print(f"[seed {seed} {method}] sampled {r['sampled_before']:.3f} -> {r['sampled_after']:.3f} "
                  f"(p {r['sampled_p']:.2g}), gold win-rate {r['gold_winrate']}", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)
    print(f"# bench/distill.py, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all")
    print(f"# command: {' '.join(['.venv/bin/python', 'bench/distill.py', *sys.argv[1:]])}")
    for r in rows:
        gain = (r["sampled_after"] - r["sampled_before"]) / r["train_minutes"] if r["train_minutes"] else None
        print({k: r[k] for k in KEYS} | {"accuracy_per_train_minute": gain})


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
