"""Upstream defect: `import deepspeed` imports MLflow when it can (`deepspeed.autotuning`, for its autotuner, which
we never run): about 2 s of CPU more in every process that imports DeepSpeed.

Targets: DeepSpeed 0.19 (`import deepspeed` reaches `deepspeed/autotuning/autotuner.py`, which imports mlflow inside
a try/except ImportError). No upstream issue filed from here.
Removable when: importing deepspeed leaves mlflow unimported; the test that says so is
`tests/test_upstream.py::test_deepspeed_still_imports_mlflow`.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def _hidden(module: str):
    """`import <module>` raises ImportError inside the block (a library's optional import is skipped),
    unless the process has imported it already."""
    if module in sys.modules:
        yield
        return
    sys.modules[module] = None  # type: ignore[assignment]  # the import system's "not importable" marker
    try:
        yield
    finally:
        if sys.modules.get(module, 0) is None:
            del sys.modules[module]


def import_without_mlflow():
    """`import deepspeed` with MLflow hidden; a process that logs to MLflow (a Train rank 0) has imported it
    already and is left as it is."""
    with _hidden("mlflow"):
        import deepspeed
    return deepspeed
