"""Reading a user's files without trusting them: what may be read, up to what size, and how.

Every source of rows reads through here, whatever kind it is (the data stage's sft, preference, prompts
and eval sources, batch inference's prompts), so a file gets one answer wherever it enters: each reader
either yields rows, counts a bad one, or refuses the file, naming it (and the line, or the column), what
is wrong and the fix. None may crash, run code or exhaust the driver. What refuses a file (a `Refusal`,
not a bad row; `stages.data.files.refusal` finds the first):

- **A Parquet or `save_to_disk` column of an extension type**, refused unread: reading its values runs the
  defining library's code, and Ray's `ray.data.arrow_pickled_object` unpickles them (a crafted file runs
  code on whoever reads it). Only the schema is read, and the column is named
  (`stages.common.parquet.schema_problem`, which every Parquet reader runs).
- **The caps** (`MAX_*` below, in docs/data.md): a gzip file unpacks to at most `MAX_GZIP_BYTES` (a small
  file can unpack to terabytes, and Ray reads a file whole into one worker); a JSON array, which the
  driver parses (streamed, item by item) and holds, to `MAX_JSON_ARRAY_BYTES`; one record (a JSON line,
  an array item, a CSV row) to `MAX_RECORD_BYTES`, nested at most `MAX_DEPTH` levels. A cap refuses, as a
  gzip bomb does: such a record is no accident of the data, and every reader stops there the same way.
- **Data a reader cannot go on past**: gzip data that is truncated, corrupt or not gzip; a malformed JSON
  array; a CSV file the csv module cannot parse.
- **A link out of the source's folder**: files and directories are found following links, each real
  directory once and each file once by its real path (`glob`'s `**` follows every link, so a loop read
  one file 41 times), but a link that leads out of the folder (or the glob's fixed part) is refused,
  naming the link and its target: it can name any file (`/proc/self/environ`, the process's secrets).

An invalid row (not JSON, not an object, a missing field) is not a refusal: the data stage counts it
(`on_bad_rows`).
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
MAX_DEPTH = 100  # levels of nesting in one JSON record (a chat row needs about 6)
GZIP_ERRORS = (OSError, EOFError, zlib.error)  # gzip.BadGzipFile is an OSError; truncation an EOFError


class Refusal(str):
    """A reason that refuses the whole file, not one row (a cap, data a reader cannot go on past, a column of an
    extension type): a `str`, so it reads as any reason does, told apart by its type."""


class Refused(ValueError):
    """A file no reader may read: the message names it, where (line, row or column), what is wrong and the fix."""


def size(n: int) -> str:
    """A cap for a message: '16 MiB', '4 GiB'."""
    unit, shift = next(((u, s) for u, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if n >= 1 << s), ("bytes", 0))
    return f"{n / (1 << shift):g} {unit}"


# --------------------------------------------------------------------------- finding files


def has_magic(text: str) -> bool:
    return any(c in text for c in "*?[")


def _under(real: str, top: str) -> bool:
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def link_out(path: Path, root: Path) -> Refused:
    """The refusal of a link that leads out of its source's folder, naming the link and its target."""
    real = os.path.realpath(path)
    target = os.readlink(path) if os.path.islink(path) else real  # else a link above it in the tree
    target = target if target == real else f"{target} ({real})"
    return Refused(f"{path}: a link to {target}, outside {root} (the source's folder); a link out of a "
                   "source's folder is refused, since it can name any file (/proc/self/environ holds the process's "
                   "secrets); copy what it names into the folder, or give that path as a source of its own")


def inside(paths: list[Path], root: Path | None) -> list[Path]:
    """`paths`, after refusing (`Refused`) the first one whose real path leaves `root` through a link
    (None: a source naming one file, which may be a link: its user named it)."""
    if root is not None:
        top = os.path.realpath(root)
        for p in paths:
            if not _under(os.path.realpath(p), top):
                raise link_out(p, root)
    return paths


def walk_files(root: Path) -> Iterator[Path]:
    """Every file under `root`, in sorted order, following directory links but entering each real
    directory once: a link to a directory already walked (a loop back up the tree) is skipped, and one
    to a directory outside `root` refused (`Refused`, before anything in it is listed)."""
    seen: set[str] = set()
    top = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        if not _under(real, top):
            raise link_out(Path(dirpath), Path(root))
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


def glob_root(pattern: str) -> Path:
    """A glob's fixed part, the folder its matches lie under ('data' of 'data/**/*.jsonl')."""
    parts = Path(pattern).parts
    fixed = next(i for i, p in enumerate(parts) if has_magic(p))
    return Path(*parts[:fixed]) if fixed else Path(".")


def glob_files(pattern: str) -> list[Path]:
    """The paths a glob matches; `**` walks with `walk_files` (each real directory once), not `glob`."""
    if "**" not in pattern:
        return [Path(p) for p in glob.glob(pattern)]
    base = glob_root(pattern)
    rest = list(Path(pattern).parts[len(base.parts):])  # Path(".").parts is ()
    return [p for p in walk_files(base) if _matches(list(p.relative_to(base).parts), rest)]


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


def gzip_reason(exc: BaseException, line: int | None = None) -> Refusal:
    """What a gzip read error means for the user, and the fix."""
    after = f" after line {line}" if line else ""
    if isinstance(exc, EOFError):
        return Refusal(f"the gzip data ends early{after} (the file is truncated); copy or compress it again, whole")
    if isinstance(exc, gzip.BadGzipFile) and "Not a gzipped file" in str(exc):
        return Refusal("not gzip data, though its name ends in .gz; compress it with gzip, or name it without .gz")
    return Refusal(f"corrupt gzip data{after} ({exc}); compress it again")


def gzip_too_large() -> Refusal:
    return Refusal(f"unpacks to more than {size(MAX_GZIP_BYTES)} (the cap on one gzip file, which a reader holds "
                   "whole); split it into several files")


# --------------------------------------------------------------------------- JSON


def record_too_large() -> Refusal:
    return Refusal(f"a record over {size(MAX_RECORD_BYTES)} (the cap on one JSON line or CSV row); split it or "
                   "leave it out")


def too_deep() -> Refusal:
    return Refusal(f"a record nested more than {MAX_DEPTH} levels deep (the cap on one JSON record); flatten it or "
                   "leave it out")


def _deeper_than(value, cap: int) -> bool:
    """Whether a parsed value nests lists and objects more than `cap` levels (walked without recursion)."""
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (list, dict)):
            if depth > cap:
                return True
            todo += [(c, depth + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return False


def _may_be_too_deep(text: str) -> bool:
    """A record with fewer brackets than `MAX_DEPTH` cannot nest deeper: most are never walked."""
    return text.count("[") + text.count("{") > MAX_DEPTH


def parse_record(text: str) -> dict | str:
    """One JSON record (a line, an array item), or why it is not one: a `Refusal` (over a cap), or a reason
    that counts as a bad row."""
    if len(text) > MAX_RECORD_BYTES:
        return record_too_large()
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:  # deeper than the parser goes, so far deeper than the cap
        return too_deep()
    if _may_be_too_deep(text) and _deeper_than(record, MAX_DEPTH):
        return too_deep()
    return record if isinstance(record, dict) else "a record must be one JSON object"


def record_refusal(text: str) -> Refusal | None:
    """`parse_record`'s refusal of a record, if any, without parsing it unless it could be nested too deeply:
    the check a file gets before Ray reads it, at the speed of reading its lines."""
    if len(text) > MAX_RECORD_BYTES:
        return record_too_large()
    reason = parse_record(text) if _may_be_too_deep(text) else None
    return reason if isinstance(reason, Refusal) else None


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


def array_too_large() -> Refusal:
    return Refusal(f"a JSON array over {size(MAX_JSON_ARRAY_BYTES)} (the cap: the driver parses an array and holds "
                   "its rows); convert it to JSON Lines, one object a line (`jq -c '.[]' rows.json > rows.jsonl`), "
                   "which is read in parallel without a cap")


# --------------------------------------------------------------------------- CSV


def csv_row_too_large(row: dict) -> bool:
    """A CSV row over `MAX_RECORD_BYTES` (Ray's CSV reader refuses a file with one)."""
    values = [v for v in row.values() if isinstance(v, str)]
    if sum(map(len, values)) * 4 <= MAX_RECORD_BYTES:  # utf-8: at most 4 bytes a character
        return False
    return sum(len(v.encode("utf-8", "replace")) for v in values) > MAX_RECORD_BYTES


# --------------------------------------------------------------------------- extension types


def extension_problem(schema) -> Refusal | None:
    """Why a table of this schema is refused (its first column of an extension type), else None."""
    from stages.common.parquet import schema_problem

    problem = schema_problem(schema)
    return Refusal(problem) if problem else None


def parquet_problem(path: Path) -> Refusal | None:
    """Why a Parquet file cannot be read (not Parquet, or a column of an extension type), else None:
    only the footer (the schema) is read, no value."""
    from stages.common.parquet import file_problem

    problem = file_problem(path)
    return Refusal(problem) if problem else None
