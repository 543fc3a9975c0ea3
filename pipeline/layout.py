"""Where a run's artifacts live and what makes one whole: the layout, manifests, and swapping directories.

The artifact store (`pipeline.storage`) is built on these; they are spelled here once and used nowhere
else in another spelling:

- **Layout**: `artifacts/<stage>/<key>` (a finished artifact), `artifacts/<stage>/.staging/<key>` (where a
  stage builds), `artifacts/<stage>/.old/<key>` (a copy set aside during a two-rename swap),
  `checkpoints/<stage>/<key>`; `manifest.json` inside an artifact.
- **Manifests, pure**: the size and SHA-256 of every file (`file_records`), what makes a manifest unusable
  for a key, and whether a copy's files still match their manifest (`damage`).
- **Local swaps**: putting a new directory where a finished one is, with no moment without a good copy
  (`replace_dir`: one `renameat2(RENAME_EXCHANGE)` where the filesystem has it, else two renames whose failure
  puts the old copy back).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

from pipeline.artifacts import sha256_file
from pipeline.bucket import safe_relative
from pipeline.errors import StorageError

MANIFEST = "manifest.json"
ARTIFACTS = "artifacts"
STAGING = ".staging"  # artifacts/<stage>/.staging/<key>: where a stage builds (its name is still the key)
# What `_publish` names a bucket copy: one directory right under its artifact's prefix, `copy-<time>-<id>`.
COPY_NAME = re.compile(r"copy-[0-9A-Za-z-]+")
ASIDE = ".old"  # artifacts/<stage>/.old/<key>: a finished copy set aside during a two-rename swap



# --------------------------------------------------------------------------- layout (spelled once)


def artifact_rel(stage: str, key: str) -> str:
    """Where an artifact lives, relative to run_dir and to the bucket prefix."""
    return f"{ARTIFACTS}/{stage}/{key}"


def artifact_dir(run_dir: Path, stage: str, key: str) -> Path:
    return Path(run_dir) / artifact_rel(stage, key)


def checkpoint_dir(run_dir: Path, stage: str, key: str) -> Path:
    """Training checkpoints of one key, kept across attempts (a rerun of the same key resumes)."""
    return Path(run_dir) / "checkpoints" / stage / key


def artifact_of(path: str | Path, run_dir: Path) -> tuple[str, str, Path] | None:
    """(stage, key, path inside the artifact) of a path in run_dir's finished artifacts, else None."""
    try:
        parts = Path(path).relative_to(Path(run_dir) / ARTIFACTS).parts
    except ValueError:
        return None
    if len(parts) < 2 or parts[1].startswith("."):  # staging and set-aside copies are not artifacts
        return None
    return parts[0], parts[1], Path(*parts[2:]) if len(parts) > 2 else Path()


def output_paths(manifest: dict, out_dir: Path) -> dict[str, Path]:
    """Outputs recorded relative to the artifact dir resolve against it; external paths stay."""
    return {name: (out_dir / p) if not Path(p).is_absolute() else Path(p) for name, p in manifest["outputs"].items()}


# --------------------------------------------------------------------------- manifests, pure


def file_records(out_dir: Path, hasher=sha256_file) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of everything a stage wrote: what its manifest vouches for."""
    records = {}
    for f in sorted(out_dir.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            records[str(f.relative_to(out_dir))] = {"size": f.stat().st_size, "sha256": hasher(f)}
    return records


def manifest_problem(manifest, key: str, in_bucket: bool = False) -> str | None:
    """What makes a manifest unusable for `key` (not ours, no content hashes, outputs that leave the
    artifact), or None. A bucket manifest must name only paths inside its artifact: one written by
    another machine cannot point this one at its files."""
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return "its manifest is unreadable or belongs to another key"
    files, outputs = manifest.get("files"), manifest.get("outputs")
    if not isinstance(files, dict) or not isinstance(outputs, dict):
        return "its manifest lists no files or outputs"
    if any(not isinstance(r, dict) or "sha256" not in r for r in files.values()):
        return "its manifest has no content hash for every file (made by an older version of the pipeline)"
    names = [*files, *(outputs.values() if in_bucket else [p for p in outputs.values() if not Path(p).is_absolute()])]
    for name in names:
        try:
            safe_relative(str(name), "manifest")
        except StorageError:
            return f"its manifest names {name!r}, a path outside the artifact"
    return copy_problem(manifest.get("copy")) if in_bucket else None


def copy_problem(copy) -> str | None:
    """Why a bucket manifest's `copy` is not a copy directory of its artifact, or None.

    Its files are read from (and pulled into run_dir out of) `<artifact>/<copy>/`, so `copy` must be one
    name of the form `_publish` writes: '../../other', '/abs' or 'a/b' would point this machine at objects
    outside the artifact, which a manifest written elsewhere must not be able to do."""
    if not isinstance(copy, str):
        return "its bucket manifest names no copy (made by an older version of the pipeline)"
    if not COPY_NAME.fullmatch(copy):
        return (f"its bucket manifest names copy {copy!r}, not a copy directory of the artifact (one name, "
                "copy-<time>-<id>): a path that could leave the artifact is refused")
    return None


def damage(manifest: dict, out_dir: Path, hasher=sha256_file) -> str | None:
    """What on disk no longer matches the manifest's file records (missing, resized, edited), or None."""
    for rel, rec in manifest["files"].items():
        f = out_dir / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != rec["size"]:
            return f"{rel} has {size} bytes, {rec['size']} when it was made"
        if hasher(f) != rec["sha256"]:
            return f"{rel} changed after it was made (its SHA-256 differs)"
    return None


# --------------------------------------------------------------------------- local swaps


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories in one step (Linux `renameat2(RENAME_EXCHANGE)`); OSError where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def replace_dir(new: Path, dest: Path, aside: Path) -> None:
    """Put directory `new` at `dest`, with no moment where `dest` is absent when it existed.

    One atomic exchange where the filesystem offers it; otherwise `dest` goes to `aside`, `new` to
    `dest`, and a failure of the second rename puts `aside` back before raising. The old copy is
    deleted last."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        os.replace(new, dest)
        return
    try:
        _exchange(new, dest)
        shutil.rmtree(new, ignore_errors=True)  # it holds the old copy now
        return
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)
    aside.parent.mkdir(parents=True, exist_ok=True)
    os.replace(dest, aside)
    try:
        os.replace(new, dest)
    except BaseException:
        os.replace(aside, dest)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _clear(directory: Path) -> None:
    """Remove a work directory, its manifest first (a half-deleted directory is never finished)."""
    if directory.exists():
        (directory / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(directory)
