"""Reading Parquet through Ray Data with a footer-reader pool sized to the files read.

Ray Data 2.60's Parquet reader (datasource V2) starts a pool of `FooterReader` actors on every
execution to read file footers: 32 by default (`RAY_DATA_PARQUET_FOOTER_NUM_ACTORS`). Each actor is
a Python process; on a 2-core machine starting 32 of them takes ~19 s, far longer than reading the
few small files a pipeline artifact holds, and it happens for every pass over a dataset. More
readers than files cannot help, so the pool is capped at the file count. A user's own
`RAY_DATA_PARQUET_FOOTER_NUM_ACTORS` wins; remote URIs (`s3://...`) keep Ray's default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.run_storage import RunStorage

ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
RAY_DEFAULT_READERS = 32


def footer_readers(path: str | Path | list[Path]) -> int | None:
    """Footer readers worth starting for a local file, directory or list of files; None for remote URIs."""
    if isinstance(path, list):
        return max(1, min(RAY_DEFAULT_READERS, len(path)))
    if "://" in str(path):
        return None
    p = Path(path)
    files = sum(1 for _ in p.rglob("*.parquet")) if p.is_dir() else 1
    return max(1, min(RAY_DEFAULT_READERS, files))


def read_parquet(path: str | Path | list[Path], run_storage: RunStorage | None = None):
    """`ray.data.read_parquet(path)` (a path, or a list of files), with the footer-reader pool sized by `footer_readers`.

    A path of the run's artifacts is read from the bucket when `run_storage` has one, so read tasks
    work on any node. Ray reads the pool setting when the read is planned (here, in the caller), so
    it is set only around this call and the caller's environment is left as it was."""
    import ray.data

    where, fs = run_storage.target(path) if run_storage is not None else (str(path), None)
    if fs is not None:
        return ray.data.read_parquet(where, filesystem=fs)
    readers = footer_readers(path)
    where = [str(p) for p in path] if isinstance(path, list) else str(path)
    if readers is None or ENV in os.environ:
        return ray.data.read_parquet(where)
    os.environ[ENV] = str(readers)
    try:
        return ray.data.read_parquet(where)
    finally:
        del os.environ[ENV]


def read_rows(path: Path, limit: int | None = None) -> list[dict]:
    """The rows of a (small) Parquet directory as dicts, in file order; the first `limit` only when
    given (0: none). For what a driver reads whole: prompt lists, held-out examples."""
    import pyarrow.parquet as pq

    files = sorted(Path(path).glob("*.parquet"))
    if not files or limit == 0:
        return []
    rows = pq.ParquetDataset(files).read().to_pylist()
    return rows if limit is None else rows[:limit]
