"""A real pretrained model with LoRA: configs/real.yaml (SmolLM2-135M-Instruct) end to end, and what
LoRA saves against full fine-tuning.

1. The LoRA pipeline, all stages, as a user runs it (`pipeline run configs/real.yaml --json`) in
   `--run-dir`: its wall time, held-out greedy accuracy of the base and the SFT model, PPO's
   held-out sampled accuracy before and after with the paired sign test, and the serve stage's
   smoke load over the OpenAI chat API. The run directory is kept: `pipeline serve
   configs/real.yaml run_dir=DIR` serves its registered model afterwards.
2. The ppo stage for 3 iterations (no held-out evaluation) with LoRA, in the same directory, and
   with full fine-tuning (`policy.lora` / `critic.lora` null) in a directory of its own (a copy of
   the LoRA run's upstream artifacts, cache hits): the peak of the summed proportional set size
   (PSS) of the stage's processes, sampled every 0.5 s: the driver and every PPO role and rollout
   engine actor with their child processes (vLLM's workers). Ray's own daemons are left out: they
   are the same in both.
3. SFT training tokens/s (the mean of rank 0's per-step `tokens_per_s` in MLflow) of the LoRA run
   against a full fine-tuning SFT of the same steps and data in the full-fine-tuning directory.
4. GRPO (`stages.ppo.algorithm=grpo`, everything else as configured) from the same SFT model, in a
   directory of its own (a copy of the LoRA run's upstream artifacts): its held-out sampled
   accuracy before and after, with the paired sign test, and the ppo stage's wall time.

The JSON is rewritten after each part, so an interrupted bench keeps what it measured.

    .venv/bin/python bench/real.py --seed 0 --run-dir runs/bench-real --json bench/real.json
    # part 4 again with other GRPO settings, from the kept LoRA run (appends to "grpo_variants"):
    .venv/bin/python bench/real.py --seed 0 --run-dir runs/bench-real --json bench/real.json \
        --grpo-only --grpo-set stages.ppo.rewards.model_weight=0

Run it alone on the machine: memory and speed are the machine's.
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
CONFIG = ROOT / "configs" / "real.yaml"
SHORT_PPO = ["stages.ppo.iterations=3", "stages.ppo.eval_prompts=0", "stages.ppo.checkpoint_every=3"]
FULL_PPO = ["stages.ppo.policy.lora=null", "stages.ppo.critic.lora=null"]
ACTORS = ("ray::PPOWorker", "ray::RolloutEngine")


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def stage_pss_gib(driver: int) -> float:
    """Summed PSS of the driver and of every PPO role / rollout engine actor under it (with their children)."""
    children = _children()
    tree, stack = [], [driver]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack += children.get(pid, [])
    counted, stack = {driver}, [p for p in tree if _cmdline(p).startswith(ACTORS)]
    while stack:
        pid = stack.pop()
        if pid not in counted:
            counted.add(pid)
            stack += children.get(pid, [])
    return sum(_pss_kib(p) for p in counted) / 2**20


def pipeline(run_dir: Path, seed: int, *args: str, sample_memory: bool = False) -> tuple[dict, float, float]:
    """`pipeline run configs/real.yaml ... --json` in a subprocess: (summary, wall seconds, peak stage PSS GiB)."""
    cmd = [sys.executable, "-m", "pipeline", "run", str(CONFIG), "--json", f"seed={seed}", f"run_dir={run_dir}",
           *args]
    print(f"[bench/real] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0, peak = time.time(), 0.0
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: memory is sampled meanwhile
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, text=True)
        while proc.poll() is None:
            if sample_memory:
                peak = max(peak, stage_pss_gib(proc.pid))
            time.sleep(0.5)
        out.seek(0)
        stdout = out.read()
    if proc.returncode != 0:
        raise SystemExit(f"bench/real: `{' '.join(cmd[1:])}` failed (exit {proc.returncode}); see its log above")
    return json.loads(stdout), time.time() - t0, peak


def stage(summary: dict, name: str) -> dict:
    [entry] = [s for s in summary["stages"] if s["name"] == name]
    return entry


def metrics(summary: dict, name: str) -> dict:
    """A stage's metrics, from its artifact's manifest."""
    return json.loads((Path(stage(summary, name)["artifact"]) / "manifest.json").read_text()).get("metrics", {})


def mean_metric(summary: dict, name: str, key: str) -> float:
    """Mean of a stage run's per-step metric in MLflow (the run's own tracking store)."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(summary["tracking_uri"]).get_metric_history(stage(summary, name)["mlflow_run_id"], key)
    steps = {m.step: m.value for m in history}
    return sum(steps.values()) / max(len(steps), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "bench-real",
                        help="the LoRA pipeline's run directory (kept, to serve its model afterwards)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--grpo-only", action="store_true",
                        help="run part 4 alone, from the LoRA run already in --run-dir, and add its figures to --json")
    parser.add_argument("--grpo-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for part 4 besides stages.ppo.algorithm=grpo")
    args = parser.parse_args()
    run_dir = args.run_dir.absolute()
    full_dir = run_dir.with_name(run_dir.name + "-full")

    def write(figures: dict) -> None:
        text = json.dumps(figures, indent=2)
        print(text, flush=True)
        if args.json:
            args.json.write_text(text + "\n")

    if args.grpo_only:
        figures = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
        figures.setdefault("grpo_variants", []).append(grpo(run_dir, args.seed, args.grpo_set))
        write(figures)
        return

    # 1. The LoRA pipeline, every stage.
    summary, wall, _ = pipeline(run_dir, args.seed)
    sft, ppo, serve = metrics(summary, "sft"), metrics(summary, "ppo"), metrics(summary, "serve")
    figures = {
        "seed": args.seed, "eval_prompts": ppo.get("eval_prompts"), "sft_accuracy_prompts": sft.get("accuracy_prompts"),
        "base_greedy": sft.get("base_accuracy"), "sft_greedy": sft.get("accuracy"),
        **sampled(ppo), "greedy_before": ppo.get("eval_accuracy_before"), "greedy_after": ppo.get("eval_accuracy"),
        "greedy_p": ppo.get("eval_accuracy_sign_test_p"),
        "wall_s": round(wall, 1),
        "stage_s": {s["name"]: s["duration_s"] for s in summary["stages"]},
        "train_tokens_per_s_lora": round(mean_metric(summary, "sft", "tokens_per_s"), 1),
        "serve": {k: v for k, v in serve.items() if isinstance(v, (int, float))},
        "run_dir": str(run_dir),
    }
    write(figures)
    # 2. Peak memory of a short ppo stage, LoRA then full fine-tuning (its own directory, same upstream).
    _, _, pss_lora = pipeline(run_dir, args.seed, "--only", "ppo", *SHORT_PPO, sample_memory=True)
    copy_upstream(run_dir, full_dir)
    _, _, pss_full = pipeline(full_dir, args.seed, "--only", "ppo", *SHORT_PPO, *FULL_PPO, sample_memory=True)
    figures.update(ppo_peak_rss_gb_lora=round(pss_lora, 2), ppo_peak_rss_gb_full=round(pss_full, 2))
    write(figures)
    # 3. SFT tokens/s: the LoRA run's against full fine-tuning on the same steps and data.
    full_sft, _, _ = pipeline(full_dir, args.seed, "--only", "sft", "stages.sft.lora=null")
    figures["train_tokens_per_s_full"] = round(mean_metric(full_sft, "sft", "tokens_per_s"), 1)
    write(figures)
    # 4. GRPO from the same SFT model and reward model.
    figures["grpo"] = grpo(run_dir, args.seed, args.grpo_set)
    write(figures)


def grpo(run_dir: Path, seed: int, overrides: list[str]) -> dict:
    """Part 4: the ppo stage with `algorithm: grpo` (and `overrides`) from the LoRA run's SFT and reward
    models, in a directory of its own: held-out sampled accuracy before/after with the sign test."""
    grpo_dir = run_dir.with_name(run_dir.name + "-grpo")
    copy_upstream(run_dir, grpo_dir)
    # --to, not --only: upstream stages are cache hits from the copy, or rerun if the code has changed since
    summary, _, _ = pipeline(grpo_dir, seed, "--to", "ppo", "stages.ppo.algorithm=grpo", *overrides)
    return {"overrides": overrides, **sampled(metrics(summary, "ppo")), "ppo_s": stage(summary, "ppo")["duration_s"]}


def sampled(ppo: dict) -> dict:
    """PPO's (or GRPO's) held-out sampled accuracy before and after, with the sign test's split and p."""
    return {"sampled_before": ppo.get("eval_sampled_accuracy_before"),
            "sampled_after": ppo.get("eval_sampled_accuracy"),
            "sampled_up": ppo.get("eval_sampled_accuracy_improved"),
            "sampled_down": ppo.get("eval_sampled_accuracy_worsened"),
            "sampled_p": ppo.get("eval_sampled_accuracy_sign_test_p")}


def copy_upstream(run_dir: Path, other: Path) -> None:
    """A fresh directory holding the LoRA run's artifacts: its upstream stages are cache hits there."""
    shutil.rmtree(other, ignore_errors=True)
    shutil.copytree(run_dir / "artifacts", other / "artifacts")


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
