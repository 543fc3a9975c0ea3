"""Reading a user's files without trusting them: what may be read, up to what size, and how.

The data stage reads whatever files a config names, so each reader here either yields rows, counts a
bad one, or says which file (and line) is wrong, what is wrong and the fix; none may crash, run code
or exhaust the driver:

- **Parquet and `save_to_disk` columns of an extension type are refused unread.** An extension type
  is a Python library's own column type; reading its values runs that library's code, and Ray's
  `ray.data.arrow_pickled_object` unpickles them (a crafted file runs code on whoever reads it). Only
  the schema is read (the types' constructors, never their values), and the column is named.
- **Files found twice through links are read once**, and a link back up the tree (a loop) ends the walk
  there: directories are walked following links, each real directory once, and files deduplicated by
  their real path (`glob`'s `**` follows every link, so a loop read one file 41 times).
- **Caps** (`MAX_*` below, in docs/data.md): a gzip file unpacks to at most `MAX_GZIP_BYTES` (a small
  file can unpack to terabytes, and Ray reads a file whole into one worker); a JSON array, which the
  driver parses (streamed, item by item) and holds, to `MAX_JSON_ARRAY_BYTES`; one record (a JSON
  line, a CSV row) to `MAX_RECORD_BYTES`. A JSON record nested too deeply to parse is a bad row.
- **gzip data that is truncated, corrupt or not gzip** is an error naming the file, checked on the
  driver before Ray reads it (Ray's reader would fail with a traceback, or stop early).
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import IO, Iterator

MAX_GZIP_BYTES = 4 << 30
MAX_JSON_ARRAY_BYTES = 1 << 30
MAX_RECORD_BYTES = 16 << 20
GZIP_ERRORS = (OSError, EOFError, zlib.error)  # gzip.BadGzipFile is an OSError; truncation an EOFError


def size(n: int) -> str:
    """A cap for a message: '16 MiB', '4 GiB'."""
    unit, shift = next(((u, s) for u, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if n >= 1 << s), ("bytes", 0))
    return f"{n / (1 << shift):g} {unit}"


# --------------------------------------------------------------------------- finding files


def has_magic(text: str) -> bool:
    return any(c in text for c in "*?[")


def walk_files(root: Path) -> Iterator[Path]:
    """Every file under `root`, in sorted order, following directory links but entering each real
    directory once: a link to a directory already walked (a loop back up the tree) is skipped."""
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath, name)


def _matches(parts: list[str], pattern: list[str]) -> bool:
    """Whether path components match glob components (`**`: any number of them), as `glob` does:
    a name starting with '.' matches only a component that starts with '.' too."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1)
                   if not any(p.startswith(".") for p in parts[:i]))
    return bool(parts) and (not parts[0].startswith(".") or pattern[0].startswith(".")) \
        and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(parts[1:], pattern[1:])


def glob_files(pattern: str) -> list[Path]:
    """The paths a glob matches; `**` walks with `walk_files` (each real directory once), not `glob`."""
    if "**" not in pattern:
        return [Path(p) for p in glob.glob(pattern)]
    parts = Path(pattern).parts
    fixed = next(i for i, p in enumerate(parts) if has_magic(p))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    return [p for p in walk_files(base) if _matches(list(p.relative_to(base).parts), list(parts[fixed:]))]


def unique_files(paths: list[Path]) -> list[Path]:
    """`paths` sorted, without the ones that are another's file under another name (a link)."""
    seen: set[str] = set()
    out = []
    for p in sorted(paths):
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            out.append(p)
    return out


# --------------------------------------------------------------------------- gzip


def gzip_reason(exc: BaseException, line: int | None = None) -> str:
    """What a gzip read error means for the user, and the fix."""
    after = f" after line {line}" if line else ""
    if isinstance(exc, EOFError):
        return f"the gzip data ends early{after} (the file is truncated); copy or compress it again, whole"
    if isinstance(exc, gzip.BadGzipFile) and "Not a gzipped file" in str(exc):
        return "not gzip data, though its name ends in .gz; compress it with gzip, or name it without .gz"
    return f"corrupt gzip data{after} ({exc}); compress it again"


def gzip_too_large() -> str:
    return (f"unpacks to more than {size(MAX_GZIP_BYTES)} (the cap on one gzip file, which a reader holds whole); "
            "split it into several files")


def gzip_problem(path: Path) -> str | None:
    """Why a .gz file cannot be read (not gzip, truncated, corrupt, or over `MAX_GZIP_BYTES` unpacked), else
    None. Unpacks the whole file on the driver, a megabyte at a time, before Ray reads it whole."""
    total = lines = 0
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                total, lines = total + len(chunk), lines + chunk.count(b"\n")
                if total > MAX_GZIP_BYTES:
                    return gzip_too_large()
    except GZIP_ERRORS as exc:
        return gzip_reason(exc, lines)
    return None


# --------------------------------------------------------------------------- JSON


def record_too_large() -> str:
    return f"a record over {size(MAX_RECORD_BYTES)} (the cap on one JSON line or CSV row); split it or leave it out"


def parse_record(text: str) -> dict | str:
    """One JSON record (a line, an array item), or why it is not one: the reason counts as a bad row."""
    if len(text) > MAX_RECORD_BYTES:
        return record_too_large()
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return "invalid JSON (nested too deeply to parse)"
    return record if isinstance(record, dict) else "a record must be one JSON object"


def read_lines(f: IO[str]) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, a line over `MAX_RECORD_BYTES` given as '' after being skipped
    without holding it (a file of one huge line would otherwise be read whole)."""
    line_no = 0
    while line := f.readline(MAX_RECORD_BYTES + 1):
        line_no += 1
        if len(line) > MAX_RECORD_BYTES and not line.endswith("\n"):
            while (rest := f.readline(MAX_RECORD_BYTES)) and not rest.endswith("\n"):
                pass
            yield line_no, ""
        else:
            yield line_no, line


class _Text:
    """A text stream read in growing chunks, for the JSON array parser: the unparsed text, the line the
    text starts on, and the characters read so far (capped)."""

    def __init__(self, f: IO[str], cap: int):
        self.f, self.cap, self.buf, self.pos, self.line, self.read, self.eof = f, cap, "", 0, 1, 0, False
        self.chunk = 1 << 16

    def more(self) -> bool:
        """Read another chunk (twice the last: a long item is re-parsed O(log n) times); False at the end."""
        if self.eof:
            return False
        data = self.f.read(self.chunk)
        self.chunk = min(self.chunk * 2, 1 << 26)
        self.read += len(data)
        if self.read > self.cap:
            raise ArrayTooLarge()
        if not data:  # the buffer stays as it was: an error's position in it still holds
            self.eof = True
            return False
        if self.pos > len(self.buf) // 2:  # drop what is parsed, keeping the line count
            self.line += self.buf.count("\n", 0, self.pos)
            self.buf, self.pos = self.buf[self.pos:], 0
        self.buf += data
        return True

    def skip_space(self) -> str:
        """The next non-space character ('' at the end), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos:self.pos + 1]

    def line_at(self, pos: int) -> int:
        return self.line + self.buf.count("\n", 0, pos)


class ArrayTooLarge(Exception):
    """A JSON array past `MAX_JSON_ARRAY_BYTES`."""


def _array_item(text: _Text, decoder: json.JSONDecoder) -> str:
    """The next item's JSON text (parsed to find its end, reading on while it runs past the buffer)."""
    while True:
        try:
            _, end = decoder.raw_decode(text.buf, text.pos)
        except json.JSONDecodeError as exc:
            if text.more():
                continue
            raise ValueError(f"line {text.line_at(exc.pos)}: invalid JSON ({exc.msg})") from None
        cut = end == len(text.buf) or (text.buf[text.pos] in "-0123456789" and text.buf[end] not in ",] \t\r\n")
        if cut and text.more():  # a number may go on in the next chunk ('12' of '12.5', '-1' of '-1e3')
            continue
        item, text.pos = text.buf[text.pos:end], end
        return item


def json_array_items(f: IO[str]) -> Iterator[tuple[int, str]]:
    """(item number, item JSON text) for each item of a top-level JSON array, parsed one item at a time
    (never the whole array at once). A malformed array raises ValueError naming the line and item;
    past `MAX_JSON_ARRAY_BYTES`, ArrayTooLarge; an item nested too deeply to parse, RecursionError."""
    text, decoder, n = _Text(f, MAX_JSON_ARRAY_BYTES), json.JSONDecoder(), 0
    if text.skip_space() != "[":
        raise ValueError("line 1: a JSON array must start with '['")
    text.pos += 1
    if text.skip_space() == "]":
        text.pos += 1
    else:
        while True:
            n += 1
            text.skip_space()
            yield n, _array_item(text, decoder)
            sep = text.skip_space()
            text.pos += 1
            if sep == "]":
                break
            if sep != ",":
                raise ValueError(f"line {text.line_at(text.pos - 1)}: invalid JSON (expected ',' or ']' after "
                                 f"item {n}{', found the end of the file' if not sep else ''})")
    if text.skip_space():
        raise ValueError(f"line {text.line_at(text.pos)}: invalid JSON (text after the array's closing ']')")


def array_too_large() -> str:
    return (f"a JSON array over {size(MAX_JSON_ARRAY_BYTES)} (the cap: the driver parses an array and holds its "
            "rows); convert it to JSON Lines, one object a line (`jq -c '.[]' rows.json > rows.jsonl`), which is "
            "read in parallel without a cap")


# --------------------------------------------------------------------------- CSV


def csv_row_too_large(row: dict) -> bool:
    """A CSV row over `MAX_RECORD_BYTES` (Ray's CSV reader refuses a file with one)."""
    values = [v for v in row.values() if isinstance(v, str)]
    if sum(map(len, values)) * 4 <= MAX_RECORD_BYTES:  # utf-8: at most 4 bytes a character
        return False
    return sum(len(v.encode("utf-8", "replace")) for v in values) > MAX_RECORD_BYTES


# --------------------------------------------------------------------------- extension types


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


def extension_problem(schema) -> str | None:
    """Why a table of this schema is refused (its first column of an extension type), else None."""
    for field in schema:
        name = _extension_name(field)
        if name:
            return (f"column '{field.name}' is of the extension type {name!r}, which only a Python library reads "
                    "back, running its code (Ray's 'ray.data.arrow_pickled_object' unpickles each value, which can "
                    "run any code), so the file is refused unread; write the column as text, numbers or lists "
                    "(JSON text for structured values), or drop it")
    return None


def parquet_problem(path: Path) -> str | None:
    """Why a Parquet file cannot be read (not Parquet, or a column of an extension type), else None:
    only the footer (the schema) is read, no value."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # noqa: BLE001 - any pyarrow failure means "not a readable parquet file"
        return f"not a readable Parquet file ({exc})"
    return extension_problem(schema)
