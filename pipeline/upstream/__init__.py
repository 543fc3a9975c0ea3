"""Workarounds for defects and gaps in the libraries we build on: one module per upstream defect, each naming the
version it targets, the upstream issue where one exists, and the test in tests/test_upstream.py that fails when the
workaround can be removed (the defect is gone, or the private name it relies on has moved).

    deepspeed_loads.py       DeepSpeed unpickles checkpoints with weights_only=False: every load allow-listed
    deepspeed_groups.py      DeepSpeed keeps its world-group clone after torch's destroy_process_group
    deepspeed_mlflow.py      `import deepspeed` imports MLflow (~2 s a process): imported with MLflow hidden
    torch_extensions.py      torch shares one JIT build directory between environments, runs any ninja on PATH
    transformers_sklearn.py  transformers.generation imports scikit-learn eagerly (~2 s a process)
    ray_train_sigint.py      Ray Train's fit keeps its controller alive in a SIGINT handler and swallows Ctrl-C
    ray_train_session.py     Ray Train's local mode leaves its train-function utilities set
    ray_llm_private.py       Ray Serve LLM's names with no public export (ray.llm._internal), imported here only
    ray_private.py           Ray core's and Serve's names with no public export (ray._private), imported here only

Nothing outside this folder patches a library or imports its private modules (tests/test_upstream.py checks it).
It sits in pipeline/ so that the framework and the stages both reach it; it names no stage.
"""
