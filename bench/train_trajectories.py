"""Every per-step metric of the Train stages (sft, reward, dpo), for comparing two versions of their loop.

Runs the smoke config's model, data, sft, reward and a dpo stage (precomputed reference, and a second one with
KTO on the same pairs and LoRA with the adapter-off reference) in a fresh run directory with the checkout
given by `--code` (default: this one), then writes {stage: {metric: [[step, value], ...]}} from the stages'
MLflow runs; timings (`*_s`, `tokens_per_s`, start-up) are left out. A second invocation with `--compare`
says whether two such files agree:

    .venv/bin/python bench/train_trajectories.py --code /path/to/old/checkout --json /tmp/before.json
    .venv/bin/python bench/train_trajectories.py --json /tmp/after.json --compare /tmp/before.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = ("_s", "tokens_per_s", "startup", "memory", "rss", "peak")
RUNS = {  # name: overrides on configs/smoke.yaml
    # sft and reward as the test suite's shared command-line run trains them (tests/conftest.py TRAINED: the
    # reward model's LM loss on), so tests/test_train_loop.py checks that run against these figures
    "main": ["stages.sft.checkpoint_every=3", "stages.reward.lm_loss_weight=1.0", "stages.ppo=null",
             "stages.serve=null", "stages.dpo={max_steps: 8, batch_size: 8, micro_batch_size: 2, eval_every: 4, "
             "checkpoint_every: 4, eval_prompts: 0, num_workers: 2}"],
    "kto-lora": ["stages.ppo=null", "stages.serve=null", "stages.sft=null", "stages.reward=null",
                 "stages.dpo={loss: kto, init_from: base, max_steps: 6, batch_size: 8, micro_batch_size: 2, "
                 "eval_every: 3, checkpoint_every: 3, eval_prompts: 0, num_workers: 2, lora: {r: 4}}"],
}


def histories(tracking_uri: str) -> dict[str, dict[str, list]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    out: dict[str, dict[str, list]] = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            stage = run.data.tags.get("stage") or run.info.run_name
            if stage not in ("sft", "reward", "dpo"):
                continue
            metrics = {}
            for key in sorted(run.data.metrics):
                if any(t in key for t in TIMINGS):
                    continue
                metrics[key] = sorted([m.step, m.value] for m in client.get_metric_history(run.info.run_id, key))
            out[stage] = metrics
    return out


def record(code: Path) -> dict:
    result = {}
    for name, overrides in RUNS.items():
        with tempfile.TemporaryDirectory() as tmp:
            uri = f"sqlite:///{tmp}/mlflow.db"
            cmd = [sys.executable, "-m", "pipeline", "run", str(ROOT / "configs" / "smoke.yaml"), f"run_dir={tmp}/run",
                   f"mlflow.tracking_uri={uri}", *overrides]
            print(f"[{name}] {' '.join(cmd[1:])} (code: {code})", file=sys.stderr, flush=True)
            subprocess.run(cmd, cwd=code, check=True, stdout=subprocess.DEVNULL)
            result[name] = histories(uri)
    return result


def differences(a: dict, b: dict, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in {'the first' if k in a else 'the second'}" for k in sorted(set(a) ^ set(b))]
        return out + [d for k in sorted(set(a) & set(b)) for d in differences(a[k], b[k], f"{path}/{k}")]
    return [] if a == b else [f"{path}: {a} != {b}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose stages run (default: this one)")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--compare", type=Path, help="a file an earlier invocation wrote: exit 1 unless they agree exactly")
    args = ap.parse_args()
    result = record(args.code)
    args.json.write_text(json.dumps(result, indent=1))
    n = sum(len(v) for stages in result.values() for m in stages.values() for v in m.values())
    print(f"{n} metric points of {sum(len(s) for s in result.values())} stage runs -> {args.json}")
    if args.compare:
        diff = differences(json.loads(args.compare.read_text()), result)
        print("identical" if not diff else "\n".join(["DIFFERENT:", *diff[:40]]))
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
