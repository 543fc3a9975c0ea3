"""Upstream defect: Ray Train's local mode (a one-rank stage run in the driver, stages/common/in_process.py) leaves
its train-function utilities set after the loop: this process would then pass for a Train worker (`ray.train`'s
`get_context` and reports answer as in a worker).

Targets: Ray 2.60 (`ray.train.v2._internal.execution.train_fn_utils.set_train_fn_utils`, private). No upstream
issue filed from here.
Removable when: the local controller clears them itself; the test that says so is
`tests/test_upstream.py::test_ray_train_local_mode_still_leaves_its_train_fn_utils_set`.
"""

from __future__ import annotations


def forget_train_session() -> None:
    """Clear what Ray Train's local mode left set (nothing to do with a Ray that has no such utilities)."""
    try:
        from ray.train.v2._internal.execution.train_fn_utils import set_train_fn_utils
    except ImportError:  # another Ray: nothing of this kind to clear
        return
    set_train_fn_utils(None)
