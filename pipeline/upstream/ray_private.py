"""Upstream gap: Ray core and Serve have no public name for four things the framework and the serve stage need, so
they are imported from `ray._private` / `ray.serve._private`, here and nowhere else.

- `global_worker_stdstream_dispatcher` (`ray._private.ray_logging`): where Ray's forwarded worker output is printed;
  the console takes it over so each worker's lines reach its stage's log file with the worker's name
  (pipeline/console.py), not the terminal;
- `filter_autoscaler_events` (`ray._private.worker`): the autoscaler's status table reduced to its events, as Ray's
  own printer does;
- `global_node` (`ray._private.worker._global_node`): the processes `ray.init` started here, so the run ends
  exactly those (pipeline/cluster.py: PIDs, never `ray stop`);
- `SERVE_CONTROLLER_NAME`, `SERVE_NAMESPACE` (`ray.serve._private.constants`): whether Serve already runs on the
  cluster (its controller actor), so the serve stage shuts Serve down only if it started it.

Targets: Ray 2.60 (the module paths below). No upstream issue filed from here.
Removable, name by name, when Ray exports it; the test that says so is
`tests/test_upstream.py::test_ray_still_lacks_public_names_for_what_the_framework_uses` (it also fails when a path
below moves).
"""

from __future__ import annotations

import importlib

# name here -> (private module, its name there); imported on first use
PRIVATE = {
    "global_worker_stdstream_dispatcher": ("ray._private.ray_logging", "global_worker_stdstream_dispatcher"),
    "filter_autoscaler_events": ("ray._private.worker", "filter_autoscaler_events"),
    "SERVE_CONTROLLER_NAME": ("ray.serve._private.constants", "SERVE_CONTROLLER_NAME"),
    "SERVE_NAMESPACE": ("ray.serve._private.constants", "SERVE_NAMESPACE"),
}


def global_node():
    """The Ray node this process started with `ray.init` (its processes, its session directory), or None."""
    from ray._private import worker

    return worker._global_node


def __getattr__(name: str):
    if name not in PRIVATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = PRIVATE[name]
    return getattr(importlib.import_module(module), attribute)
