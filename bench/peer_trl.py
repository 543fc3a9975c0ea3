"""The same GRPO job with this pipeline and with TRL's `GRPOTrainer`, side by side, in one invocation.

    .venv/bin/python bench/peer_trl.py --json bench/peer_trl.json
    .venv/bin/python bench/peer_trl.py --sizes default            # the embedded model only (~5 min)
    .venv/bin/python bench/peer_trl.py --ours-set stages.ppo.rollout.async=false   # a lever off

Per model size:

1. Prepare (cached like any pipeline run, in `--run-dir/<size>`): `pipeline run configs/recipes/verifier.yaml
   --to reward` builds the model, the task data, the SFT model (and the reward model the ppo
   stage takes as an input; with `rewards.model_weight: 0` it is not loaded). `default` is the
   embedded model as `configs/recipes/verifier.yaml` trains it (the default up to 2026-11-28, on
   which bench/RESULTS.md's figures were measured; the job's reward is the verifier on both
   sides); `30m` is a ~30M-parameter LLaMA of the same family given a short SFT (`--sft-steps`).
2. Ours: `pipeline run ... --only ppo --force ppo` with `algorithm: grpo` and the job's settings
   (below), held-out evaluation off, in a subprocess.
3. TRL: `GRPOTrainer` (HF `generate`, one process, 2 torch threads, as a user runs it on one
   machine) on the same SFT model directory, the same training prompts (token ids checked equal
   to ours) and the same reward (the task verifier), in a subprocess.

The job: `--steps` steps of 32 prompts x 4 samples, T=1, top-p 1, `--new-tokens` (16 on the
default, 64 at 30M), one optimizer step per batch (128 rollouts, micro-batches of 16), lr 3e-4
constant, AdamW, grad clip 1, KL to the reference in the loss (k3, coefficient 0.02), clip 0.2,
advantages normalised by the group's std, token-mean loss (TRL `loss_type="dapo"`).

Measured the same way for both, from the subprocess's launch by this script:
- `startup_s`: until the first step begins (imports, Ray, model loading, engines, trainer);
- `per_step_s`: median over steps 2..N of the time between consecutive step ends;
- `wall_s`: until the process exits (the trained model saved);
- `reward_first` / `reward_last`: mean training reward (verifier, 0-1) of the first / last 5 steps.
Ours are read back from the ppo stage's MLflow metrics (each iteration's end time and length);
TRL's from a `TrainerCallback`.

`--json PATH` writes a list with one object per size (the default first): `size`, `params`, and
`ours` / `trl`, each with the keys above. `--repeats R` runs the two sides R times, alternating,
and reports the medians, with every run under `runs`: the machine's speed drifts by 10-40%
between invocations, and one pair can land on either side of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "recipes" / "verifier.yaml"
# ~30M parameters: 10 layers of hidden 512 (GQA, 4 KV heads), MLP 1536.
SIZE_30M = ["model.builtin.hidden_size=512", "model.builtin.intermediate_size=1536", "model.builtin.num_layers=10",
            "model.builtin.num_heads=8", "model.builtin.num_kv_heads=4"]
PROMPTS, SAMPLES, MICRO, LR, KL_COEF = 32, 4, 16, 3e-4, 0.02


def pipeline_cmd(run_dir: Path, size_args: list[str], *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "run", str(CONFIG), *args, f"run_dir={run_dir}", *size_args]


def prepare(run_dir: Path, size: str, sft_steps: int) -> tuple[list[str], Path, Path]:
    """Model, data, SFT (and the reward model the ppo stage reads) for `size`: (its overrides, the SFT
    model's directory, the training prompts' directory)."""
    size_args = [] if size == "default" else SIZE_30M + [
        f"stages.sft.max_steps={sft_steps}", "stages.sft.eval_every=1000", "stages.sft.accuracy_prompts=64",
        "stages.reward.max_steps=2", "stages.reward.eval_every=1000"]
    cmd = pipeline_cmd(run_dir, size_args, "--to", "reward", "--json")
    print(f"[{size}] prepare: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    summary = json.loads(out.stdout)
    if out.returncode:
        raise SystemExit(f"preparing {size} failed (exit {out.returncode}): {summary.get('error')}")
    outputs = {k: Path(v) for s in summary["stages"] for k, v in s["outputs"].items()}
    return size_args, outputs["sft_model"], outputs["prompt_data"] / "train"


def ppo_overrides(steps: int, new_tokens: int) -> list[str]:
    p = "stages.ppo."
    return [f"{p}algorithm=grpo", f"{p}iterations={steps}", f"{p}prompts_per_iteration={PROMPTS}",
            f"{p}sampling.n={SAMPLES}", f"{p}sampling.max_new_tokens={new_tokens}", f"{p}sampling.temperature=1.0",
            f"{p}sampling.top_p=1.0", f"{p}mini_batch_size={PROMPTS * SAMPLES}", f"{p}micro_batch_size={MICRO}",
            f"{p}ppo_epochs=1", f"{p}policy.lr={LR}", f"{p}kl.coef={KL_COEF}", f"{p}kl.controller=fixed",
            f"{p}rewards.model_weight=0", f"{p}rewards.rule_weight=1", f"{p}eval_prompts=0",
            f"{p}checkpoint_every={steps}", f"{p}log_samples=0", f"{p}clip_eps=0.2"]


def summarise(t0: float, step_ends: list[float], first_begin: float, end: float, rewards: list[float]) -> dict:
    gaps = [b - a for a, b in zip(step_ends, step_ends[1:])]  # step i's time = end(i) - end(i-1), i >= 2
    return {"per_step_s": statistics.median(gaps) if gaps else None, "startup_s": first_begin - t0,
            "wall_s": end - t0, "reward_first": statistics.fmean(rewards[:5]),
            "reward_last": statistics.fmean(rewards[-5:]),
            "steps": len(step_ends), "rewards": rewards}


def run_ours(run_dir: Path, size_args: list[str], steps: int, new_tokens: int, extra: list[str]) -> dict:
    from mlflow.tracking import MlflowClient

    cmd = pipeline_cmd(run_dir, size_args, "--only", "ppo", "--force", "ppo", "--json",
                       *ppo_overrides(steps, new_tokens),
                       *extra)
    print(f"  ours: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    end = time.time()
    summary = json.loads(out.stdout)
    if out.returncode:
        raise SystemExit(f"our ppo stage failed (exit {out.returncode}): {summary.get('error')}")
    stage = next(s for s in summary["stages"] if s["name"] == "ppo")
    client = MlflowClient(summary["tracking_uri"])

    def hist(key: str) -> list:  # one value per iteration (the stage logs its final metrics again at the last step)
        return list({m.step: m for m in sorted(client.get_metric_history(stage["mlflow_run_id"], key),
                                               key=lambda m: (m.step, -m.timestamp))}.values())

    iters = hist("iteration_s")
    ends = [m.timestamp / 1000 for m in iters]
    rewards = [m.value for m in hist("rule_reward_mean")]
    result = summarise(t0, ends, ends[0] - iters[0].value, end, rewards)
    phases = {k: statistics.median(m.value for m in hist(k)[1:]) for k in
              ("generate_s", "score_s", "train_s", "sync_s", "iteration_s")}
    result.update(phases={k: round(v, 4) for k, v in phases.items()},
                  stage_startup_s=next((m.value for m in hist("startup_s")), None))
    return result


# --------------------------------------------------------------------------- TRL, in its own process


def trl_worker(spec: dict) -> dict:
    """TRL's GRPOTrainer on the SFT model: the timings the callback saw (epoch seconds)."""
    import torch

    torch.set_num_threads(2)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stages.common.parquet import read_rows
    from stages.common.tasks import verify

    tok = AutoTokenizer.from_pretrained(spec["model"])
    rows = read_rows(Path(spec["prompts"]))
    conv = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    for c, r in list(zip(conv, rows))[:64]:  # TRL renders the chat template itself: it must give our token ids
        ids = tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        if list(ids) != list(r["prompt_ids"]):
            raise SystemExit(f"TRL's prompt tokens differ from the pipeline's for {r['prompt']!r}")
    data = Dataset.from_list([{"prompt": c, "answer": r["answer"]} for c, r in zip(conv, rows)])

    def verifier(prompts, completions, answer, **_):
        return [float(verify(c[0]["content"], a)) for c, a in zip(completions, answer)]

    marks: dict[str, list] = {"begin": [], "end": [], "reward": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks["begin"].append(time.time())

        def on_step_end(self, *a, **k):
            marks["end"].append(time.time())

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "reward" in logs:
                marks["reward"].append(logs["reward"])

    cfg = GRPOConfig(
        output_dir=spec["out"], max_steps=spec["steps"], per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO, num_generations=SAMPLES,
        max_completion_length=spec["new_tokens"], temperature=1.0, top_p=1.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=KL_COEF,
        num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group", use_vllm=False, use_cpu=True,
        bf16=False, logging_steps=1, report_to="none", save_strategy="no", seed=spec["seed"],
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=verifier, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    trainer.save_model(spec["out"] + "/final")
    marks["params"] = sum(p.numel() for p in trainer.model.parameters())
    return marks


def run_trl(model_dir: Path, prompts: Path, steps: int, new_tokens: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"model": str(model_dir), "prompts": str(prompts), "steps": steps, "new_tokens": new_tokens,
                "seed": seed, "out": tmp, "result": f"{tmp}/marks.json"}
        print(f"  trl: GRPOTrainer on {model_dir}", file=sys.stderr, flush=True)
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--trl-worker", json.dumps(spec)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        end = time.time()
        if proc.returncode:
            raise SystemExit(f"the TRL run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        marks = json.loads(Path(spec["result"]).read_text())
    result = summarise(t0, marks["end"], marks["begin"][0], end, marks["reward"])
    result["params"] = marks["params"]
    return result


# --------------------------------------------------------------------------- report


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(results: list[dict]) -> str:
    lines = ["| size | params | new tokens | | per step s | start-up s | whole run s | reward first 5 → last 5 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for who in ("ours", "trl"):
            x = r[who]
            lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['new_tokens']} | {who} | "
                         f"{x['per_step_s']:.3f} | "
                         f"{x['startup_s']:.1f} | {x['wall_s']:.1f} | {x['reward_first']:.3f} → "
                         f"{x['reward_last']:.3f} |")
        o, t = r["ours"], r["trl"]
        lines.append(f"| {r['size']} | | | **TRL / ours** | **{ratio(t['per_step_s'], o['per_step_s'])}** | "
                     f"**{ratio(t['startup_s'], o['startup_s'])}** | **{ratio(t['wall_s'], o['wall_s'])}** | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=("default", "30m"), default=["default", "30m"])
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps on each side (default 20)")
    ap.add_argument("--sft-steps", type=int, default=60, help="the 30m model's short SFT, in optimizer steps")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "peer", help="where the pipeline runs live")
    ap.add_argument("--ours-set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for our side")
    ap.add_argument("--skip-trl", action="store_true", help="our side only (TRL's figures are then absent)")
    ap.add_argument("--repeats", type=int, default=1, help="run both sides this many times, alternating; the "
                    "figures are the medians (each run is kept under `runs`)")
    ap.add_argument("--json", type=Path, help="write the results here (one object per size; the sizes not run "
                    "this time are kept from the file)")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        spec = json.loads(args.trl_worker)
        Path(spec["result"]).write_text(json.dumps(trl_worker(spec)))
        return
    kept = json.loads(args.json.read_text()) if args.json and args.json.exists() else []
    results = []
    for size in args.sizes:
        run_dir, new_tokens = args.run_dir / size, 16 if size == "default" else 64
        size_args, sft_dir, prompts = prepare(run_dir, size, args.sft_steps)
        ours, trl = [], []
        for _ in range(args.repeats):  # alternating, so a slow spell of the machine hits both sides
            ours.append(run_ours(run_dir, size_args, args.steps, new_tokens, args.ours_set))
            if not args.skip_trl:
                trl.append(run_trl(sft_dir, prompts, args.steps, new_tokens, 0))
        result = {"size": size, "params": trl[0]["params"] if trl else None, "new_tokens": new_tokens,
                  "ours": medians(ours), "trl": medians(trl) if trl else None, "repeats": args.repeats,
                  "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("ours", "trl")} | {
            who: {k: v for k, v in (result[who] or {}).items() if k not in ("rewards", "runs")}
            for who in ("ours", "trl")}),
            file=sys.stderr, flush=True)
        if args.json:
            done = {r["size"] for r in results}
            merged = sorted(results + [r for r in kept if r["size"] not in done], key=lambda r: r["size"] != "default")
            tmp = args.json.with_suffix(".tmp")
            tmp.write_text(json.dumps(merged, indent=1))
            tmp.replace(args.json)
    if all(r["trl"] for r in results):
        print(table(results))


def medians(runs: list[dict]) -> dict:
    """The median of each figure over the repeats (a single run as is), every run kept under `runs`."""
    if len(runs) == 1:
        return runs[0]
    keys = ("per_step_s", "startup_s", "wall_s", "reward_first", "reward_last")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"runs": runs}


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
