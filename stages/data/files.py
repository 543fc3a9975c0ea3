"""Reading a user's data file row by row, with each row's line (or row) number: JSON Lines or a JSON array
(optionally gzipped), CSV, Parquet; and naming the first problem of a file (`locate_problem`) when the data
stage refuses one. Every read goes through `safe_read`'s bounds (no unpickling, bounded recursion and gzip);
what a row must hold is `formats` (`check_row`).
"""

from __future__ import annotations

import csv
import gzip
from pathlib import Path
from typing import Iterator

import stages.data.safe_read as safe_read
from stages.data.formats import check_row

SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".csv")


def file_type(path: Path) -> str | None:
    """'json' (JSON Lines or a JSON array, optionally gzipped), 'parquet', 'csv', or None."""
    name = path.name.lower()
    if name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".csv"):
        return "csv"
    return None


def open_text(path: Path):
    """A text file, gunzipped when its name ends in .gz."""
    return (gzip.open(path, "rt", encoding="utf-8", errors="replace") if path.name.lower().endswith(".gz")
            else path.open(encoding="utf-8", errors="replace"))


def is_json_array(path: Path) -> bool:
    """A JSON file holding one array of rows (rather than JSON Lines): its first non-space character is '['
    (looked for in the first MiB only; a file that is not readable gzip is not an array: its reader says why)."""
    try:
        with open_text(path) as f:
            for _ in range(256):
                chunk = f.read(4096)
                if not chunk:
                    return False
                if stripped := chunk.lstrip():
                    return stripped[0] == "["
    except safe_read.GZIP_ERRORS:
        return False
    return False


def _json_array_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """A JSON array's items, parsed one at a time; a structural problem ends the file with its reason."""
    n = 0
    try:
        with open_text(path) as f:
            for n, item in safe_read.json_array_items(f):
                yield n, safe_read.parse_record(item)
    except ValueError as exc:  # the array itself is malformed: its reason names the line
        yield 0, str(exc)
    except RecursionError:
        yield n + 1, "invalid JSON (nested too deeply to parse, so the array cannot be read past it)"
    except safe_read.ArrayTooLarge:
        yield 0, safe_read.array_too_large()
    except safe_read.GZIP_ERRORS as exc:
        yield 0, safe_read.gzip_reason(exc)


def _json_lines_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """JSON Lines records; a gzip stream that breaks off, or unpacks past the cap, ends the file with its reason."""
    line_no, total, cap = 0, 0, safe_read.MAX_GZIP_BYTES if path.name.lower().endswith(".gz") else None
    try:
        with open_text(path) as f:
            for line_no, line in safe_read.read_lines(f):
                total += len(line) or safe_read.MAX_RECORD_BYTES
                if cap is not None and total > cap:
                    yield 0, safe_read.gzip_too_large()
                    return
                if not line:
                    yield line_no, safe_read.record_too_large()
                elif line.strip():
                    yield line_no, safe_read.parse_record(line)
    except safe_read.GZIP_ERRORS as exc:
        yield line_no + 1, safe_read.gzip_reason(exc, line_no)


def _csv_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """CSV rows as dicts; a row whose column count differs from the header's, or over the record cap, is a
    reason (a field over the cap ends the file: the csv module cannot go on past it)."""
    csv.field_size_limit(max(csv.field_size_limit(), safe_read.MAX_RECORD_BYTES))
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f)
        try:
            width = len(reader.fieldnames or [])
            for row in reader:
                if None in row or len(row) != width:
                    yield reader.line_num, f"expected {width} columns"
                elif safe_read.csv_row_too_large(row):
                    yield reader.line_num, safe_read.record_too_large()
                else:
                    yield reader.line_num, row
        except csv.Error as exc:
            yield reader.line_num + 1, f"unreadable CSV ({exc}; a field over {safe_read.size(safe_read.MAX_RECORD_BYTES)} " \
                                       "is over the cap on one record)"


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """Parquet rows, after its schema is checked: a column of an extension type is never read."""
    import pyarrow.parquet as pq

    problem = safe_read.parquet_problem(path)
    if problem:
        yield 0, problem
        return
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - any pyarrow failure means "not a readable parquet file"
        yield 0, f"not a readable Parquet file ({exc})"
        return
    for i, row in enumerate(table.to_pylist(), start=1):
        yield i, row


def iter_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """(line number, row or why it is not one) for each record of a file, in one process; line 0 is a
    problem with the whole file (it then ends). Nothing here raises on a file's contents."""
    kind = file_type(path)
    if kind == "json":
        yield from (_json_array_rows(path) if is_json_array(path) else _json_lines_rows(path))
    elif kind == "csv":
        yield from _csv_rows(path)
    elif kind == "parquet":
        yield from _parquet_rows(path)


def locate_problem(path: Path, kind: str, fmt: str = "auto", columns: dict[str, str] | None = None,
                   parse_only: bool = False) -> str | None:
    """'<file>: line N: <reason>' for the first problem in a file, else None.

    `parse_only` finds only what stops a reader (lines that are not JSON objects, wrong column
    counts); without it, rows that parse but fail validation count too (for `on_bad_rows: fail`)."""
    unit = "row" if file_type(path) == "parquet" or (file_type(path) == "json" and is_json_array(path)) else "line"
    for line_no, row in iter_rows(path):
        reason = row if isinstance(row, str) else None
        if reason is None and not parse_only:
            reason = check_row(kind, row, fmt, columns)[1] or None
        if reason:
            return f"{path}: {unit} {line_no}: {reason}" if line_no else f"{path}: {reason}"
    return None
