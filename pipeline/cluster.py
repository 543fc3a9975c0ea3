"""Ray connection: start a local instance for the run, or join a cluster.

Only stages that need Ray call `ensure_ray` (through `ctx.ray()`), so a fully cached rerun never
starts it. A local instance oversubscribes logical CPUs on purpose (DESIGN.md §2.6): rollout
engines, trainer workers and Serve replicas each reserve a CPU, and on a 2-core machine an exact
count would leave work waiting forever. On a cluster, Ray's own resources are used as they are.
"""

from __future__ import annotations

import os


def ensure_ray(ray_cfg) -> bool:
    """Connect to Ray if not connected yet; True if this call started (and so must stop) it."""
    import ray

    if ray.is_initialized():
        return False
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            from pipeline.errors import UserError

            raise UserError(f"ray.address: cannot connect to the Ray cluster at {address!r} ({exc}); start it with "
                            "`ray start --head`, fix ray.address / RAY_ADDRESS, or leave both empty for a local Ray") from None
    else:
        gib = ray_cfg.object_store_memory_gb
        ray.init(
            num_cpus=ray_cfg.local_num_cpus(),
            object_store_memory=int(gib * 2**30) if gib else None,
            # The dashboard process also serves Ray's state API, which Ray Train's controller polls.
            include_dashboard=True,
        )
    return True


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
