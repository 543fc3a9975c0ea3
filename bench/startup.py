"""Start-up of the default's data stage and each training stage (and the DPO recipe's dpo stage), and where it goes.

    .venv/bin/python bench/startup.py --json bench/startup.json
    .venv/bin/python bench/startup.py --stages ppo --repeats 3      # one stage, median of 3
    .venv/bin/python bench/startup.py --stages ppo-separate ppo-colocated   # ppo in each layout

Start-up is a stage's fixed cost: from the moment its `run()` begins to its first optimizer step
(sft, reward, dpo), its first iteration (ppo) or its first tokenized row (data), held-out evaluations
before it not counted (they scale with the prompts a config asks for). The data stage runs whole. Every stage
measures it itself (`pipeline.events.StartupClock`) and records it in its manifest and MLflow run (`startup_s`,
`startup_<part>_s`); this script runs the stages and reads those figures back.

1. Prepare, untimed and cached like any run, in `--run-dir`: the default's model, data, a short SFT
   and reward model (`max_steps=2`: start-up does not depend on the weights' values), and the DPO
   recipe's SFT model. Warm caches: the upstream artifacts, DeepSpeed's built ops, the page cache.
2. Per stage and repeat: `pipeline run CONFIG --only STAGE --force STAGE --json` with the stage's
   own settings as the config ships them (workers, ZeRO, roles, engines) and only its length cut
   (3 optimizer steps, 1 PPO iteration, no held-out evaluation), each in a fresh process (so Ray starts
   inside the stage: the `ray` part; in a whole `pipeline run` only the first stage pays it).

Per stage it prints and (`--json PATH`) writes: `stage`, `startup_s` (median over repeats),
`parts` (part -> seconds, of the median run), `details` (inside the parts, e.g. the slowest policy
rank's imports; these overlap), `processes` (processes the stage started), `wall_s` (the stage's
whole time in that run), `runs` (every repeat's `startup_s`), `config`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "configs" / "full.yaml"
DPO = ROOT / "configs" / "recipes" / "dpo.yaml"

# What each stage's measured run changes: its length only.
SHORT = {
    "sft": ["stages.sft.max_steps=3", "stages.sft.accuracy_prompts=0"],
    "reward": ["stages.reward.max_steps=3"],
    "ppo": ["stages.ppo.iterations=1", "stages.ppo.eval_prompts=0", "stages.ppo.checkpoint_every=1"],
    "dpo": ["stages.dpo.max_steps=3", "stages.dpo.eval_prompts=0"],
    "data": [],  # the whole stage: its start-up is what passes before tokenizing begins
}
# ppo in each layout (stages.ppo.layout), whatever configs/full.yaml ships: `ppo` alone is the config as it is.
LAYOUTS = {"ppo-separate": ["stages.ppo.layout=separate", "stages.ppo.critic.num_ranks=1",
                            "stages.ppo.reward.num_ranks=1"],
           "ppo-colocated": ["stages.ppo.layout=colocated", "stages.ppo.critic.num_ranks=2",
                             "stages.ppo.reward.num_ranks=2"]}
SHORT |= {name: SHORT["ppo"] + overrides for name, overrides in LAYOUTS.items()}
# Upstream of the measured stages, short (untimed).
PREPARE = ["stages.sft.max_steps=2", "stages.sft.accuracy_prompts=0", "stages.reward.max_steps=2"]
CONFIG = {"sft": DEFAULT, "reward": DEFAULT, "ppo": DEFAULT, "dpo": DPO, "data": DEFAULT}
CONFIG |= dict.fromkeys(LAYOUTS, DEFAULT)


def pipeline(config: Path, run_dir: Path, *args: str) -> dict:
    """`pipeline run` in a subprocess; its --json summary (exits on failure, naming the command)."""
    cmd = [sys.executable, "-m", "pipeline", "run", str(config), *args, f"run_dir={run_dir}", "--json"]
    print("$ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        summary = json.loads(out.stdout)
    except ValueError:
        raise SystemExit(f"no --json summary from: {' '.join(cmd)} (exit {out.returncode})") from None
    if out.returncode:
        raise SystemExit(f"failed (exit {out.returncode}): {' '.join(cmd)}: {summary.get('error')}")
    return summary


def measure(stage: str, run_dir: Path) -> dict:
    """One forced run of `stage` (ppo-separate, ppo-colocated: ppo in that layout); its start-up figures from
    the manifest it wrote."""
    name = stage.split("-")[0]
    summary = pipeline(CONFIG[stage], run_dir, "--only", name, "--force", name, *PREPARE, *SHORT[stage])
    entry = next(s for s in summary["stages"] if s["name"] == name)
    metrics = json.loads((Path(entry["artifact"]) / "manifest.json").read_text())["metrics"]
    if "startup_s" not in metrics and stage != "data":
        raise SystemExit(f"{stage}: its manifest has no startup_s (a stage that does not measure its start-up)")
    if "startup_s" not in metrics:  # a data stage from before it measured its start-up: its whole time only
        return {"stage": stage, "startup_s": float("nan"), "parts": {}, "details": {}, "processes": 0,
                "wall_s": entry["duration_s"], "config": str(CONFIG[stage].relative_to(ROOT))}
    clock = {k.removeprefix("startup_").removesuffix("_s"): v for k, v in metrics.items()
             if k.startswith("startup_") and k not in ("startup_s", "startup_processes")}
    parts_order = ("driver", "ray", "read", "count", "dedupe", "workers", "imports", "model", "deepspeed", "reference",
                   "restore", "roles",
                   "engines", "data", "evaluation", "reference_precompute")
    parts = {k: clock[k] for k in parts_order if k in clock}
    details = {k: v for k, v in clock.items() if k not in parts}
    return {"stage": stage, "startup_s": metrics["startup_s"], "parts": parts, "details": details,
            "processes": int(metrics.get("startup_processes", 0)), "wall_s": entry["duration_s"],
            "config": str(CONFIG[stage].relative_to(ROOT))}


def table(rows: list[dict]) -> str:
    lines = ["| stage | processes | start-up s | parts (s) | stage wall s |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["parts"].items())
        lines.append(f"| {r['stage']} | {r['processes']} | **{r['startup_s']:.1f}** | {parts} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def finish(t0: float, text: str, rows, path: Path | None) -> None:
    """A bench's close: the date, its wall time and command line, its table, and its rows as JSON at `path`."""
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - t0:.0f} s: "
          f"{' '.join(sys.argv)}\n")
    print(text)
    if path:
        path.write_text(json.dumps(rows, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", nargs="+", default=["data", "sft", "reward", "ppo", "dpo"], choices=sorted(SHORT))
    ap.add_argument("--repeats", type=int, default=1, help="runs per stage; the median's figures are reported")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "bench-startup")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()

    t0 = time.time()
    if {"sft", "reward", "ppo", "data", *LAYOUTS} & set(args.stages):
        pipeline(DEFAULT, args.run_dir / "default", "--to", "reward", *PREPARE)
    if "dpo" in args.stages:
        pipeline(DPO, args.run_dir / "dpo", "--to", "sft", *PREPARE)
    rows = []
    for stage in args.stages:
        run_dir = args.run_dir / ("dpo" if CONFIG[stage] == DPO else "default")
        runs = [measure(stage, run_dir) for _ in range(args.repeats)]
        median = sorted(runs, key=lambda r: r["startup_s"])[(len(runs) - 1) // 2]
        rows.append({**median, "runs": [r["startup_s"] for r in runs],
                     "startup_median_s": statistics.median(r["startup_s"] for r in runs)})
        print(f"{stage}: start-up {median['startup_s']:.1f}s "
              f"({', '.join(f'{k} {v:.1f}s' for k, v in median['parts'].items())})", file=sys.stderr, flush=True)
    finish(t0, table(rows), rows, args.json)


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
