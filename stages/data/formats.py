"""Row formats a user brings, recognised by their columns, and their validation.

Three kinds of rows feed the pipeline; each kind accepts the formats people already have
(docs/data.md, "Bring your own data"):

| kind         | format              | columns                                                              |
| ------------ | ------------------- | -------------------------------------------------------------------- |
| `sft`        | `messages`          | `messages`: OpenAI chat (`system`/`user`/`assistant`/`tool`, `tool_calls`) |
| `sft`        | `sharegpt`          | `conversations`: [{`from`: human/gpt/system/tool, `value`}]          |
| `sft`        | `alpaca`            | `instruction`, optional `input`, `output` (optional `system`)         |
| `sft`        | `prompt_completion` | `prompt` + `completion` (or `response`), strings or message lists    |
| `preference` | `preference`        | `prompt` + `chosen` + `rejected`, strings or message lists (1)       |
| `preference` | `unpaired`          | `prompt` + `completion` + `label` (2)                                |
| `prompts`    | `prompts`           | `prompt` (string or message list), optional `answer`, other columns (3) |

(1) TRL's conversational shape, the prompt explicit or the shared prefix of `chosen` and `rejected`.
(2) TRL's unpaired preference shape: true/1/"desirable" or false/0/"undesirable"; only `stages.dpo.loss: kto`
trains on them.
(3) Any other columns, kept for reward functions.

`detect_format` picks a format from a row's columns (`auto`); `map_columns` applies a source's
column mapping first (`columns: {prompt: question}` reads the user's `question` as `prompt`).
`check_row` is pure: it returns the canonical row or a `RowError` with a short reason code (the
data stage counts dropped rows per code) and a message naming the field. `locate_problem` applies
it again, in one process, only after a failure, to name the file and line of the first bad row
(so the happy path pays nothing).

Nothing is silently altered: a row either converts exactly (ShareGPT's `from: gpt` is the
assistant role; Alpaca's `input` follows its instruction after a blank line, as the Alpaca prompt
does; a JSON string of tool-call arguments becomes the object chat templates expect) or is refused
with its reason. Content given as parts keeps its text parts; an image part is refused.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("sft", "preference", "prompts")
FORMATS = {
    "sft": ("messages", "sharegpt", "alpaca", "prompt_completion"),
    "preference": ("preference", "unpaired"),
    "prompts": ("prompts",),
}
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speaker names, as the datasets that use the format write them.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
                  "tool": "tool", "function_response": "tool", "observation": "tool"}
# Columns a prompts row uses itself; every other column travels with the row as `extra`.
PROMPT_COLUMNS = ("prompt", "answer", "group")


class RowError(ValueError):
    """Why a row cannot be used: `code` groups the drop counts, the message names the field."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _missing(value: Any) -> bool:
    """None, or NaN: readers fill absent cells of mixed-schema files with either."""
    return value is None or (isinstance(value, float) and value != value)


def _present(row: dict, key: str) -> bool:
    return key in row and not _missing(row[key])


def _text(row: dict, key: str, required: bool = True) -> str:
    value = row.get(key)
    if _missing(value):
        if required:
            raise RowError("missing_field", f"missing field '{key}'")
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(int(value)) if float(value).is_integer() else str(value)
    if not isinstance(value, str):
        raise RowError("bad_type", f"field '{key}' must be text, got {type(value).__name__}")
    if required and not value.strip():
        raise RowError("empty_field", f"field '{key}' is empty")
    return value


# --------------------------------------------------------------------------- formats and columns


def map_columns(row: dict, columns: dict[str, str]) -> dict:
    """The row with the user's columns renamed to ours (`{prompt: question}`: their `question` is our `prompt`)."""
    if not columns:
        return row
    theirs = {v: k for k, v in columns.items()}
    return {theirs.get(k, k): v for k, v in row.items() if k not in columns or k in theirs}


def detect_format(kind: str, columns) -> str:
    """The format of `kind` rows with these columns; a RowError naming what each format needs."""
    cols = set(columns)
    if kind == "sft":
        for fmt, needs in (("messages", {"messages"}), ("sharegpt", {"conversations"}),
                           ("alpaca", {"instruction", "output"}), ("prompt_completion", {"prompt", "completion"}),
                           ("prompt_completion", {"prompt", "response"})):
            if needs <= cols:
                return fmt
        raise RowError("unknown_format", f"no SFT format has these columns ({', '.join(sorted(cols)) or 'none'}): "
                       "expected 'messages' (OpenAI chat), 'conversations' (ShareGPT), 'instruction' + 'output' "
                       "(Alpaca) or 'prompt' + 'completion'/'response'; map yours with `columns:`")
    if kind == "preference":
        if {"chosen", "rejected"} <= cols:
            return "preference"
        if {"prompt", "completion", "label"} <= cols:
            return "unpaired"
        raise RowError("unknown_format", f"preference rows need 'chosen' and 'rejected' (and 'prompt', unless both "
                       f"are whole conversations), or 'prompt', 'completion' and 'label' (unpaired, for KTO); found "
                       f"{', '.join(sorted(cols)) or 'none'}; map yours with `columns:`")
    if kind == "prompts":
        if "prompt" in cols:
            return "prompts"
        raise RowError("unknown_format", f"RL prompt rows need 'prompt' (optional 'answer'); found "
                       f"{', '.join(sorted(cols)) or 'none'}; map yours with `columns:`, e.g. {{prompt: question}}")
    raise RowError("unknown_format", f"unknown row kind {kind!r}")


# --------------------------------------------------------------------------- messages


def _content(value: Any, where: str, role: str) -> str:
    """A message's content as text: a string, the text parts of a part list, or '' for an assistant
    turn that only calls tools. Any other part (an image) is refused: the pipeline trains text models."""
    if _missing(value):
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        texts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RowError("non_text_content",
                               f"{where}.content[{j}] is a part of type {kind or type(part).__name__!r}: only "
                               "text parts are supported (this pipeline trains text models); drop the part or the row")
            texts.append(part["text"])
        return "".join(texts)
    raise RowError("bad_type", f"{where}.content must be text or a list of text parts, got {type(value).__name__}")


def _tool_calls(value: Any, where: str) -> list[dict]:
    """OpenAI `tool_calls`, with JSON-string arguments parsed into the object chat templates render."""
    if not isinstance(value, (list, tuple)):
        raise RowError("bad_type", f"{where}.tool_calls must be a list")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError("bad_tool_call", f"{where}.tool_calls[{j}] needs function.name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise RowError("bad_tool_call", f"{where}.tool_calls[{j}].function.arguments is not JSON") from None
        out = {"type": "function", "function": {"name": fn["name"], "arguments": {} if _missing(args) else args}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


def _message(m: Any, where: str, role_names: dict[str, str] | None = None) -> dict:
    """One message in OpenAI shape ({role, content} plus `tool_calls`, `name`, `tool_call_id` when given)."""
    if not isinstance(m, dict):
        raise RowError("bad_type", f"{where} must be an object with 'role' and 'content'")
    if role_names is not None:  # ShareGPT: {from, value}
        speaker = m.get("from")
        if speaker not in role_names:
            raise RowError("bad_role", f"{where}.from must be one of {', '.join(role_names)}, got {speaker!r}")
        role, content = role_names[speaker], m.get("value")
    else:
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RowError("bad_role", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": role, "content": _content(content, where, role)}
    if role == "assistant" and not _missing(m.get("tool_calls")) and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m["tool_calls"], where)
    elif not out["content"] and role != "assistant" and _missing(content):
        raise RowError("missing_field", f"{where}.content is missing")
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _message_list(raw: Any, field: str, role_names: dict[str, str] | None = None) -> list[dict]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)  # CSV and some Parquet files carry the list as JSON text
        except json.JSONDecodeError as exc:
            raise RowError("bad_type", f"'{field}' is not valid JSON ({exc.msg})") from None
    if not isinstance(raw, (list, tuple)) or len(raw) == 0:
        raise RowError("bad_type", f"'{field}' must be a non-empty list of messages")
    return [_message(m, f"{field}[{i}]", role_names) for i, m in enumerate(raw)]


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) for m in value)


def _check_conversation(messages: list[dict]) -> list[dict]:
    """A trainable conversation: an assistant turn with something in it, and a user turn first."""
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        raise RowError("no_assistant", "no non-empty assistant message to train on")
    if next((m["role"] for m in messages if m["role"] != "system"), None) != "user":
        raise RowError("bad_order", "the conversation must start with a user message (after any system message)")
    return messages


def _turns(value: Any, field: str, role: str) -> list[dict]:
    """A prompt or completion given as a string (one `role` turn) or as a list of messages."""
    if isinstance(value, str):
        if not value.strip():
            raise RowError("empty_field", f"field '{field}' is empty")
        return [{"role": role, "content": value}]
    if _missing(value):
        raise RowError("missing_field", f"missing field '{field}'")
    return _message_list(value, field)


# --------------------------------------------------------------------------- the kinds


def _sft(row: dict, fmt: str) -> list[dict]:
    if fmt == "messages":
        return _check_conversation(_message_list(row.get("messages"), "messages"))
    if fmt == "sharegpt":
        return _check_conversation(_message_list(row.get("conversations"), "conversations", SHAREGPT_ROLES))
    if fmt == "alpaca":
        instruction, extra, output = (_text(row, "instruction"), _text(row, "input", required=False),
                                      _text(row, "output"))
        system = _text(row, "system", required=False)
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return ([{"role": "system", "content": system}] if system.strip() else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": output}]
    # prompt_completion (TRL's name) or prompt + response
    completion = "completion" if _present(row, "completion") else "response"
    return _check_conversation(_turns(row.get("prompt"), "prompt", "user")
                               + _turns(row.get(completion), completion, "assistant"))


def _reply(turns: list[dict], field: str) -> str:
    """The one assistant reply a preference side holds."""
    if len(turns) != 1 or turns[0]["role"] != "assistant" or turns[0].get("tool_calls"):
        raise RowError("bad_pair", f"'{field}' must be one assistant reply (after the prompt), got "
                       f"{len(turns)} message(s) ({', '.join(t['role'] for t in turns)})")
    if not turns[0]["content"].strip():
        raise RowError("empty_field", f"field '{field}' is empty")
    return turns[0]["content"]


def _preference(row: dict) -> dict:
    """{prompt, chosen, rejected}, plus `messages` (the prompt conversation) when it is more than one user turn."""
    chosen_raw, rejected_raw = row.get("chosen"), row.get("rejected")
    if _missing(row.get("prompt")) and _is_messages(chosen_raw) and _is_messages(rejected_raw):
        # TRL's implicit prompt: both sides are whole conversations; the prompt is their shared prefix.
        chosen, rejected = _message_list(chosen_raw, "chosen"), _message_list(rejected_raw, "rejected")
        k = 0
        while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
            k += 1
        prompt_turns, chosen_turns, rejected_turns = chosen[:k], chosen[k:], rejected[k:]
        if not prompt_turns:
            raise RowError("bad_pair", "'chosen' and 'rejected' share no prompt; give a 'prompt' column")
    else:
        prompt_turns = _turns(row.get("prompt"), "prompt", "user")
        chosen_turns = _turns(chosen_raw, "chosen", "assistant")
        rejected_turns = _turns(rejected_raw, "rejected", "assistant")
    if prompt_turns[-1]["role"] != "user":
        raise RowError("bad_order", "the prompt must end with a user message")
    chosen, rejected = _reply(chosen_turns, "chosen"), _reply(rejected_turns, "rejected")
    if chosen == rejected:
        raise RowError("identical_pair", "'chosen' and 'rejected' are identical")
    out = {"key": prompt_turns[-1]["content"], "prompt": prompt_turns[-1]["content"], "chosen": chosen,
           "rejected": rejected}
    if prompt_turns != [{"role": "user", "content": out["prompt"]}]:
        out["messages"] = prompt_turns
    return out


# 1 and 0 are the keys True and False (equal, same hash) with the same values: written out for the reader.
LABELS = {True: True, False: False, 1: True, 0: False,  # noqa: F601 - see above: a repeat, not a conflict
          "true": True, "false": False, "1": True, "0": False,
          "desirable": True, "undesirable": False, "yes": True, "no": False}


def _unpaired(row: dict) -> dict:
    """{prompt, chosen or rejected, label}: one completion labelled desirable (it is the `chosen` side, `rejected`
    empty) or undesirable (the `rejected` side), TRL's unpaired preference shape (KTO's data)."""
    raw = row.get("label")
    label = LABELS.get(raw.strip().lower() if isinstance(raw, str) else raw) if not isinstance(raw, float) else \
        LABELS.get(int(raw)) if raw in (0.0, 1.0) else None
    if label is None:
        raise RowError("bad_label", f"'label' must be true/false, 1/0 or desirable/undesirable, got {raw!r}")
    prompt_turns = _turns(row.get("prompt"), "prompt", "user")
    if prompt_turns[-1]["role"] != "user":
        raise RowError("bad_order", "the prompt must end with a user message")
    completion = _reply(_turns(row.get("completion"), "completion", "assistant"), "completion")
    out = {"key": prompt_turns[-1]["content"], "prompt": prompt_turns[-1]["content"],
           "chosen": completion if label else "", "rejected": "" if label else completion, "label": label}
    if prompt_turns != [{"role": "user", "content": out["prompt"]}]:
        out["messages"] = prompt_turns
    return out


def _jsonable(value: Any) -> Any:
    """Extra columns as JSON values (dates and other scalars become their text)."""
    return json.loads(json.dumps(value, default=str))


def _prompt(row: dict) -> dict:
    """{prompt, answer} plus `messages` when the prompt is a conversation and `extra`: every other column."""
    raw = row.get("prompt")
    turns = _turns(raw, "prompt", "user")
    if turns[-1]["role"] != "user":
        raise RowError("bad_order", "the prompt must end with a user message")
    if not turns[-1]["content"].strip():
        raise RowError("empty_field", "field 'prompt' is empty")
    out = {"key": turns[-1]["content"], "prompt": turns[-1]["content"], "answer": _text(row, "answer", required=False)}
    if not isinstance(raw, str):
        out["messages"] = turns
    extra = {k: _jsonable(v) for k, v in row.items() if k not in PROMPT_COLUMNS and not _missing(v)}
    if extra:
        out["extra"] = extra
    return out


def with_original_names(good: dict, row: dict, columns: dict[str, str]) -> dict:
    """A prompts row that also carries each mapped column under the user's own name (`columns: {answer:
    solution}`: `solution` as well as `answer`), in `extra`: the user's reward function reads its own column
    names, as TRL passes dataset columns by theirs."""
    originals = {theirs: _jsonable(row[ours]) for ours, theirs in columns.items()
                 if theirs != ours and ours in row and not _missing(row[ours])}
    if not originals:
        return good
    return {**good, "extra": {**originals, **good.get("extra", {})}}


def check_row(kind: str, row: dict[str, Any], fmt: str = "auto",
              columns: dict[str, str] | None = None) -> tuple[dict | None, str]:
    """Validate one raw row: (canonical row, "") if good, else (None, reason)."""
    good, _, reason = classify_row(kind, row, fmt, columns)
    return good, reason


def classify_row(kind: str, row: dict[str, Any], fmt: str = "auto",
                 columns: dict[str, str] | None = None) -> tuple[dict | None, str, str]:
    """(canonical row, "", "") if good, else (None, reason code, reason).

    The canonical row's `group` decides its train/eval split: the row's optional `group` field, or
    else its prompt. Rows that share a group (one problem asked in several wordings) land in the
    same split, so a held-out problem is never trained on under another phrasing.
    """
    try:
        row = map_columns(row, columns or {})
        fmt = detect_format(kind, [k for k in row if not _missing(row[k])]) if fmt == "auto" else fmt
        good = _canonical(kind, row, fmt)
        if kind == "prompts":
            good = with_original_names(good, row, columns or {})
        good["group"] = _text(row, "group", required=False) or good["key"]
        return good, "", ""
    except RowError as exc:
        return None, exc.code, str(exc)
    except RecursionError:  # a value nested deeper than Python's JSON codec goes (an `extra` column, tool arguments)
        return None, "too_deep", "a value nested too deeply to read"


def _canonical(kind: str, row: dict[str, Any], fmt: str) -> dict:
    if fmt not in FORMATS.get(kind, ()):
        raise RowError("unknown_format", f"format {fmt!r} is not one of {kind}'s: {', '.join(FORMATS.get(kind, ()))}")
    if kind == "sft":
        messages = _sft(row, fmt)
        key = next((m["content"] for m in messages if m["role"] == "user"), messages[0]["content"])
        return {"key": key, "messages": messages}
    if kind == "preference":
        return _unpaired(row) if fmt == "unpaired" else _preference(row)
    return _prompt(row)
