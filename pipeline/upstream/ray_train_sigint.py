"""Upstream defect: Ray Train V2's `DataParallelTrainer.fit` installs a SIGINT handler on the driver that closes over
its TrainController's handle and is never taken back.

It kept each stage's controller alive after its fit (~400 MB) until the next stage's fit replaced the handler, which
then let the controller go out of scope: a graceful exit that, if it blocks, leaves the process running past
`ray.shutdown()`, reparented to init (issue 48, item 8; `pipeline.cluster.shutdown_ray` ends such stragglers). And
it swallowed Ctrl-C: the first one aborted the controller, which the driver saw as SystemExit(1) from `ray.get`
(exit 1, not 130); after the stage the aborts went to a finished controller and the run went on.

Targets: Ray 2.60 (`ray.train.v2.api.data_parallel_trainer.DataParallelTrainer._register_sigint_handler`, private).
No upstream issue filed from here.
Removable when: fit no longer installs the handler (then the hook below is never called and the controller must be
ended another way); the test that says so is
`tests/test_upstream.py::test_ray_train_fit_still_registers_its_sigint_handler`.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def controllers_ended(trainer):
    """Inside: the trainer's SIGINT hook keeps the controller's handle here instead, so Python's own SIGINT handling
    (KeyboardInterrupt: the runner's cleanup, exit 130) stays. On leaving, returned or raised: the controller is killed
    (`ray.kill`: no graceful exit to block; its workers, which it owns, go with it)."""
    import ray

    controllers: list = []
    trainer._register_sigint_handler = controllers.append  # called with the controller, on the main thread only
    try:
        yield controllers
    finally:
        for controller in controllers:
            try:
                ray.kill(controller)
            except Exception:  # noqa: BLE001 - Ray already gone (a failed run's shutdown): nothing left to kill
                pass
