"""Where the ppo stage's roles and engines run: a layout is a module implementing `Layout`.

    separate.py    every role on ranks of its own (a `ModelGroup` each) and `rollout.num_engines` engine actors
                   (`EnginePool`); the weights reach the engines through the object store, or NCCL
    colocated.py   one actor per policy rank (`ColocatedRank`, colocated_rank.py) holding every role and its own
                   vLLM engine; the weights reach the engine in the same process

The loop (`stages/ppo/__init__.py`), the set-up (`roles.start`) and the config ask the layout and never which one
it is: what it places and refuses at validation (class methods, light: `pipeline validate` imports no torch or
Ray through them) and, once started, how rollouts are launched, how weights are synced, what a failed generation
restarts in place and how everything ends. The peers draw the same seam: verl's `ResourcePoolManager` and its
hybrid engine, OpenRLHF's `colocate_all_models` against separate vLLM actors.

One restart path for both (`lost`): a process that dies outside what the layout restarts in place (a dead engine
of the separate layout, `retrying`) takes training state with it, so the stage starts its processes again and
resumes from the last checkpoint, at most `MAX_RESTARTS` times.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

MAX_RESTARTS = 2  # a process that dies again and again is a bug to report, not to retry forever


class Layout(Protocol):
    """The protocol both layouts implement. Class methods plan (validation, placement); the rest runs the stage."""

    name: str  # its value of `stages.ppo.layout`
    gpu_memory_share: float  # an engine's gpu_memory_utilization when rollout.gpu_memory_utilization is unset
    restarts: int  # engines restarted in place so far (the metric engine_restarts)

    # ------------------------------------------------------------------ planning (no processes)

    @classmethod
    def refuse(cls, cfg) -> None:
        """Raise ValueError, naming the key and the fix, for what this layout cannot run."""

    @classmethod
    def ranks(cls, cfg, role) -> int:
        """How many ranks `role` has in this layout."""

    @classmethod
    def reference_in_ranks(cls, cfg) -> bool:
        """Whether each policy rank holds a frozen reference copy (then the reference has no ranks of its own)."""

    @classmethod
    def bundles(cls, cfg, gpu: bool) -> dict[str, list[dict[str, float]]]:
        """Each process group's placement bundles (`{"CPU": n, "GPU": share}`), as the stage asks Ray for them."""

    @classmethod
    def describe(cls, cfg, roles_note: str) -> str:
        """The progress line announcing what starts."""

    # ------------------------------------------------------------------ running

    def start(self, s, roles: list[tuple], engine, gpu: bool, seed: int, run_storage) -> None:
        """Request every process at once (nothing blocks) and fill `s.groups` (`s`, the stage's `roles.Session`):
        role name -> a group answering `run`, `run_each`, `get` and `__len__` as `ModelGroup` does. `roles`: (name,
        role config, kind, model directory, trainable); `engine`: the `EngineSpec` the layout's engines start from."""

    def ready(self, clock) -> dict[str, int]:
        """Wait until every role has loaded its model and every engine answers (clock parts `roles`, `engines`);
        each role's parameter count."""

    def processes(self) -> dict[str, list]:
        """The stage's actors by kind, for the start-up line's details and `startup_processes`."""

    def rollouts(self, prompts: list[dict], sampling: dict, episode=None) -> list:
        """Launch the generation of `prompts` (rows, one per prompt) for training; one ref per policy rank, each
        resolving to its share's samples per prompt, in order. Returns at once."""

    def generate(self, rows: list[dict], sampling: dict, episode=None, say=print) -> list[list[dict]]:
        """Every row's samples from the engines' current weights (held-out evaluation), per prompt, in order."""

    def retrying(self, call: Callable[[], Any], say=print, since: int | None = None):
        """`call()` (a generation), made again after what this layout restarts in place; `since`: `restarts` when
        the request `call` collects was sent."""

    def kill_engine(self, index: int) -> None:
        """Fault drills: kill engine `index` and return once Ray reports it dead."""

    def sync_weights(self, version: int) -> tuple[float, int]:
        """The policy's current weights into every engine, tagged `version`: (the slowest load's seconds, bytes)."""

    def close(self) -> None:
        """End every process the layout started, whatever state they are in."""


def layout_of(cfg) -> type[Layout]:
    """The class implementing `cfg.layout` (a PPOConfig's)."""
    from stages.ppo.layouts.colocated import Colocated
    from stages.ppo.layouts.separate import Separate

    return {"separate": Separate, "colocated": Colocated}[cfg.layout]


def lost(exc: BaseException) -> bool:
    """Whether `exc` means a process of the stage died (any call on a dead actor raises RayActorError): the stage
    starts again from the last checkpoint. An error raised by code in a live process is not."""
    import ray

    return isinstance(exc, ray.exceptions.RayActorError)
