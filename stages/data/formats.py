"""Raw row formats a user brings, and their validation.

Three kinds of rows feed the pipeline (README "Bring your own data"):

| kind         | columns                                                        |
| ------------ | -------------------------------------------------------------- |
| `sft`        | `messages` (list of {role, content}, or its JSON text) or `prompt` + `response` |
| `preference` | `prompt`, `chosen`, `rejected`                                 |
| `prompts`    | `prompt`, optional `answer` (reference answer for the verifier) |

`check_row` is pure: it returns the canonical row or the reason the row is bad. The data stage
applies it inside Ray Data; `locate_problem` applies it again, in one process, only after a
failure, to name the file and line of the first bad row (so the happy path pays nothing).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

KINDS = ("sft", "preference", "prompts")
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
ROLES = ("system", "user", "assistant")


def _missing(value: Any) -> bool:
    """None, or NaN: readers fill absent cells of mixed-schema files with either."""
    return value is None or (isinstance(value, float) and value != value)


def _text(row: dict, key: str, required: bool = True) -> str:
    value = row.get(key)
    if _missing(value):
        if required:
            raise ValueError(f"missing field '{key}'")
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(int(value)) if float(value).is_integer() else str(value)
    if not isinstance(value, str):
        raise ValueError(f"field '{key}' must be text, got {type(value).__name__}")
    if required and not value.strip():
        raise ValueError(f"field '{key}' is empty")
    return value


def _messages(row: dict) -> list[dict]:
    raw = row.get("messages")
    if _missing(raw):
        if not _missing(row.get("prompt")) or not _missing(row.get("response")):
            return [{"role": "user", "content": _text(row, "prompt")},
                    {"role": "assistant", "content": _text(row, "response")}]
        raise ValueError("needs 'messages' or 'prompt' + 'response'")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'messages' is not valid JSON ({exc.msg})") from None
    if not hasattr(raw, "__len__") or isinstance(raw, (dict, str)) or len(raw) == 0:
        raise ValueError("'messages' must be a non-empty list of {role, content}")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be text")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise ValueError("no non-empty assistant message to train on")
    if next(m["role"] for m in messages if m["role"] != "system") == "assistant":  # one exists (checked above)
        raise ValueError("the conversation must start with a user message (after any system message)")
    return messages


def check_row(kind: str, row: dict[str, Any]) -> tuple[dict | None, str]:
    """Validate one raw row: (canonical row, "") if good, else (None, reason).

    The canonical row's `group` decides its train/eval split: the row's optional `group` field, or
    else its prompt. Rows that share a group (one problem asked in several wordings) land in the
    same split, so a held-out problem is never trained on under another phrasing.
    """
    try:
        good = _canonical(kind, row)
        good["group"] = _text(row, "group", required=False) or good["key"]
        return good, ""
    except ValueError as exc:
        return None, str(exc)


def _canonical(kind: str, row: dict[str, Any]) -> dict:
    if kind == "sft":
        messages = _messages(row)
        key = next((m["content"] for m in messages if m["role"] == "user"), messages[0]["content"])
        return {"key": key, "messages": messages}
    if kind == "preference":
        prompt, chosen, rejected = _text(row, "prompt"), _text(row, "chosen"), _text(row, "rejected")
        if chosen == rejected:
            raise ValueError("'chosen' and 'rejected' are identical")
        return {"key": prompt, "prompt": prompt, "chosen": chosen, "rejected": rejected}
    if kind == "prompts":
        prompt = _text(row, "prompt")
        return {"key": prompt, "prompt": prompt, "answer": _text(row, "answer", required=False)}
    raise ValueError(f"unknown row kind {kind!r}")


def _iter_rows(path: Path):
    """(line number, row or parse error) for each record of a file, in one process."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield line_no, f"invalid JSON ({exc.msg} at column {exc.colno})"
                    continue
                yield line_no, row if isinstance(row, dict) else "a line must hold one JSON object"
    elif suffix == ".csv":
        with path.open(newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.DictReader(f)
            width = len(reader.fieldnames or [])
            for row in reader:
                if None in row or len(row) != width:
                    yield reader.line_num, f"expected {width} columns"
                else:
                    yield reader.line_num, row
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # noqa: BLE001 - any pyarrow failure means "not a readable parquet file"
            yield 0, f"not a readable Parquet file ({exc})"
            return
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row


def _json_type(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "text", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def locate_problem(path: Path, kind: str, parse_only: bool = False) -> str | None:
    """'<file>: line N: <reason>' for the first problem in a file, else None.

    `parse_only` finds only what stops a columnar reader (Ray Data / pyarrow): lines that are not
    JSON objects, wrong column counts, and a column whose type changes between rows. Without it,
    rows that parse but fail validation count too (for `on_bad_rows: fail`).
    """
    unit = "row" if path.suffix.lower() == ".parquet" else "line"
    seen: dict[str, tuple[str, int]] = {}
    for line_no, row in _iter_rows(path):
        reason = row if isinstance(row, str) else None
        if reason is None and parse_only and path.suffix.lower() in (".jsonl", ".json"):
            for key, value in row.items():
                typ = _json_type(value)
                first = seen.setdefault(key, (typ, line_no)) if typ else None
                if first and first[0] != typ:
                    reason = f"'{key}' is {typ} here but {first[0]} on line {first[1]}; use one type per column"
                    break
        if reason is None and not parse_only:
            reason = check_row(kind, row)[1] or None
        if reason:
            return f"{path}: {unit} {line_no}: {reason}" if line_no else f"{path}: {reason}"
    return None
