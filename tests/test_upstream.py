"""The upstream room (pipeline/upstream/; issue 69, item 4): each module works around one defect of a library
we pin, and each has a test here that FAILS when the defect is gone (or the private name it relies on has moved):
that failure is the signal to remove the workaround, not to patch the test. The room is also the only place that
patches a library or imports a private module, and each module says what it targets and which test guards it."""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOM = ROOT / "pipeline" / "upstream"


def _room_modules() -> list[Path]:
    return sorted(p for p in ROOM.glob("*.py") if p.name != "__init__.py")


def test_each_workaround_names_its_target_version_and_a_test_here_that_exists():
    tests_here = {node.name for node in ast.parse(Path(__file__).read_text()).body if isinstance(node, ast.FunctionDef)}
    index = (ROOM / "__init__.py").read_text()
    assert len(_room_modules()) >= 9
    for path in _room_modules():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert re.search(r"Targets: \w[\w ]* \d+\.\d+", doc), f"{path.name}: no 'Targets: <library> <version>'"
        named = re.findall(r"tests/test_upstream\.py::(\w+)", doc)
        assert named and set(named) <= tests_here, f"{path.name}: names no test of this file ({named})"
        assert path.name in index, f"{path.name} is missing from the room's index (upstream/__init__.py)"


# What only the room may do: replace a library's function, call or override its private members, import its
# private modules. Found by these spellings in pipeline/ and stages/ outside the room.
_PATCHES = (r"\._internal\b", r"\._private\b", r"torch\.load\s*=", r"_register_sigint_handler", r"is_sklearn_available",
            r"_release_process_group_references", r"set_train_fn_utils", r"TORCH_EXTENSIONS_DIR")


def test_nothing_outside_the_room_patches_a_library_or_imports_its_private_modules():
    found = []
    for path in [*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("stages/**/*.py")]:
        if ROOM in path.parents:
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {p}" for p in _PATCHES if re.search(p, text)]
    assert found == []


# --------------------------------------------------------------------------- each defect, still there


def _fresh(code: str) -> str:
    """The last line `code` prints in a fresh interpreter of this environment (a library's imports as a worker makes
    them: the CPU accelerator, no venv on PATH)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_deepspeed_still_unpickles_checkpoints_with_weights_only_false():
    """deepspeed_loads.py: DeepSpeed's default checkpoint engine unpickles anything (its guard's behaviour on every
    load path: tests/test_training_units.py)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    assert "weights_only=False" in inspect.getsource(TorchCheckpointEngine.load)


def test_torch_extensions_still_share_one_build_root(monkeypatch):
    """torch_extensions.py: torch's default JIT build root is the same for every Python environment."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert sys.prefix not in cpp_extension.get_default_build_root()


@pytest.mark.slow  # a fresh interpreter importing DeepSpeed and transformers' generation utilities: ~8 s
def test_transformers_generation_still_imports_sklearn_eagerly():
    """transformers_sklearn.py (and deepspeed_mlflow.py, in the same fresh process, in the next test's name): the two
    imports the lean start-up leaves out still happen without it (with it: tests/test_startup_units.py)."""
    code = ("import json, sys\nimport deepspeed\nafter_deepspeed = 'mlflow' in sys.modules\n"
            "from transformers import LlamaForCausalLM  # noqa: F401 - what loads the generation utilities\n"
            "print(json.dumps({'mlflow': after_deepspeed, 'sklearn': 'sklearn' in sys.modules}))\n")
    imported = json.loads(_fresh(code))
    assert imported["sklearn"], "transformers.generation no longer imports scikit-learn: remove transformers_sklearn.py"
    _MLFLOW_SEEN.append(imported["mlflow"])


_MLFLOW_SEEN: list[bool] = []


@pytest.mark.slow  # shares the fresh interpreter of the test above when both run; starts its own otherwise
def test_deepspeed_still_imports_mlflow():
    """deepspeed_mlflow.py: a plain `import deepspeed` imports MLflow."""
    if not _MLFLOW_SEEN:
        _MLFLOW_SEEN.append(_fresh("import sys, deepspeed; print('mlflow' in sys.modules)") == "True")
    assert _MLFLOW_SEEN[0], "import deepspeed no longer imports mlflow: remove deepspeed_mlflow.py"


@pytest.mark.slow  # a fresh interpreter with a gloo process group and DeepSpeed's comm: ~8 s
def test_deepspeed_still_keeps_its_world_group_after_torch_destroys_it():
    """deepspeed_groups.py: after torch's own destroy_process_group (Ray Train's local mode calls it), DeepSpeed's
    clone of the world group is still cached; the workaround releases it."""
    code = ("import json\nfrom pipeline.upstream.torch_extensions import isolate_jit_builds\nisolate_jit_builds()\n"
            "import torch.distributed as dist\nimport deepspeed.comm\nfrom deepspeed.utils import groups\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "deepspeed.comm.init_distributed(dist_backend='gloo', auto_mpi_discovery=False)\n"
            "groups._clone_world_group()\ndist.destroy_process_group()\nstale = groups._WORLD_GROUP is not None\n"
            "from pipeline.upstream.deepspeed_groups import release_cached_groups\nrelease_cached_groups()\n"
            "print(json.dumps({'stale': stale, 'released': groups._WORLD_GROUP is None}))\n")
    seen = json.loads(_fresh(code))
    assert seen["stale"], "DeepSpeed now forgets a group torch destroyed: remove deepspeed_groups.py"
    assert seen["released"]


def test_ray_train_fit_still_registers_its_sigint_handler():
    """ray_train_sigint.py: Ray Train's fit still hands its controller to `_register_sigint_handler`; with the
    workaround the handle lands in our list and the controller is killed when fit returns or raises."""
    from ray.train.v2.api import data_parallel_trainer

    assert "self._register_sigint_handler(controller)" in inspect.getsource(data_parallel_trainer.DataParallelTrainer)


def test_the_sigint_workaround_kills_each_controller_when_fit_returns_or_raises(monkeypatch):
    import ray

    from pipeline.upstream.ray_train_sigint import controllers_ended

    killed = []
    monkeypatch.setattr(ray, "kill", killed.append)

    class Trainer:
        def fit(self):
            self._register_sigint_handler("controller-1")  # what Ray Train's fit does with its controller
            raise RuntimeError("the loop failed")

    trainer = Trainer()
    with pytest.raises(RuntimeError, match="loop failed"), controllers_ended(trainer):
        trainer.fit()
    assert killed == ["controller-1"]


def test_ray_train_local_mode_still_leaves_its_train_fn_utils_set():
    """ray_train_session.py: after Ray Train's local controller ran a loop, its train-function utilities are still
    set (this process would pass for a worker); the workaround clears them."""
    from ray.train.v2._internal.execution.local_mode.utils import LocalController
    from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils

    from pipeline.upstream.ray_train_session import forget_train_session

    LocalController("upstream-probe").run(lambda: None)
    try:
        assert get_train_fn_utils() is not None
    finally:
        forget_train_session()
    with pytest.raises(RuntimeError, match="not initialized"):
        get_train_fn_utils()


def test_ray_serve_llm_still_lacks_public_names_for_what_serve_uses():
    """ray_llm_private.py: every private name still imports from where the room says, and `ray.serve.llm` (with its
    public submodules) exports none of them yet; once one is public, import it from there."""
    import importlib
    import pkgutil

    import ray.serve.llm

    from pipeline.upstream import ray_llm_private

    public = [ray.serve.llm, *(importlib.import_module(m.name)
                               for m in pkgutil.iter_modules(ray.serve.llm.__path__, "ray.serve.llm."))]
    for name, (module, attribute) in ray_llm_private.PRIVATE.items():
        assert getattr(ray_llm_private, name) is getattr(importlib.import_module(module), attribute)
        exported = [m.__name__ for m in public if hasattr(m, attribute)]
        assert not exported, f"{attribute} is public in {exported}: import it from there, drop it from the room"
    with pytest.raises(AttributeError, match="no attribute"):
        ray_llm_private.not_a_name  # noqa: B018


def test_ray_still_lacks_public_names_for_what_the_framework_uses():
    """ray_private.py: every private name still imports from where the room says, and neither `ray` nor `ray.serve`
    nor `ray.util` exports it; once one does, import it from there."""
    import importlib

    import ray
    import ray.serve
    import ray.util

    from pipeline.upstream import ray_private

    for name, (module, attribute) in ray_private.PRIVATE.items():
        assert getattr(ray_private, name) is getattr(importlib.import_module(module), attribute)
        exported = [m.__name__ for m in (ray, ray.serve, ray.util) if hasattr(m, attribute)]
        assert not exported, f"{attribute} is public in {exported}: import it from there, drop it from the room"
    from ray._private import worker

    assert ray_private.global_node() is worker._global_node and not hasattr(ray, "_global_node")
