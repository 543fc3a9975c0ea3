"""Upstream defect: torch keeps every environment's JIT-built extensions in one directory and runs whichever
`ninja` comes first on PATH.

Targets: torch 2.13 (`torch.utils.cpp_extension`: `TORCH_EXTENSIONS_DIR`, else `get_default_build_root()`,
`~/.cache/torch_extensions`, the same for every Python environment), with DeepSpeed 0.19's JIT ops (CPU Adam, the
shared-memory allreduce). No upstream issue: it is torch's documented default, harmful only to several checkouts on
one machine.
Removable when: torch's default build root depends on the environment (`sys.prefix`); the test that says so is
`tests/test_upstream.py::test_torch_extensions_still_share_one_build_root`.
"""

from __future__ import annotations


def isolate_jit_builds() -> None:
    """Build DeepSpeed's JIT ops (CPU Adam, shared-memory allreduce) in a directory of this Python
    environment, unless the user chose one (`TORCH_EXTENSIONS_DIR`). Call it in a worker before
    DeepSpeed builds anything.

    Why: torch keeps every environment's builds in one `~/.cache/torch_extensions`, and a build
    whose command differs (another checkout's venv path) rewrites it: two checkouts on one
    machine recompiled both ops for each other, 100-140 s on 2 cores at the start of a training
    stage, every time the other one had run. Torch also runs whichever `ninja` comes first on
    PATH, and the venv's (pip's ninja 1.13) and the system's (1.11) read each other's build log
    as stale: processes with and without the venv's bin directory on PATH (Ray workers of
    different launches) kept rebuilding the same ops. The venv's ninja is put first."""
    import os
    import sys
    from pathlib import Path

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if path[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *[p for p in path if p != bin_dir]])
