"""Upstream defect: DeepSpeed caches its clone of the world process group, and only its own
`deepspeed.comm.destroy_process_group` releases it.

Ray Train's local controller (a one-rank stage run in the driver, stages/common/in_process.py) destroys the group
itself when the loop succeeds, with torch's call, not DeepSpeed's. DeepSpeed's clone stays cached, and the next
engine in this process broadcast over it ("Group ... is not registered").

Targets: DeepSpeed 0.19 (`deepspeed.utils.groups._release_process_group_references`, private; there is no public
call). No upstream issue filed from here.
Removable when: torch's `destroy_process_group` leaves DeepSpeed no stale group; the test that says so is
`tests/test_upstream.py::test_deepspeed_still_keeps_its_world_group_after_torch_destroys_it`.
"""

from __future__ import annotations


def release_cached_groups() -> None:
    """Drop every process group DeepSpeed holds (after the world group was destroyed, by whichever call)."""
    from deepspeed.utils import groups

    groups._release_process_group_references(None)
