#!/usr/bin/env bash
# The whole stack on one CUDA GPU, in under 10 minutes (issue 68). For a machine with an NVIDIA GPU and the
# project installed for it (`make setup EXTRA=gpu`, which itself refuses a CPU build of torch or vLLM):
#
#   bash scripts/gpu_check.sh                 # one line per check with its figure; exit 1 at the first failure
#   GPU_CHECK_DIR=/tmp/gc bash scripts/gpu_check.sh   # where its run directory goes (default: a fresh temp dir)
#   GPU_CHECK_MAX_GAP=0.05 ...                # the largest sampler-trainer log-prob gap (mean |dlogp|) accepted
#
# Checks, in order (each a `pipeline run` of configs/smoke.yaml sized for one GPU, or a direct engine call):
#   install     scripts/check_install.py gpu: CUDA torch sees the GPU, the CUDA vLLM alone is installed
#   train       data, model, sft and reward on DeepSpeed in bf16, one Ray Train worker each on the GPU
#   colocated   ppo in layout colocated (the rank's trainer and its CUDA vLLM engine on one GPU), sleep mode on
#               (level 2: TRL's order) and then off; the weight sync shown by the sampler-trainer log-prob gap of
#               the last iteration (an engine left with stale weights after an update drifts from the trainer)
#   perturbed   a CUDA vLLM engine's greedy answers change when perturbed weights are synced into it and come back
#               when the originals are (the load path every sync uses)
#   separate    ppo in layout separate: roles and engines as their own Ray actors sharing the GPU in fractions
#               (gpus_per_process 0.2), the weights synced through the object store; its gap and sync time
#   nccl        with 2 GPUs or more: ppo in layout separate with rollout.sync_transport nccl (the policy rank and
#               the engine on a GPU each, the weights broadcast over vLLM's NCCL transfer); its gap and sync
#               time. On one GPU it says it was skipped and why (NCCL cannot join two processes on one GPU)
#   serve       the serve stage on the GPU: one OpenAI-compatible request through Ray Serve, its latency
# What it cannot tell: speed against a peer, NCCL between machines (scripts/gpu_parts.py runs a
# single-rank NCCL group), or tensor parallelism.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
DIR=${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
MAX_GAP=${GPU_CHECK_MAX_GAP:-0.05}
RUN_DIR="$DIR/run"
T0=$(date +%s)
mkdir -p "$DIR"

fail() { echo "gpu_check: FAILED $1: $2 (logs: $RUN_DIR/logs, $DIR/$1.err)" >&2; exit 1; }
line() { printf 'gpu_check: ok %-10s %s\n' "$1" "$2"; }

# A pipeline run of the smoke config on one GPU: `run NAME ARGS...`, its --json summary in $DIR/NAME.json.
ONE_GPU=(run_dir="$RUN_DIR" ray.num_gpus=1 stages.sft.num_workers=1 stages.reward.num_workers=1
         stages.sft.deepspeed.precision=bf16 stages.reward.deepspeed.precision=bf16
         stages.ppo.policy.num_ranks=1 stages.ppo.critic.num_ranks=1 stages.ppo.rollout.num_engines=1
         stages.serve.smoke.requests=1)
run() {
  local name=$1; shift
  "$PY" -m pipeline run configs/smoke.yaml --json "$@" "${ONE_GPU[@]}" >"$DIR/$name.json" 2>"$DIR/$name.err" \
    || fail "$name" "exit $? ($(tail -n 3 "$DIR/$name.err" | tr '\n' ' ' | cut -c1-300))"
}

# A figure of a stage from the run's MLflow store: `figure NAME STAGE EXPR` where EXPR is Python over
# `m` (the run's last metrics) and `h(key)` (a metric's history, oldest first).
figure() {
  "$PY" - "$DIR/$1.json" "$2" "$3" <<'EOF'
import json, sys
from mlflow.tracking import MlflowClient
summary, stage, expr = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
run_id = next(s["mlflow_run_id"] for s in summary["stages"] if s["name"] == stage)
client = MlflowClient(summary["tracking_uri"])
m = client.get_run(run_id).data.metrics
h = lambda key: [x.value for x in sorted(client.get_metric_history(run_id, key), key=lambda x: x.step)]
print(eval(expr, {"m": m, "h": h}))
EOF
}

# ------------------------------------------------------------------ install
"$PY" scripts/check_install.py gpu >"$DIR/install.out" 2>"$DIR/install.err" \
  || fail install "$(tr '\n' ' ' <"$DIR/install.err")"
line install "$(cat "$DIR/install.out")"

# ------------------------------------------------------------------ train: sft and reward, bf16 DeepSpeed
run train --to reward
line train "sft eval_loss $(figure train sft 'round(m["eval_loss"], 4)'), reward eval_accuracy $(figure train reward 'round(m["eval_accuracy"], 3)') (bf16, 1 worker each on the GPU)"

# ------------------------------------------------------------------ ppo colocated, sleep mode on and off
for sleep in true false; do
  name=colocated_sleep_$sleep
  run "$name" --only ppo --force ppo stages.ppo.layout=colocated stages.ppo.rollout.sleep_mode=$sleep
  gap=$(figure "$name" ppo 'round(h("logprob_mismatch_mean")[-1], 5)') || fail "$name" "no logprob_mismatch_mean logged"
  "$PY" -c "import sys; sys.exit(not float('$gap') <= $MAX_GAP)" \
    || fail "$name" "the sampler-trainer log-prob gap of the last iteration is $gap > $MAX_GAP: the engine's weights are not the trainer's"
  line "$name" "sampler-trainer gap $gap (mean |dlogp|, last iteration; first $(figure "$name" ppo 'round(h("logprob_mismatch_mean")[0], 5)')), sync $(figure "$name" ppo 'round(m.get("sync_s", float("nan")), 3)') s"
done

# ------------------------------------------------------------------ perturbed sync into a CUDA engine
SFT_DIR=$("$PY" -c "import json; print(next(s['outputs']['sft_model'] for s in json.load(open('$DIR/train.json'))['stages'] if s['name'] == 'sft'))")
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" - "$SFT_DIR" >"$DIR/perturbed.out" 2>"$DIR/perturbed.err" <<'EOF' || fail perturbed "$(tail -n 3 "$DIR/perturbed.err" | tr '\n' ' ' | cut -c1-300)"
import sys
import numpy as np
from safetensors.numpy import load_file
from pathlib import Path
from stages.common.engines import EngineSpec, RolloutEngine
from transformers import AutoTokenizer

model = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model)
prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {a}?"}], add_generation_prompt=True)
           for a in range(8)]
engine = RolloutEngine(model, EngineSpec(max_model_len=128, gpu=True, dtype="bfloat16", gpu_memory_utilization=0.3), 0)
greedy = {"n": 1, "temperature": 0.0, "max_tokens": 12}
answers = lambda: [s[0]["ids"] for s in engine.generate(prompts, greedy)]
before = answers()
weights = {k: v for f in Path(model).glob("*.safetensors") for k, v in load_file(f).items()}
rng = np.random.default_rng(0)
engine.load_weights({k: v + rng.normal(0, 0.5 * (v.std() + 1e-3), v.shape).astype(v.dtype) for k, v in weights.items()}, 1)
perturbed = answers()
engine.load_weights(weights, 2)
restored = answers()
changed = sum(a != b for a, b in zip(before, perturbed))
if changed == 0 or restored != before:
    sys.exit(f"perturbed sync changed {changed}/8 answers, restoring gave back {sum(a == b for a, b in zip(before, restored))}/8")
print(f"perturbed weights changed {changed}/8 greedy answers; the originals synced back restored 8/8")
EOF
line perturbed "$(cat "$DIR/perturbed.out")"

# ------------------------------------------------------------------ ppo separate, sharing the GPU in fractions
run separate --only ppo --force ppo stages.ppo.layout=separate stages.ppo.gpus_per_process=0.2 \
  stages.ppo.rollout.gpu_memory_utilization=0.2
gap=$(figure separate ppo 'round(h("logprob_mismatch_mean")[-1], 5)') || fail separate "no logprob_mismatch_mean logged"
"$PY" -c "import sys; sys.exit(not float('$gap') <= $MAX_GAP)" || fail separate "sampler-trainer gap $gap > $MAX_GAP"
line separate "sampler-trainer gap $gap, sync $(figure separate ppo 'round(m.get("sync_s", float("nan")), 3)') s through the object store"

# ------------------------------------------------------------------ ppo separate, the sync over NCCL (2 GPUs)
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
  "$PY" -m pipeline run configs/smoke.yaml --json --only ppo --force ppo run_dir="$RUN_DIR" ray.num_gpus=2 \
    stages.ppo.layout=separate stages.ppo.gpus_per_process=1 stages.ppo.rollout.sync_transport=nccl \
    stages.ppo.algorithm=grpo stages.ppo.reference.colocate=true stages.ppo.rewards.model_weight=0 \
    stages.ppo.policy.num_ranks=1 stages.ppo.rollout.num_engines=1 >"$DIR/nccl.json" 2>"$DIR/nccl.err" \
    || fail nccl "exit $? ($(tail -n 3 "$DIR/nccl.err" | tr '\n' ' ' | cut -c1-300))"
  gap=$(figure nccl ppo 'round(h("logprob_mismatch_mean")[-1], 5)') || fail nccl "no logprob_mismatch_mean logged"
  "$PY" -c "import sys; sys.exit(not float('$gap') <= $MAX_GAP)" || fail nccl "sampler-trainer gap $gap > $MAX_GAP"
  line nccl "sampler-trainer gap $gap, sync $(figure nccl ppo 'round(m.get("sync_s", float("nan")), 3)') s over NCCL"
else
  echo "gpu_check: skip nccl       needs 2 GPUs (the policy rank and the engine on a GPU each); this machine has $GPUS"
fi

# ------------------------------------------------------------------ serve: one OpenAI request
run serve --only serve --force serve
line serve "one chat completion on the GPU: latency $(figure serve serve 'round(m["smoke_latency_p50_s"], 3)') s, $(figure serve serve 'round(m["smoke_tokens_per_s"], 1)') tokens/s"

echo "gpu_check: passed, $(( $(date +%s) - T0 )) s; run directory $DIR"
