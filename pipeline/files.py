"""Files written whole or not at all, and content hashes memoised on (size, mtime).

Why a module of their own: the artifact store (pipeline/storage.py), the cache keys (pipeline/artifacts.py) and the
stages' own checkpoint records (`latest.json`) all need a JSON file that a reader sees whole or not at all, and a
multi-GB checkpoint hashed once. A crash mid-write leaves the old file, never a part of the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
