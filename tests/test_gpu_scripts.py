"""The two GPU check scripts, run here as far as a CPU allows (issue 68): scripts/gpu_parts.py computes every part
on the CPU (gloo, fp32) with Ray and vLLM made unimportable, as on a bare CUDA machine that has only torch and
transformers; scripts/gpu_check.sh refuses this CPU install at its first check, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What a bare CUDA machine lacks, absent as Python sees an uninstalled package (None in sys.modules: `import` raises
# ModuleNotFoundError and importlib.util.find_spec answers None, as libraries' optional-import probes expect).
BARE = """
import runpy, sys
for name in ("ray", "vllm", "mlflow", "pyarrow", "datasets", "pandas", "peft"):
    sys.modules[name] = None
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_gpu_parts_runs_every_part_without_ray_or_vllm(tmp_path):
    out = tmp_path / "parts.json"
    run = subprocess.run([sys.executable, "-c", BARE, str(ROOT / "scripts" / "gpu_parts.py"), "--device", "cpu",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = {p["part"]: p for p in report["parts"]}
    assert [p for p in parts.values() if p["ok"] is False] == []
    for name in ("process_group", "deepspeed[zero2,fp32]", "deepspeed[zero3,fp32]", "sft", "reward", "ppo_policy",
                 "zero3_gather"):
        assert parts[name]["ok"] is True and parts[name]["seconds"] >= 0, name
    assert parts["process_group"]["backend"] == "gloo"
    assert parts["deepspeed[zero3,fp32]"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert parts["ppo_policy"]["logprobs_on"] == "cpu"  # results come back on the CPU
    gather = parts["zero3_gather"]
    assert 0 < gather["per_parameter_gathered_mb"] < gather["whole_model_gathered_mb"]
    assert gather["chunks"] >= 4 and 0 < gather["chunked_gathered_mb"] < gather["whole_model_gathered_mb"] / 2
    assert parts["deepspeed[zero2,bf16]"]["ok"] is None  # said, not claimed: no bf16 on this CPU run


def test_gpu_parts_refuses_a_machine_without_cuda_unless_told_cpu():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_parts.py")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "--device cpu" in run.stderr


def test_gpu_check_stops_at_its_first_failed_check_naming_it(tmp_path):
    """On this CPU install the first check (the install) fails: exit 1, its name and the fix on stderr."""
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=300, env={"PATH": "/usr/bin:/bin", "GPU_CHECK_DIR": str(tmp_path / "gc"),
                                           "PYTHON": sys.executable})
    assert run.returncode == 1, run
    assert "gpu_check: FAILED install:" in run.stderr and "is a CPU build" in run.stderr
    assert "gpu_check: ok" not in run.stdout
