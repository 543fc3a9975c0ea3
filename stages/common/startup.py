"""What a worker process imports before its first step, and what it leaves out.

Every process a stage starts (a Ray Train worker, a PPO rank, a rollout engine) pays its imports
before any work, and on a 2-core machine those processes import side by side, so every second of
CPU an import burns is a second of somebody's start-up (bench/startup.py measures it; the
`imports` part). Two optional imports cost that much and do nothing for us:

- **scikit-learn, through transformers.** `transformers.generation` imports `sklearn.metrics` when
  scikit-learn is installed (MLflow depends on it), for assisted generation's confidence threshold,
  which nothing here uses: about 2 s of CPU in every process that loads a model, vLLM's engines
  included. `lean_imports()` tells transformers scikit-learn is absent, in our worker processes only
  (the driver and a user's own code see it as installed).
- **MLflow, through DeepSpeed.** `deepspeed.autotuning` imports MLflow if it can (for its
  autotuner, which we never run): about 2 s more per process. `import_deepspeed()` imports it with
  MLflow hidden; a process that logs to MLflow (a Train rank 0) has imported it already and is
  left as it is.

Both are measured in bench/RESULTS.md (start-up). They change what is imported, never what is computed.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager


def lean_imports() -> None:
    """Call first thing in a worker process, before transformers loads its generation utilities."""
    if "transformers.generation" in sys.modules:  # too late: it has imported scikit-learn already
        return
    import transformers.utils
    import transformers.utils.import_utils as import_utils

    def absent() -> bool:
        return False

    import_utils.is_sklearn_available = absent  # what `transformers.generation` asks, by either name
    transformers.utils.is_sklearn_available = absent


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


def import_deepspeed():
    """DeepSpeed, imported lean, with its JIT-built ops looked for in the venv (`isolate_jit_builds`) and its
    accelerator chosen from the device Ray gave this process (`devices.set_accelerator`)."""
    from stages.common.deepspeed import isolate_jit_builds
    from stages.common.devices import set_accelerator

    isolate_jit_builds()
    set_accelerator()
    lean_imports()
    with _hidden("mlflow"):
        import deepspeed
    return deepspeed
