"""`import pipeline` and `import stages` stay light (docs/architecture.md)."""

import subprocess
import sys

from conftest import ROOT


def test_package_imports_pull_in_no_heavy_packages():
    code = (
        "import sys, pipeline, stages, pipeline.config, pipeline.runner, pipeline.registry, "
        "stages.data, stages.model, stages.common.models, stages.common.tasks, stages.common.formats; "
        "print(sorted(m for m in ('ray', 'vllm', 'deepspeed', 'torch', 'mlflow', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
