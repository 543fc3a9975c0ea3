"""Reading a user's data file row by row, with each row's line (or row) number: JSON Lines or a JSON array
(optionally gzipped), CSV, Parquet. Every read goes through `safe_read`'s bounds (no unpickling, bounded
recursion and gzip, capped records); what a row must hold is `formats` (`check_row`).

Every source kind takes a file through here, so a file refused is refused with one message wherever it
enters: `refusal` (the check run on each file before Ray reads it: the data stage's sft, preference and
prompts sources, batch inference's Parquet), `rows` (the driver's own reads: a user's eval set, batch
inference's other files), and `locate_problem` (the first problem, naming its line, when Ray's read failed
or `on_bad_rows: fail` stops the stage) all say `<file>: [line N: ]<what>; <fix>`.
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


def _record(text: str, parse: bool) -> dict | str:
    """A record parsed, or (`parse` false: a check only) its refusal or {} (not parsed unless it may be too deep)."""
    return safe_read.parse_record(text) if parse else safe_read.record_refusal(text) or {}


def _json_array_rows(path: Path, parse: bool = True) -> Iterator[tuple[int, dict | str]]:
    """A JSON array's items, parsed one at a time; a structural problem ends the file with its reason."""
    n = 0
    try:
        with open_text(path) as f:
            for n, item in safe_read.json_array_items(f):
                yield n, _record(item, parse)
    except ValueError as exc:  # the array itself is malformed: its reason names the line
        yield 0, safe_read.Refusal(f"{exc}; the array cannot be read past it: fix it there")
    except RecursionError:  # an item deeper than the parser goes, so far deeper than the cap
        yield n + 1, safe_read.too_deep()
    except safe_read.ArrayTooLarge:
        yield 0, safe_read.array_too_large()
    except safe_read.GZIP_ERRORS as exc:
        yield 0, safe_read.gzip_reason(exc)


def _json_lines_rows(path: Path, parse: bool = True) -> Iterator[tuple[int, dict | str]]:
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
                    yield line_no, _record(line, parse)
    except safe_read.GZIP_ERRORS as exc:
        yield 0, safe_read.gzip_reason(exc, line_no)


def _csv_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """CSV rows as dicts; a row whose column count differs from the header's is a reason, one over the record
    cap a refusal (a field over the cap ends the file: the csv module cannot go on past it)."""
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
            over = "field larger than field limit" in str(exc)
            yield reader.line_num + 1, (safe_read.record_too_large() if over else
                                        safe_read.Refusal(f"unreadable CSV ({exc}); fix the file there"))


def _parquet_rows(path: Path, parse: bool = True) -> Iterator[tuple[int, dict | str]]:
    """Parquet rows, after its schema is checked: a column of an extension type is never read (nor, without
    `parse`, any value: the schema is the check)."""
    import pyarrow.parquet as pq

    problem = safe_read.parquet_problem(path)
    if problem:
        yield 0, problem
    if problem or not parse:
        return
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - any pyarrow failure means "not a readable parquet file"
        yield 0, safe_read.Refusal(f"not a readable Parquet file ({exc})")
        return
    for i, row in enumerate(table.to_pylist(), start=1):
        yield i, row


def iter_rows(path: Path, parse: bool = True) -> Iterator[tuple[int, dict | str]]:
    """(line number, row or why it is not one) for each record of a file, in one process; line 0 is a
    problem with the whole file (it then ends), and a `safe_read.Refusal` refuses the file. Nothing here
    raises on a file's contents. Without `parse`, a check: JSON records are not parsed (each is {} unless
    refused) and Parquet yields only a refusal of its schema."""
    kind = file_type(path)
    if kind == "json":
        yield from (_json_array_rows(path, parse) if is_json_array(path) else _json_lines_rows(path, parse))
    elif kind == "csv":
        yield from _csv_rows(path)
    elif kind == "parquet":
        yield from _parquet_rows(path, parse)


def _unit(path: Path) -> str:
    """What a file's records are counted in: rows of Parquet and JSON arrays, lines of the rest."""
    return "row" if file_type(path) == "parquet" or (file_type(path) == "json" and is_json_array(path)) else "line"


def _where(path: Path, unit: str, line_no: int, reason: str) -> str:
    return f"{path}: {unit} {line_no}: {reason}" if line_no else f"{path}: {reason}"


def refusal(path: Path) -> str | None:
    """'<file>: [line N: ]<what>; <fix>' when no reader may read this file, else None: what every source kind
    checks on each file before its rows are read. Parquet: the schema only. Other files: read once, whole,
    record by record, parsing a JSON record only when it may be nested too deeply; an invalid row is no
    refusal (the data stage counts it)."""
    unit = _unit(path)
    return next((_where(path, unit, n, r) for n, r in iter_rows(path, parse=False)
                 if isinstance(r, safe_read.Refusal)), None)


def check(path: Path) -> None:
    """`refusal`, raised (`safe_read.Refused`)."""
    problem = refusal(path)
    if problem:
        raise safe_read.Refused(problem)


def rows(path: Path, strict: bool = False) -> Iterator[dict]:
    """A file's rows, read on the driver; a refusal raises `safe_read.Refused` with `refusal`'s message, after
    the rows before it (a caller that keeps them holds them until then). An invalid row is skipped (the data
    stage counts it in its Ray pass) or, `strict`, refuses the file too, naming its line: for a reader that
    has no row to put in its place."""
    unit = _unit(path)
    for n, row in iter_rows(path):
        if isinstance(row, safe_read.Refusal):
            raise safe_read.Refused(_where(path, unit, n, row))
        if isinstance(row, str) and strict:
            raise safe_read.Refused(_where(path, unit, n, f"{row}; fix that {unit} or leave it out"))
        if isinstance(row, dict):
            yield row


def locate_problem(path: Path, kind: str, fmt: str = "auto", columns: dict[str, str] | None = None,
                   parse_only: bool = False) -> str | None:
    """'<file>: line N: <reason>' for the first problem in a file, else None.

    `parse_only` finds only what stops a reader (lines that are not JSON objects, wrong column
    counts); without it, rows that parse but fail validation count too (for `on_bad_rows: fail`)."""
    unit = _unit(path)
    for line_no, row in iter_rows(path):
        reason = row if isinstance(row, str) else None
        if reason is None and not parse_only:
            reason = check_row(kind, row, fmt, columns)[1] or None
        if reason:
            return _where(path, unit, line_no, reason)
    return None
