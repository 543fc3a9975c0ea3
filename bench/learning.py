"""Does RL reliably make the model better on the verifier? The embedded task, per seed and algorithm.

`--config` defaults to `configs/recipes/verifier.yaml` (RL on the verifier alone: the embedded default
up to 2026-11-28, on which bench/RESULTS.md's learning tables were measured); `bench/rlhf.py` measures
the RLHF path that `configs/full.yaml` now takes (the gold win-rate as well as the accuracy).

For each seed the whole pipeline of `--config` runs up to the RL stage (model, data, SFT and reward
model are shared by the algorithms of a seed, in one run directory per seed); then the RL stage
once per algorithm, with only `stages.ppo.algorithm` changed. Every held-out prompt is scored
before RL (the SFT policy) and after: greedy accuracy, and sampled accuracy (k samples per
prompt at T=1, the same random stream before and after), with a paired two-sided sign test over
prompts. One table per run, every seed, plus the mean; nothing is picked.

    .venv/bin/python bench/learning.py --seeds 0 1 2 --algorithms ppo grpo
    .venv/bin/python bench/learning.py --seeds 0 --algorithms rloo reinforce_pp dr_grpo --json out.json

Runs are cached like any pipeline run: a second invocation with the same seeds reuses what is
there (pass --fresh to start from empty run directories). Extra `key=value` arguments are
config overrides applied to every run (e.g. `stages.ppo.tis.enabled=true`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "dr_grpo")
KEYS = ("seed", "algorithm", "eval_prompts", "greedy_before", "greedy_after", "sampled_before", "sampled_after",
        "sampled_up", "sampled_down", "sampled_p", "rm_accuracy", "kl_max", "wall_s")


def used_memory_gib() -> float:
    """The machine's memory in use (MemTotal - MemAvailable), GiB: Ray's workers, engines and object store
    are separate processes, so one process's peak RSS would miss most of a run."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kib = lambda k: int(info[k].split()[0])  # noqa: E731
    return (kib("MemTotal") - kib("MemAvailable")) / 2**20


def run_pipeline(config: Path, run_dir: Path, seed: int, algorithm: str | None, overrides: list[str],
                 to: str = "ppo") -> dict:
    """One `pipeline run --to <to> --json` in a subprocess (as a user runs it); its JSON summary, plus the
    invocation's wall time and the peak of the machine's used memory above what was in use before it.
    `algorithm`: PPO's (None: the config's, or no ppo stage)."""
    cmd = [sys.executable, "-m", "pipeline", "run", str(config), "--to", to, "--json", f"seed={seed}",
           f"run_dir={run_dir}", *([f"stages.ppo.algorithm={algorithm}"] if algorithm else []), *overrides]
    print(f"[seed {seed} {algorithm or to}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0, before = time.time(), used_memory_gib()
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: the loop below samples memory meanwhile
        proc, peak = subprocess.Popen(cmd, cwd=ROOT, stdout=out, text=True), before
        while proc.poll() is None:
            peak = max(peak, used_memory_gib())
            time.sleep(0.5)
        out.seek(0)
        stdout = out.read()
    try:
        summary = json.loads(stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"seed {seed} {algorithm}: the pipeline printed no JSON summary (exit {proc.returncode})")
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} {algorithm}: the pipeline failed (exit {proc.returncode}): "
                         f"{summary.get('error')}")
    summary["invocation_s"], summary["peak_mem_gib"] = time.time() - t0, peak - before
    return summary


def manifest_metrics(summary: dict, stage: str) -> dict:
    entry = next(s for s in summary["stages"] if s["name"] == stage)
    return json.loads((Path(entry["artifact"]) / "manifest.json").read_text())["metrics"], entry


def row(seed: int, algorithm: str, summary: dict) -> dict:
    rl, entry = manifest_metrics(summary, "ppo")
    rm, _ = manifest_metrics(summary, "reward")
    sft, _ = manifest_metrics(summary, "sft")
    return {
        "seed": seed, "algorithm": algorithm, "eval_prompts": int(rl["eval_prompts"]),
        "greedy_before": rl["eval_accuracy_before"], "greedy_after": rl["eval_accuracy"],
        "sampled_before": rl["eval_sampled_accuracy_before"], "sampled_after": rl["eval_sampled_accuracy"],
        "sampled_up": int(rl["eval_sampled_accuracy_improved"]),
        "sampled_down": int(rl["eval_sampled_accuracy_worsened"]),
        "sampled_p": rl["eval_sampled_accuracy_sign_test_p"], "rm_accuracy": rm["eval_accuracy"],
        "kl_max": rl["kl_max"], "wall_s": entry["duration_s"] if entry["status"] == "miss" else None,
        # beyond the required keys: the greedy test, the training curve and the SFT stage's own score
        "greedy_up": int(rl["eval_accuracy_improved"]), "greedy_down": int(rl["eval_accuracy_worsened"]),
        "greedy_p": rl["eval_accuracy_sign_test_p"], "reward_slope": rl["reward_slope"],
        "sft_accuracy": sft.get("accuracy"), "cached": entry["status"] == "hit",
        "invocation_s": summary["invocation_s"], "peak_mem_gib": summary["peak_mem_gib"],
    }


def fmt(x, nd=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2g}" if abs(x) < 0.01 and x else f"{x:.{nd}f}"
    return str(x)


def table(rows: list[dict]) -> str:
    head = ("| seed | algorithm | eval prompts | greedy SFT → RL | sampled SFT → RL | sampled up / down | sign p "
            "| greedy up / down | RM acc | reward slope /iter | KL max | RL wall s | run s | peak mem GiB |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['algorithm']} | {r['eval_prompts']} | {fmt(r['greedy_before'])} → "
                     f"{fmt(r['greedy_after'])} | {fmt(r['sampled_before'])} → {fmt(r['sampled_after'])} | "
                     f"{r['sampled_up']} / {r['sampled_down']} | {fmt(r['sampled_p'], 2)} | "
                     f"{r['greedy_up']} / {r['greedy_down']} | {fmt(r['rm_accuracy'])} | {fmt(r['reward_slope'], 4)} | "
                     f"{fmt(r['kl_max'], 2)} | {fmt(r['wall_s'], 0)} | {fmt(r['invocation_s'], 0)} | "
                     f"{fmt(r['peak_mem_gib'], 1)} |")
    for alg in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == alg]
        if len(mine) < 2:
            continue
        mean = lambda k: sum(r[k] for r in mine) / len(mine)  # noqa: E731
        lines.append(f"| mean | {alg} | {fmt(mean('eval_prompts'), 0)} | {fmt(mean('greedy_before'))} → "
                     f"{fmt(mean('greedy_after'))} | {fmt(mean('sampled_before'))} → {fmt(mean('sampled_after'))} | "
                     f"{fmt(mean('sampled_up'), 1)} / {fmt(mean('sampled_down'), 1)} | | "
                     f"{fmt(mean('greedy_up'), 1)} / {fmt(mean('greedy_down'), 1)} | {fmt(mean('rm_accuracy'))} | "
                     f"{fmt(mean('reward_slope'), 4)} | {fmt(mean('kl_max'), 2)} | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algorithms", nargs="+", default=["ppo", "grpo"], choices=ALGORITHMS)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "recipes" / "verifier.yaml")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-learning",
                    help="one run directory per seed is made under it")
    ap.add_argument("--fresh", action="store_true", help="delete each seed's run directory first")
    ap.add_argument("--json", type=Path, help="also write the rows as a JSON list here")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = ap.parse_args()

    rows = []
    t0 = time.time()
    for seed in args.seeds:
        run_dir = args.runs / f"seed{seed}"
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        for alg in args.algorithms:
            summary = run_pipeline(args.config, run_dir, seed, alg, args.overrides)
            rows.append(row(seed, alg, summary))
            r = rows[-1]
            print(f"[seed {seed} {alg}] {summary['invocation_s']:.0f} s: sampled {r['sampled_before']:.3f} -> "
                  f"{r['sampled_after']:.3f} (p {r['sampled_p']:.2g}), greedy {r['greedy_before']:.3f} -> "
                  f"{r['greedy_after']:.3f}", file=sys.stderr, flush=True)
            if args.json:  # written as it goes: a long bench that is stopped keeps its finished rows
                args.json.write_text(json.dumps(rows, indent=2))
    print(f"# bench/learning.py, {time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all")
    print(f"# command: {' '.join(['.venv/bin/python', 'bench/learning.py', *sys.argv[1:]])}")
    print(table(rows))


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
