"""The installed stack works here: Ray runs tasks and actors.

The rest of the stack is shown working where the pipeline uses it: MLflow by test_mlflow_server.py and
the CLI end-to-end tests; vLLM (CPU) giving HF's greedy answers by
tests/test_sft_stage.py::test_vllm_engines_answer_the_held_out_prompts_as_hf_generate_does; DeepSpeed
ZeRO-2 training on CPU by tests/test_sft_stage.py (loss falls, ZeRO 0/2/3 agree, an interrupted run
resumes exactly) and resuming only from safe checkpoints by
tests/test_training_units.py::test_deepspeed_resumes_only_from_safe_checkpoints_whichever_checkpoint_engine_is_configured.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_ray_runs_tasks_and_actors(ray_local):
    import ray

    @ray.remote
    def square(x):
        return x * x

    @ray.remote
    class Counter:
        def __init__(self):
            self.n = 0

        def add(self, k):
            self.n += k
            return self.n

    assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
    counter = Counter.remote()
    assert ray.get([counter.add.remote(2), counter.add.remote(3)]) == [2, 5]


def test_a_worker_finds_its_own_cluster_while_another_ray_runs_on_the_machine(ray_local):
    """Issue 59, item 1: Ray Train's PlacementGroupCleaner asks the state API for its controller with no
    address, and Ray's auto-detection, with a second run's Ray on the machine, raised `Found multiple active
    Ray instances` in it. `cluster.init_local` (what a run and `ray_local` start) gives every worker of the
    job RAY_ADDRESS = its own GCS, an actor with its own env_vars (as Ray Train's controller has) too."""
    import subprocess
    import sys

    import ray

    other = subprocess.Popen(
        [sys.executable, "-c", "import ray, sys; ray.init(num_cpus=1, include_dashboard=False, "
         "log_to_driver=False); print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        other_address = other.stdout.readline().strip()
        own = ray.get_runtime_context().gcs_address
        assert other_address and other_address != own

        @ray.remote
        def found() -> str:
            from ray._private.services import canonicalize_bootstrap_address_or_die

            try:
                return canonicalize_bootstrap_address_or_die(None)  # what ray.util.state does without an address
            except ConnectionError as exc:
                return str(exc)

        @ray.remote(num_cpus=0, runtime_env={"env_vars": {"PIPELINE_TEST": "1"}})
        class Controller:
            def found(self) -> str:
                return ray.get(found.remote())

        assert ray.get(found.remote()) == own
        assert ray.get(Controller.remote().found.remote()) == own
    finally:
        other.stdin.close()
        other.wait(60)
