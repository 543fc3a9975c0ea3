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
