"""Every Ray worker of a run addresses the run's own cluster, however many others run on the machine.

Parts of Ray look their cluster up from scratch inside a worker: Ray Train's PlacementGroupCleaner asks
the state API whether its controller lives (`ray.util.state.get_actor`, address None), and that
auto-detection reads RAY_ADDRESS, else lists every GCS process on the machine. With a second run's
Ray on the same machine it raised `ConnectionError: Found multiple active Ray instances` in the
cleaner, whose traceback reached the console, and the cleaner that would remove a dead run's
placement groups never ran (issue 59, item 1).

Ray has no option to give a local instance's workers its own address: the address is chosen by
`ray.init`, after the job's runtime_env is fixed, and RAY_ADDRESS set before `ray.init` would make
it join instead of start. So the job's runtime_env names `worker_process_setup_hook`, which Ray runs
in every worker of the job before its first task, and the hook sets RAY_ADDRESS to the GCS the
worker is connected to. Ray merges a task's or actor's own env_vars with the job's, which carry the
hook, so Ray Train's controller, its workers and Serve's replicas all get it.

This module imports nothing of the project: each worker process imports it at start-up.
"""

from __future__ import annotations

import os

HOOK = "pipeline.own_cluster.address_own_cluster"


def address_own_cluster() -> None:
    """Worker set-up hook: RAY_ADDRESS is the GCS this worker is connected to (its own run's cluster)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    if address:
        os.environ["RAY_ADDRESS"] = address


def with_hook(runtime_env: dict | None) -> dict:
    """`runtime_env` with the hook added: the job's runtime_env of every `ray.init` a run makes."""
    return {**(runtime_env or {}), "worker_process_setup_hook": HOOK}
