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

Both are measured in bench/RESULTS.md (start-up). They change what is imported, never what is computed. Each
is an upstream defect worked around in its own module, with the version it targets and the test that says when
it can go: pipeline/upstream/transformers_sklearn.py and deepspeed_mlflow.py.
"""

from __future__ import annotations


def lean_imports() -> None:
    """Call first thing in a worker process, before transformers loads its generation utilities."""
    from pipeline.upstream.transformers_sklearn import hide_sklearn

    hide_sklearn()


def import_deepspeed():
    """DeepSpeed, imported lean, with its JIT-built ops looked for in the venv (`isolate_jit_builds`) and its
    accelerator chosen from the device Ray gave this process (`devices.set_accelerator`)."""
    from stages.common.devices import set_accelerator
    from pipeline.upstream.deepspeed_mlflow import import_without_mlflow
    from pipeline.upstream.torch_extensions import isolate_jit_builds

    isolate_jit_builds()
    set_accelerator()
    lean_imports()
    return import_without_mlflow()
