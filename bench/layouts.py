"""The default's ppo stage in each layout (`stages.ppo.layout`): separate against colocated, in one invocation.

    .venv/bin/python bench/layouts.py --json bench/layouts.json
    .venv/bin/python bench/layouts.py --iterations 5 --repeats 2   # shorter, A B A B

Issue 60 asks the default to use whichever layout its measurements favour. Per repeat, each layout runs the
whole ppo stage as configs/full.yaml configures it (`pipeline run configs/full.yaml --only ppo --force ppo`),
alternating A B A B so that the machine's drift falls on both; only the layout and the roles' rank counts it
implies change (colocated: every role on the policy's ranks, one engine per rank). Upstream artifacts (model,
data, SFT, reward model) are prepared once, untimed and cached (bench/startup.py's run directory layout).

Per layout it prints: the stage's wall time (median over repeats), its start-up and processes, the mean of each
iteration phase (generate, score, train, sync; from the stage's MLflow metrics), and what the run learned
(held-out accuracy before -> after, gold win-rate against the SFT policy), and the ratio of the wall times of
the same repeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import DEFAULT, LAYOUTS, ROOT, finish, pipeline  # noqa: E402  (bench/startup.py)

PHASES = ("iteration_s", "generate_s", "score_s", "train_s", "sync_s")
LEARNED = ("eval_accuracy_before", "eval_accuracy", "gold_winrate", "gold_winrate_p", "reward_mean")


def run(layout: str, run_dir: Path, extra: list[str]) -> dict:
    """One forced ppo run in `layout`; its wall time, start-up and, from MLflow, its phases and outcomes."""
    from mlflow.tracking import MlflowClient

    summary = pipeline(DEFAULT, run_dir, "--only", "ppo", "--force", "ppo", *LAYOUTS[layout], *extra)
    entry = next(s for s in summary["stages"] if s["name"] == "ppo")
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = entry["mlflow_run_id"]
    metrics = client.get_run(run_id).data.metrics
    phases = {k: statistics.fmean(m.value for m in client.get_metric_history(run_id, k)) for k in PHASES}
    return {"layout": layout, "wall_s": entry["duration_s"], "startup_s": metrics.get("startup_s"),
            "processes": int(metrics.get("startup_processes", 0)), **phases,
            **{k: metrics[k] for k in LEARNED if k in metrics}}


def table(rows: dict[str, list[dict]]) -> str:
    lines = ["| layout | processes | stage wall s | start-up s | iteration s | gen | score | train | sync | "
             "accuracy before -> after | gold win-rate |", "| --- " * 11 + "|"]
    for layout, runs in rows.items():
        m = {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in ("wall_s", "startup_s", *PHASES)}
        last = runs[-1]
        lines.append(f"| {layout} | {last['processes']} | **{m['wall_s']:.0f}** | {m['startup_s']:.1f} | "
                     f"{m['iteration_s']:.2f} | {m['generate_s']:.2f} | {m['score_s']:.2f} | {m['train_s']:.2f} | "
                     f"{m['sync_s']:.3f} | {last.get('eval_accuracy_before', float('nan')):.3f} -> "
                     f"{last.get('eval_accuracy', float('nan')):.3f} | {last.get('gold_winrate', float('nan')):.3f} "
                     f"(p {last.get('gold_winrate_p', float('nan')):.2g}) |")
    a, b = rows.values()
    ratios = [x["wall_s"] / y["wall_s"] for x, y in zip(a, b)]
    lines.append(f"\nwall time separate / colocated, per repeat: {', '.join(f'{r:.2f}x' for r in ratios)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--iterations", type=int, help="ppo iterations (default: the config's)")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "bench-layouts")
    ap.add_argument("--json", type=Path, help="write the runs here")
    args = ap.parse_args()

    t0 = time.time()
    extra = [f"stages.ppo.iterations={args.iterations}"] if args.iterations else []
    pipeline(DEFAULT, args.run_dir, "--to", "reward")  # upstream as the default trains it (cached)
    rows: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    for _ in range(args.repeats):
        for layout in LAYOUTS:
            rows[layout].append(run(layout, args.run_dir, extra))
            print(f"{layout}: {rows[layout][-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    finish(t0, table(rows), rows, args.json)


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
