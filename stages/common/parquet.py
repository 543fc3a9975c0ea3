"""Reading Parquet: the schema check run before reading a file the run did not write, and Ray Data's reader
with a footer-reader pool sized to the files read.

**Extension types are refused unread.** An extension type is a Python library's own column type; reading its
values runs that library's code, and Ray's `ray.data.arrow_pickled_object` (registered by `import ray.data`)
unpickles each value, so a crafted file runs code on whoever reads it. `schema_problem` names the first column
of an extension type not allowed, from the schema alone (the types' constructors, never a value). The readers
of files a run did not write call it before reading any data: the data stage's and batch inference's (a
user's files, where no extension type is allowed: `stages.data.safe_read`), and `read_rows` here (held-out
prompts, another run's too with `pipeline compare`, where `SAFE_EXTENSION_TYPES` are: Ray's tensor types,
whose metadata is JSON and whose values are numbers). It holds whatever this process has imported, unless
Ray is told to unpickle tensor types' metadata (`RAY_DATA_AUTOLOAD_CLOUDPICKLE_TENSOR_METADATA=1`, an
opt-in Ray documents as unsafe for untrusted files): the schema read itself would then run it.

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
# Extension types a run's own artifacts may hold: Ray Data writes ndarray columns as these (shape and dtype as
# JSON metadata, numeric storage; reading one runs no pickle).
SAFE_EXTENSION_TYPES = frozenset({"ray.data.arrow_tensor", "ray.data.arrow_tensor_v2",
                                  "ray.data.arrow_variable_shaped_tensor"})


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
    """`ray.data.read_parquet(path)` (a path, or a list of files), with the footer-reader pool sized by
    `footer_readers`.

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


def _extension_name(field) -> str | None:
    """The extension type in a field, at any depth (a list of them, a struct field), or None. An
    extension type no library registered reads back as its storage, its name kept in the metadata."""
    import pyarrow as pa

    name = (field.metadata or {}).get(b"ARROW:extension:name")
    if name is not None:
        return name.decode("utf-8", "replace")
    t = field.type
    if isinstance(t, pa.BaseExtensionType):
        return t.extension_name
    if pa.types.is_dictionary(t):
        return _extension_name(pa.field("value", t.value_type))
    children = ([t.key_field, t.item_field] if pa.types.is_map(t)
                else [t.value_field] if hasattr(t, "value_field") else [t.field(i) for i in range(t.num_fields)])
    return next(filter(None, map(_extension_name, children)), None)


def schema_problem(schema, allowed: frozenset[str] = frozenset()) -> str | None:
    """Why a table of this schema is refused (its first column of an extension type not `allowed`), else None."""
    for field in schema:
        name = _extension_name(field)
        if name and name not in allowed:
            return (f"column '{field.name}' is of the extension type {name!r}, which only a Python library reads "
                    "back, running its code (Ray's 'ray.data.arrow_pickled_object' unpickles each value, which can "
                    "run any code), so the file is refused unread; write the column as text, numbers or lists "
                    "(JSON text for structured values), or drop it")
    return None


def file_problem(path: Path, allowed: frozenset[str] = frozenset()) -> str | None:
    """Why a Parquet file cannot be read (not Parquet, or a column of an extension type not `allowed`), else None:
    only the footer (the schema) is read, no value."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # noqa: BLE001 - any pyarrow failure means "not a readable parquet file"
        return f"not a readable Parquet file ({exc})"
    return schema_problem(schema, allowed)


def read_rows(path: Path, limit: int | None = None) -> list[dict]:
    """The rows of a (small) Parquet directory as dicts, in file order; the first `limit` only when
    given (0: none). For what a driver reads whole: prompt lists, held-out examples, also another run's
    (`pipeline compare`). Each file's schema is checked first (`file_problem`): a column of an extension
    type outside `SAFE_EXTENSION_TYPES` refuses the directory before any value is read, whatever this
    process imported (with `ray.data` imported, reading a pickled column's values unpickles them)."""
    import pyarrow.parquet as pq

    from pipeline.errors import UserError

    files = sorted(Path(path).glob("*.parquet"))
    if not files or limit == 0:
        return []
    for f in files:
        problem = file_problem(f, SAFE_EXTENSION_TYPES)
        if problem:
            raise UserError(f"{f}: {problem}")
    rows = pq.ParquetDataset(files).read().to_pylist()
    return rows if limit is None else rows[:limit]
