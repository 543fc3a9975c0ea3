"""Each phase of ppo's iteration, and a step of the reward and sft stages, beside its compute floor.

    .venv/bin/python bench/phases.py --json bench/phases.json
    .venv/bin/python bench/phases.py --iterations 6 --steps 80

A phase's **floor** is its arithmetic at this machine's GEMM rate, measured in the same invocation
(`bench/machine.py`: float32 matrix products on every core): what the phase would cost if every FLOP ran
as fast as one large GEMM does here. A phase far above its floor is spent on something other than
arithmetic (process hops, Python, small kernels, waiting); the ratio says where to cut first.

FLOPs are counted the usual way: 2 x parameters per token for a forward pass, 6 x for a forward and
backward (Kaplan et al. 2020), attention's own products left out (at 128 tokens and width 128 they
add under 10 %). Per phase:

- **gen**: every rollout's prompt and response tokens through the policy once (prefill, then one
  token at a time from the KV cache);
- **score**: the reward model's forward over each (prompt, response), the reference's, and the
  critic's (ppo), each over the same tokens; the old policy's too unless the engines' log-probs are used;
- **train**: `ppo_epochs` forward and backward passes of the policy (and the critic);
- **sync**: no arithmetic: its floor is the policy's bytes at the memory-copy rate measured here.
- **reward step** / **sft step**: one optimizer step's forward and backward over its rows (a pair is
  two sequences), its time from the stage's per-step MLflow history (steps past the first 10).

Prepares the default up to its reward model (cached in `--run-dir`), then runs ppo for `--iterations`
(the first left out: warm-up) and `--steps` optimizer steps of reward and sft, each alone and forced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import DEFAULT, ROOT, pipeline  # noqa: E402  (bench/startup.py: one `pipeline run --json`)


def parameters(model_dir: Path) -> int:
    """Parameters in a saved model (its safetensors files), tied weights counted once."""
    from safetensors import safe_open

    seen, total = set(), 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                shape = tuple(t.get_shape())
                n = 1
                for d in shape:
                    n *= d
                key = (shape, name.split(".")[-1]) if "embed" in name or "lm_head" in name else name
                if key not in seen:
                    seen.add(key)
                    total += n
    return total


def copy_rate(mb: float) -> float:
    """Bytes per second of one float32 tensor copy of `mb` MiB (the best of five)."""
    import torch

    a = torch.empty(max(int(mb * 2**20 / 4), 1))
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best


def mean_length(parquet_dir: Path, column: str) -> float:
    import pyarrow.parquet as pq

    lengths = pq.ParquetDataset(sorted(parquet_dir.glob("*.parquet"))).read(columns=[column]).column(column)
    values = [len(x) for x in lengths.to_pylist()]
    return sum(values) / len(values)


def history(tracking_uri: str, run_id: str) -> dict[str, list]:
    """Every metric of an MLflow run: name -> [(step, value, timestamp ms)] by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    names = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, k)) for k in names}


def step_seconds(hist: dict[str, list], metric: str = "train_loss", skip: int = 10) -> float:
    """Seconds per optimizer step: the median gap between consecutive steps' log times (each step is logged
    as it ends, `events.RankZeroLogger`), past the first `skip` steps; a step that also evaluated is an
    outlier the median leaves out."""
    first: dict[int, int] = {}  # a step may be logged twice (its metrics, then its checkpoint's report)
    for s, _, t in hist[metric]:
        first[s] = min(t, first.get(s, t))
    points = sorted((s, t) for s, t in first.items() if s > skip)
    return statistics.median((t1 - t0) / 1000 / (s1 - s0) for (s0, t0), (s1, t1) in zip(points, points[1:]))


def run_stage(run_dir: Path, stage: str, *overrides: str) -> tuple[dict, dict]:
    summary = pipeline(DEFAULT, run_dir, "--only", stage, "--force", stage, *overrides)
    entry = next(s for s in summary["stages"] if s["name"] == stage)
    return entry, history(summary["tracking_uri"], entry["mlflow_run_id"])


def main() -> None:
    import machine
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=5, help="ppo iterations (the first is left out)")
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps of the reward and sft stages")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "bench-phases")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()

    cal = machine.announce()
    flops_s = cal.gemm_gflops * 1e9
    t0 = time.time()
    prep = pipeline(DEFAULT, args.run_dir, "--to", "reward")
    outputs = {s["name"]: s["outputs"] for s in prep["stages"]}
    stages = yaml.safe_load(DEFAULT.read_text())["stages"]
    ppo, rm = stages["ppo"], stages["reward"]
    p_policy = parameters(Path(outputs["sft"]["sft_model"]))
    p_rm = parameters(Path(outputs["reward"]["reward_model"]))
    prompt_len = mean_length(Path(outputs["data"]["prompt_data"]) / "train", "prompt_ids")
    pair_len = (mean_length(Path(outputs["data"]["preference_data"]) / "train", "chosen_input_ids")
                + mean_length(Path(outputs["data"]["preference_data"]) / "train", "rejected_input_ids"))
    sft_len = mean_length(Path(outputs["data"]["sft_data"]) / "train", "input_ids")

    entry, hist = run_stage(args.run_dir, "ppo", f"stages.ppo.iterations={args.iterations}",
                            "stages.ppo.eval_prompts=0",
                            f"stages.ppo.checkpoint_every={args.iterations}")
    later = [i for i in range(len(hist["train_s"])) if hist["train_s"][i][0] > 1]  # iteration 1: warm-up

    def median(metric: str) -> float:
        return statistics.median(hist[metric][i][1] for i in later)

    rows = ppo["prompts_per_iteration"] * ppo["sampling"]["n"]
    tokens = rows * (prompt_len + median("response_length"))
    algorithm = ppo.get("algorithm", "ppo")
    critic = p_policy if algorithm == "ppo" else 0
    old_policy = 0 if ppo.get("rollout", {}).get("engine_logprobs") else p_policy
    sync_bytes = median("sync_mb") * 2**20
    phases = {
        "gen": (median("generate_s"), 2 * p_policy * tokens),
        "score": (median("score_s"), 2 * (p_rm + p_policy + critic + old_policy) * tokens),
        "train": (median("train_s"), 6 * (p_policy + critic) * tokens * ppo.get("ppo_epochs", 1)),
    }
    table = [{"phase": f"ppo {name}", "seconds": s, "gflop": f / 1e9, "floor_s": f / flops_s} for name, (s, f) in
             phases.items()]
    table.append({"phase": "ppo sync", "seconds": median("sync_s"), "gflop": 0.0,
                  "floor_s": sync_bytes / copy_rate(sync_bytes / 2**20),
                  "note": f"{sync_bytes / 2**20:.1f} MiB copied"})
    table.append({"phase": "ppo iteration", "seconds": median("iteration_s"),
                  "gflop": sum(f for _, f in phases.values()) / 1e9,
                  "floor_s": sum(f for _, f in phases.values()) / flops_s})

    steps = [f"stages.{{}}.max_steps={args.steps}"]
    _, rhist = run_stage(args.run_dir, "reward", steps[0].format("reward"))
    _, shist = run_stage(args.run_dir, "sft", steps[0].format("sft"), "stages.sft.accuracy_prompts=0")
    for name, hist_, batch, length in (("reward step", rhist, rm["batch_size"], pair_len),
                                       ("sft step", shist, stages["sft"]["batch_size"], sft_len)):
        flop = 6 * (p_rm if name.startswith("reward") else p_policy) * batch * length
        table.append({"phase": name, "seconds": step_seconds(hist_), "gflop": flop / 1e9, "floor_s": flop / flops_s})
    for r in table:
        r["over_floor"] = r["seconds"] / r["floor_s"] if r["floor_s"] else None

    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - t0:.0f} s: {' '.join(sys.argv)}")
    print(f"{cal.line()}\nparameters: policy {p_policy:,}, reward model {p_rm:,}; tokens per rollout "
          f"{prompt_len:.1f} prompt + {median('response_length'):.1f} response; {rows} rollouts per iteration; "
          f"ppo iterations 2-{args.iterations} (median), steps past 10 of {args.steps}\n")
    print("| phase | seconds | GFLOP | floor s (GEMM rate) | x floor |\n| --- | --- | --- | --- | --- |")
    for r in table:
        over = f"{r['over_floor']:.0f}x" if r["over_floor"] else ""
        print(f"| {r['phase']} | {r['seconds']:.3f} | {r['gflop']:.2f} | {r['floor_s']:.4f} | **{over}** |"
              + (f" {r['note']}" if r.get("note") else ""))
    if args.json:
        args.json.write_text(json.dumps({"calibration": cal.line(), "parameters": {"policy": p_policy, "reward": p_rm},
                                         "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
