"""The same DPO job with this pipeline's `dpo` stage and with TRL's `DPOTrainer`, side by side, in one invocation.

    flock /tmp/heavy.lock .venv/bin/python bench/peer_trl_dpo.py --json bench/peer_trl_dpo.json
    flock /tmp/heavy.lock .venv/bin/python bench/peer_trl_dpo.py --variants        # the main pair only (~3 min)
    flock /tmp/heavy.lock .venv/bin/python bench/peer_trl_dpo.py --repeats 3 --json bench/peer_trl_dpo.json

1. Prepare (cached like any pipeline run, in `--run-dir`, default runs/peer-dpo): `pipeline run
   configs/recipes/dpo.yaml --to sft` builds the embedded model (1.0M parameters), the preference pairs
   (~6600 train, ~1100 held out: the correct answer chosen over a plausible wrong one) and the SFT model.
2. Ours: `pipeline run configs/recipes/dpo.yaml --only dpo --force dpo` with the job's settings (below), in a
   subprocess; serve does not run. The main row is one Ray Train worker (2 torch threads, `set_threads`),
   ZeRO-2, the reference a frozen copy (what TRL does with no `ref_model`); the extra configurations
   (`ours_variants`) change one or two of: the reference (`precomputed`, our `auto` default for full
   fine-tuning), the workers (2, the recipe's setting, 1 thread each) and the ZeRO stage (0 vs 2).
3. TRL 1.16: `DPOTrainer` in one process with 2 torch threads (as a user runs it on one machine) on the same
   SFT model directory (`AutoModelForCausalLM.from_pretrained`, tokenizer from the same directory) and the same
   pairs in TRL's conversational format (prompt = [user turn], chosen / rejected = [assistant turn]), which TRL
   tokenizes itself with the chat template; on the first 64 pairs its prompt + chosen and prompt + rejected
   token ids must equal the pipeline's `chosen_input_ids` / `rejected_input_ids` (else SystemExit). The answer
   masks differ by one token per sequence, inherently: TRL scores every token after the prompt, i.e. the
   answer, `<|im_end|>` and the template's trailing newline; the pipeline's loss mask stops at `<|im_end|>`
   (its span is the rendered turn less trailing whitespace, `stages.data.steps.render_with_spans`). The newline's
   log-prob is in TRL's sequence log-probs and not in ours (`tokens.trl_extra_masked_per_seq` counts it; the
   step-1 `logps_chosen` of the two sides differ by its mean log-prob: about -10.5 nats on the SFT model, which
   never trained on that token, as its SFT loss mask stops at `<|im_end|>` too). Both start at loss log 2 and
   the per-step losses stay within ~0.01 of each other over the first steps, not equal: TRL's gradient also
   moves the newline's log-prob after a chosen vs a rejected answer. `trl_variants.precomputed` is TRL
   with `precompute_ref_log_probs=True`, the counterpart of our `precomputed`.

The job (both sides): `--steps` optimizer steps (default 20) of 64 pairs, micro-batches of 32 (each a forward
over 64 sequences, chosen then rejected), i.e. 2 accumulated micro-batches per step with one process
(per_device_train_batch_size=32, gradient_accumulation_steps=2); with 2 workers one micro-batch of 32 per rank.
The pairs in file order (TRL `train_sampling_strategy="sequential"`), so step k sees the same 64 pairs on both
sides. lr 1e-4 constant from the first step (no warm-up; the first run of this bench found that our
`lr_schedule: constant` with `warmup_steps: 0` trained its first steps at lr 0, 0, 5e-5, DeepSpeed's WarmupLR
starting from its floor; `stages.common.deepspeed.lr_scheduler` now starts such a schedule at its peak), AdamW
betas (0.9, 0.95), eps 1e-8, no weight decay (ours' fixed betas; TRL's set to them; TRL's AdamW is torch's fused
one, its default), grad clip 1.0, loss sigmoid (DPO), beta 0.1, no label smoothing, fp32, CPU. The held-out
pairs are scored before the first step and after the last on both sides (our stage always does it; TRL
`eval_on_start` + `eval_steps=N`, `prediction_loss_only`); our held-out task accuracy (vLLM) is off
(`eval_prompts=0`). TRL saves no checkpoints (`save_strategy="no"`) and saves the model at the end; ours
reports one checkpoint (at the end) and exports the HF model.

Measured the same way for both, from the subprocess's launch by this script:
- `startup_s`: until the first step begins (imports, Ray, model loading, engines, TRL's tokenization, the
  reference precompute if any, the held-out scoring before training);
- `per_step_s`: median over steps 2..N of the time between consecutive step ends;
- `wall_s`: until the process exits (the held-out scoring after training, the trained model saved);
- `loss_first` / `loss_last`: training loss (mean over the step's 64 pairs) of the first / last step; `losses`
  holds every step's. Both start at log 2 = 0.693 (policy == reference).
Ours are read back from the dpo stage's MLflow metrics (a step's end = its metrics' timestamp; the first step
begins `step_time_s` before its end); TRL's from a `TrainerCallback`. Ours' `phases` are the medians over steps
2..N of rank 0's seconds per step in the reference forward, the policy forward + loss, backward (ZeRO's
gradient reduction happens in there) and `engine.step()` (clip, optimizer, scheduler). TRL's `phases` are the
same cut, from timing hooks: `reference_s` (the frozen copy's forwards), `forward_s` (`compute_loss` less the
reference), `backward_s` (`training_step` less `compute_loss`), `optimizer_s` (the last micro-batch's end to
the step's end: clip, AdamW, scheduler, zero_grad). `final_eval_s` is the last step's gap less the median gap
(ours: the held-out scoring after the last step lands in it) or TRL's evaluation callback time.

`--json PATH` writes a list with one object (size `default`): `size`, `params`, `ours` / `trl` (the main pair,
the keys above), `ours_variants` / `trl_variants` {name: the same keys}, `tokens` (TRL's tokenization checked
against ours), `job`, `repeats`, `date`, `command`. `--repeats R` runs every configuration R times, alternating
(ours, TRL, the variants; then again), and reports the medians, each run kept under `runs`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "recipes" / "dpo.yaml"
BATCH, MICRO, LR, BETA, BETAS, EPS = 64, 32, 1e-4, 0.1, (0.9, 0.95), 1e-8
PHASES = ("reference_s", "forward_s", "backward_s", "optimizer_s")

# Our configurations: name -> (workers, ZeRO stage, reference). "ours" is the main row (TRL's setting).
OURS = {"ours": (1, 2, "frozen_copy")}
OURS_VARIANTS = {
    "precomputed": (1, 2, "precomputed"),          # our `auto` default for full fine-tuning
    "zero0": (1, 0, "frozen_copy"),                # DeepSpeed without ZeRO, one worker
    "workers2": (2, 2, "frozen_copy"),             # the recipe's 2 workers (1 thread each)
    "workers2_zero0": (2, 0, "frozen_copy"),
    "workers2_precomputed": (2, 2, "precomputed"),  # the recipe's settings (auto = precomputed)
}
TRL_VARIANTS = {"precomputed": True}  # name -> precompute_ref_log_probs


def pipeline_cmd(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", "run", str(CONFIG), *args, f"run_dir={run_dir}"]


def prepare(run_dir: Path) -> tuple[Path, Path]:
    """Model, data, SFT: (the SFT model's directory, the preference data's directory)."""
    cmd = pipeline_cmd(run_dir, "--to", "sft", "--json")
    print(f"prepare: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    summary = json.loads(out.stdout)
    if out.returncode:
        raise SystemExit(f"preparing failed (exit {out.returncode}): {summary.get('error')}")
    outputs = {k: Path(v) for s in summary["stages"] for k, v in s["outputs"].items()}
    return outputs["sft_model"], outputs["preference_data"]


def dpo_overrides(steps: int, workers: int, zero: int, reference: str) -> list[str]:
    p = "stages.dpo."
    return [f"{p}max_steps={steps}", f"{p}epochs=1", f"{p}batch_size={BATCH}", f"{p}micro_batch_size={MICRO}",
            f"{p}num_workers={workers}", f"{p}lr={LR}", f"{p}lr_schedule=constant", f"{p}warmup_steps=0",
            f"{p}weight_decay=0.0", f"{p}grad_clip=1.0", f"{p}loss=dpo", f"{p}beta={BETA}", f"{p}label_smoothing=0.0",
            f"{p}sft_weight=0",
            f"{p}reference={reference}", f"{p}init_from=sft", f"{p}eval_prompts=0", f"{p}eval_every=100000",
            f"{p}checkpoint_every={steps}", f"{p}deepspeed.precision=fp32", f"{p}deepspeed.zero_stage={zero}",
            f"{p}deepspeed.activation_checkpointing=false"]


def summarise(t0: float, step_ends: list[float], first_begin: float, end: float, losses: list[float]) -> dict:
    gaps = [b - a for a, b in zip(step_ends, step_ends[1:])]  # step i's time = end(i) - end(i-1), i >= 2
    per_step = statistics.median(gaps) if gaps else None
    return {"per_step_s": per_step, "startup_s": first_begin - t0, "wall_s": end - t0,
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "steps": len(step_ends), "final_eval_s": gaps[-1] - per_step if gaps else None, "losses": losses}


def run_ours(run_dir: Path, steps: int, workers: int, zero: int, reference: str, extra: list[str]) -> dict:
    from mlflow.tracking import MlflowClient

    cmd = pipeline_cmd(run_dir, "--only", "dpo", "--force", "dpo", "--json",
                       *dpo_overrides(steps, workers, zero, reference), *extra)
    print(f"  ours ({workers} worker(s), ZeRO-{zero}, {reference}): {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    end = time.time()
    summary = json.loads(out.stdout)
    if out.returncode:
        raise SystemExit(f"our dpo stage failed (exit {out.returncode}): {summary.get('error')} "
                         f"(log: {run_dir}/logs/dpo.log)")
    stage = next(s for s in summary["stages"] if s["name"] == "dpo")
    client = MlflowClient(summary["tracking_uri"])

    def hist(key: str) -> list:  # one value per step (the stage logs its final metrics again at the last step)
        return list({m.step: m for m in sorted(client.get_metric_history(stage["mlflow_run_id"], key),
                                               key=lambda m: (m.step, -m.timestamp))}.values())

    times = [m for m in hist("step_time_s") if m.step >= 1]
    ends = [m.timestamp / 1000 for m in times]
    losses = [m.value for m in hist("train_loss") if m.step >= 1]
    result = summarise(t0, ends, ends[0] - times[0].value, end, losses)
    phases = {k: statistics.median(m.value for m in hist(k) if m.step >= 2) for k in PHASES + ("step_time_s",)}

    def at(key: str, step: int):
        return next((m.value for m in hist(key) if m.step == step), None)

    result.update(phases={k: round(v, 4) for k, v in phases.items()}, workers=workers, zero_stage=zero,
                  reference=reference, stage_s=stage["duration_s"],
                  reference_precompute_s=at("reference_precompute_s", 0),
                  logps_chosen_first=at("train_logps_chosen", 1), logps_rejected_first=at("train_logps_rejected", 1),
                  eval_loss_first=at("eval_loss", 0), eval_loss_last=at("eval_loss", len(ends)),
                  reward_accuracy_last=at("train_reward_accuracy", len(ends)),
                  lr_after_steps_1_3=[m.value for m in hist("lr")][:3])  # engine.get_lr() after the step: the next's
    return result


# --------------------------------------------------------------------------- TRL, in its own process


def trl_worker(spec: dict) -> dict:
    """TRL's DPOTrainer on the SFT model: the timings the callback and hooks saw (epoch seconds)."""
    marks: dict = {"launched": time.time()}
    import torch

    torch.set_num_threads(2)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from stages.common.parquet import read_rows

    marks["imported"] = time.time()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = {split: read_rows(Path(spec["data"]) / split) for split in ("train", "eval")}

    def conversational(r: dict) -> dict:
        return {"prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}]}

    data = {split: Dataset.from_list([conversational(r) for r in rs]) for split, rs in rows.items()}
    marks.update(begin=[], end=[], loss=[], logs=[], evals=[], step_phases=[])
    prof = {"ref": 0.0, "loss": 0.0, "train_step": 0.0, "last_micro_end": 0.0, "training": False}

    class Timed(DPOTrainer):
        """Timing hooks: compute_loss (policy + reference forward, loss) and training_step (+ backward)."""

        def compute_loss(self, *a, **k):
            t = time.time()
            out = super().compute_loss(*a, **k)
            if prof["training"]:
                prof["loss"] += time.time() - t
            return out

        def training_step(self, *a, **k):
            t = time.time()
            prof["training"] = True
            out = super().training_step(*a, **k)
            prof["training"] = False
            prof["last_micro_end"] = time.time()
            prof["train_step"] += prof["last_micro_end"] - t
            return out

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks["train_begin"] = time.time()

        def on_step_begin(self, *a, **k):
            marks["begin"].append(time.time())
            prof.update(ref=0.0, loss=0.0, train_step=0.0)

        def on_step_end(self, *a, **k):
            now = time.time()
            marks["end"].append(now)
            marks["step_phases"].append({"reference_s": prof["ref"], "forward_s": prof["loss"] - prof["ref"],
                                         "backward_s": prof["train_step"] - prof["loss"],
                                         "optimizer_s": now - prof["last_micro_end"]})

        def on_evaluate(self, args, state, control, metrics=None, **k):
            marks["evals"].append({"time": time.time(), "step": state.global_step, **(metrics or {})})

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                marks["loss"].append(logs["loss"])
                marks["logs"].append(logs)

    steps = spec["steps"]
    cfg = DPOConfig(
        output_dir=spec["out"], max_steps=steps, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=BATCH // MICRO, per_device_eval_batch_size=MICRO, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_epsilon=EPS, max_grad_norm=1.0, beta=BETA, loss_type=["sigmoid"], label_smoothing=0.0,
        precompute_ref_log_probs=spec["precompute"], max_length=None, train_sampling_strategy="sequential",
        eval_strategy="steps", eval_steps=steps, eval_on_start=True, prediction_loss_only=True,
        use_cpu=True, bf16=False, fp16=False, logging_steps=1, report_to="none", save_strategy="no",
        seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True)
    marks["trainer_init"] = time.time()
    trainer = Timed(model=model, args=cfg, train_dataset=data["train"], eval_dataset=data["eval"],
                    processing_class=tok, callbacks=[Clock()])
    marks["trainer_built"] = time.time()
    if trainer.ref_model is not None:  # the frozen copy's forwards, within training steps
        def ref_pre(*_):
            prof["ref_t0"] = time.time()

        def ref_post(*_):
            if prof["training"]:
                prof["ref"] += time.time() - prof["ref_t0"]

        trainer.ref_model.register_forward_pre_hook(ref_pre)
        trainer.ref_model.register_forward_hook(ref_post)

    # TRL tokenized the pairs itself with the chat template: it must give our token ids.
    trl_only, ours_only, extra_tokens = [], [], set()
    for i, r in enumerate(rows["train"][:64]):
        t = trainer.train_dataset[i]
        for side in ("chosen", "rejected"):
            ids = list(t["prompt_ids"]) + list(t[f"{side}_ids"])
            if ids != list(r[f"{side}_input_ids"]):
                raise SystemExit(f"TRL's prompt+{side} tokens differ from the pipeline's for pair {i} "
                                 f"({r['prompt']!r}): {ids} vs {list(r[f'{side}_input_ids'])}")
            trl_mask = [0] * len(t["prompt_ids"]) + [1] * len(t[f"{side}_ids"])
            ours = list(r[f"{side}_loss_mask"])
            trl_only.append(sum(a and not b for a, b in zip(trl_mask, ours)))
            ours_only.append(sum(b and not a for a, b in zip(trl_mask, ours)))
            extra_tokens.update(tok.decode([x]) for x, a, b in zip(ids, trl_mask, ours) if a != b)
    marks["tokens"] = {"checked_pairs": min(64, len(rows["train"])), "ids_equal": True,
                       "trl_extra_masked_per_seq": statistics.fmean(trl_only),
                       "ours_extra_masked_per_seq": statistics.fmean(ours_only),
                       "mask_differing_tokens": sorted(extra_tokens)}

    trainer.train()
    trainer.save_model(spec["out"] + "/final")
    marks["saved"] = time.time()
    marks["params"] = sum(p.numel() for p in trainer.model.parameters())
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    marks["optimizer"] = f"{type(opt).__name__} (optim={cfg.optim})"
    return marks


def run_trl(model_dir: Path, data: Path, steps: int, seed: int, precompute: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"model": str(model_dir), "data": str(data), "steps": steps, "seed": seed, "out": tmp,
                "precompute": precompute, "result": f"{tmp}/marks.json"}
        print(f"  trl (precompute_ref_log_probs={precompute}): DPOTrainer on {model_dir}", file=sys.stderr, flush=True)
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--trl-worker", json.dumps(spec)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TQDM_DISABLE": "1"})
        end = time.time()
        if proc.returncode:
            raise SystemExit(f"the TRL run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        marks = json.loads(Path(spec["result"]).read_text())
    result = summarise(t0, marks["end"], marks["begin"][0], end, marks["loss"])
    phases = {k: statistics.median(p[k] for p in marks["step_phases"][1:]) for k in PHASES}
    phases["step_time_s"] = statistics.median(e - b for b, e in list(zip(marks["begin"], marks["end"]))[1:])
    evals = marks["evals"]
    first_log = marks["logs"][0] if marks["logs"] else {}
    result.update(
        phases={k: round(v, 4) for k, v in phases.items()}, params=marks["params"], tokens=marks["tokens"],
        precompute=precompute, optimizer=marks["optimizer"],
        final_eval_s=evals[-1]["time"] - marks["end"][-1] if evals else None,
        import_s=marks["imported"] - t0, trainer_init_s=marks["trainer_built"] - marks["trainer_init"],
        first_eval_s=evals[0]["time"] - marks["train_begin"] if evals else None,
        logps_chosen_first=first_log.get("logps/chosen"), logps_rejected_first=first_log.get("logps/rejected"),
        eval_loss_first=evals[0].get("eval_loss") if evals else None,
        eval_loss_last=evals[-1].get("eval_loss") if len(evals) > 1 else None,
        reward_accuracy_last=marks["logs"][-1].get("rewards/accuracies") if marks["logs"] else None)
    return result


# --------------------------------------------------------------------------- report


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def configurations(r: dict) -> list[tuple[str, dict, object, object, str]]:
    """(label, figures, workers, ZeRO stage, reference) of every configuration run, the main pair first."""
    def trl_ref(x: dict) -> str:
        return "precomputed" if x["precompute"] else "frozen_copy"

    out = [("**ours**", r["ours"], r["ours"]["workers"], r["ours"]["zero_stage"], r["ours"]["reference"])]
    if r["trl"]:
        out.append(("**TRL DPOTrainer**", r["trl"], 1, "-", trl_ref(r["trl"])))
    out += [(f"ours {n}", x, x["workers"], x["zero_stage"], x["reference"]) for n, x in r["ours_variants"].items()]
    out += [(f"TRL {n}", x, 1, "-", trl_ref(x)) for n, x in r["trl_variants"].items()]
    return out


def table(r: dict) -> str:
    """Every configuration (per-step time also relative to our main row), the TRL / ours ratios of the main
    pair, then the phase breakdown."""
    o, t = r["ours"], r["trl"]
    lines = [f"DPO, {r['params'] / 1e6:.2f}M parameters, {r['job']['steps']} steps of {BATCH} pairs (micro-batches "
             f"of {MICRO}), fp32, 2 cores" if r["params"] else "", "",
             "| config | workers | ZeRO | reference | per step s | vs ours | start-up s | whole run s | loss first → "
             "last |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, (name, x, workers, zero, reference) in enumerate(configurations(r)):
        lines.append(f"| {name} | {workers} | {zero} | {reference} | {fmt(x['per_step_s'])} | "
                     f"{ratio(x['per_step_s'], o['per_step_s'])} | {fmt(x['startup_s'], '.1f')} | "
                     f"{fmt(x['wall_s'], '.1f')} | {fmt(x['loss_first'], '.4f')} → {fmt(x['loss_last'], '.4f')} |")
        if i == 1 and t:
            lines.append(f"| **TRL / ours** | | | | **{ratio(t['per_step_s'], o['per_step_s'])}** | | "
                         f"**{ratio(t['startup_s'], o['startup_s'])}** | **{ratio(t['wall_s'], o['wall_s'])}** | |")
    lines += ["", "Median seconds per optimizer step, steps 2..N (ours: rank 0's; final eval: the held-out scoring "
              "after the last step):", "",
              "| config | reference | forward + loss | backward | optimizer | sum | step gap | final eval |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, x, *_ in configurations(r):
        p = x["phases"]
        lines.append(f"| {name} | " + " | ".join(fmt(p[k]) for k in PHASES) + f" | {fmt(sum(p[k] for k in PHASES))} | "
                     f"{fmt(x['per_step_s'])} | {fmt(x.get('final_eval_s'), '.2f')} |")
    return "\n".join(lines)


def medians(runs: list[dict]) -> dict:
    """The median of each figure over the repeats (a single run as is), every run kept under `runs`."""
    if len(runs) == 1:
        return runs[0]
    keys = ("per_step_s", "startup_s", "wall_s", "loss_first", "loss_last", "final_eval_s")
    out = {k: v for k, v in runs[0].items() if k not in keys + ("phases", "losses")}
    out |= {k: statistics.median(r[k] for r in runs) for k in keys if all(r.get(k) is not None for r in runs)}
    out["phases"] = {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]}
    return out | {"runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="DPO optimizer steps on each side (default 20)")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "peer-dpo", help="where the pipeline run lives")
    ap.add_argument("--variants", nargs="*", default=None, metavar="NAME",
                    help=f"extra configurations to run (default all: ours {', '.join(OURS_VARIANTS)}; TRL "
                         f"{', '.join('trl-' + n for n in TRL_VARIANTS)}); none: the main pair only")
    ap.add_argument("--ours-set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for our side")
    ap.add_argument("--skip-trl", action="store_true", help="our side only (TRL's figures are then absent)")
    ap.add_argument("--repeats", type=int, default=1, help="run every configuration this many times, alternating; "
                    "the figures are the medians (each run is kept under `runs`)")
    ap.add_argument("--seed", type=int, default=0, help="TRL's seed (ours: the recipe's, 0)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        spec = json.loads(args.trl_worker)
        Path(spec["result"]).write_text(json.dumps(trl_worker(spec)))
        return
    wanted = list(OURS_VARIANTS) + [f"trl-{n}" for n in TRL_VARIANTS] if args.variants is None else args.variants
    unknown = [v for v in wanted if v not in OURS_VARIANTS and v.removeprefix("trl-") not in TRL_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(OURS_VARIANTS)} and "
                         f"{['trl-' + n for n in TRL_VARIANTS]}")
    started = time.time()
    sft_dir, data = prepare(args.run_dir)
    print(f"prepared in {time.time() - started:.0f} s: SFT model {sft_dir}, pairs {data}", file=sys.stderr, flush=True)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # alternating, so a slow spell of the machine hits every configuration
        runs.setdefault("ours", []).append(run_ours(args.run_dir, args.steps, *OURS["ours"], args.ours_set))
        if not args.skip_trl:
            runs.setdefault("trl", []).append(run_trl(sft_dir, data, args.steps, args.seed, False))
        for name in wanted:
            if name in OURS_VARIANTS:
                runs.setdefault(name, []).append(run_ours(args.run_dir, args.steps, *OURS_VARIANTS[name],
                                                          args.ours_set))
            elif not args.skip_trl:
                runs.setdefault(name, []).append(run_trl(sft_dir, data, args.steps, args.seed,
                                                         TRL_VARIANTS[name.removeprefix("trl-")]))
    trl = medians(runs["trl"]) if "trl" in runs else None
    result = {
        "size": "default", "params": trl["params"] if trl else None, "ours": medians(runs["ours"]), "trl": trl,
        "ours_variants": {n: medians(runs[n]) for n in wanted if n in OURS_VARIANTS},
        "trl_variants": {n.removeprefix("trl-"): medians(runs[n]) for n in wanted if n.startswith("trl-")
                         and n in runs},
        "tokens": trl["tokens"] if trl else None,
        "job": {"steps": args.steps, "pairs_per_step": BATCH, "micro_batch_size": MICRO, "lr": LR,
                "lr_schedule": "constant", "warmup_steps": 0, "adam_betas": list(BETAS), "adam_eps": EPS,
                "weight_decay": 0.0, "grad_clip": 1.0, "loss": "dpo (TRL sigmoid)", "beta": BETA, "precision": "fp32",
                "torch_threads_per_process": "2 (TRL; ours with 1 worker), 1 (ours with 2 workers)",
                "ours_overrides": dpo_overrides(args.steps, *OURS["ours"]) + args.ours_set},
        "repeats": args.repeats, "bench_s": round(time.time() - started, 1),
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
    }
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps([result], indent=1))
        tmp.replace(args.json)
    print(table(result))


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
