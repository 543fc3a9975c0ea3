"""The steps each row of the data stage goes through: pure row functions (its split, its order, its chat
template with the assistant spans, the loss mask, packing), then the Ray Data steps that apply them (read and
validate, count, tokenize in the workers, pack). The stage (`stages/data/__init__.py`) chains them.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from pipeline import events
from stages.data.formats import RowError, classify_row
from stages.data.safe_read import parse_record
from stages.data.sources import SourceConfig, read_source

if TYPE_CHECKING:
    from stages.data import DataConfig


# --------------------------------------------------------------------------- pure row functions


def split_of(key: str, seed: int, eval_fraction: float) -> str:
    """'eval' or 'train', a stable function of (seed, prompt) (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "big") / 2**64 < eval_fraction else "train"


def shuffle_key(payload: str, seed: int) -> str:
    """A seeded hash of a row: sorting by it puts the rows in a pseudo-random, reproducible order.

    The dedupe step groups rows by (kind, shuffle_key, payload), and Ray Data's groupby sorts by
    its keys; grouped by the payload alone, the written datasets came out sorted by prompt, so
    every training batch held near-identical problems (one sort-ordered sweep per epoch), which
    kept SFT and the reward model far from what the same data teaches when shuffled.
    """
    return hashlib.blake2b(f"order\x00{seed}\x00{payload}".encode(), digest_size=8).hexdigest()


def render_with_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Chat-template text of a conversation and the character spans of its assistant replies.

    Works for any template that renders a conversation's prefix as a prefix of the whole text
    (every mainstream chat template does): the span of reply i runs from the end of
    `template(messages[:i], add_generation_prompt=True)` to the end of `template(messages[:i+1])`,
    less trailing whitespace, so it covers the reply and the template's end-of-turn token.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False).rstrip()
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ValueError("the tokenizer's chat template does not render prefixes stably; cannot mask assistant "
                             "turns")
        spans.append((len(before), len(upto)))
    return text, spans


def loss_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for tokens whose first character lies in an assistant span, else 0."""
    return [int(any(s <= start < e for s, e in spans) and end > start) for start, end in offsets]


def pack_rows(rows: list[tuple[list[int], list[int]]], max_len: int) -> list[dict]:
    """Greedily concatenate (input_ids, loss_mask) rows into rows of at most `max_len` tokens.

    `position_ids` restart at 0 for each conversation so positions match unpacked training.
    """
    packed, ids, mask, pos = [], [], [], []
    for row_ids, row_mask in rows:
        if ids and len(ids) + len(row_ids) > max_len:
            packed.append({"input_ids": ids, "loss_mask": mask, "position_ids": pos})
            ids, mask, pos = [], [], []
        ids, mask, pos = ids + row_ids, mask + row_mask, pos + list(range(len(row_ids)))
    if ids:
        packed.append({"input_ids": ids, "loss_mask": mask, "position_ids": pos})
    return packed


# --------------------------------------------------------------------------- Ray Data steps
# All three row kinds travel through one Ray Data pipeline with one schema, so the whole stage
# costs one read pass, one tokenizing pass and one materialisation (Ray Data's fixed cost per
# execution dominates at this data size; docs/architecture.md, fact 12).

# Columns each kind writes, besides `num_tokens`.
COLUMNS = {
    "sft": ("prompt", "input_ids", "loss_mask"),
    "preference": ("prompt", "chosen", "rejected", "chosen_input_ids", "chosen_loss_mask",
                   "rejected_input_ids", "rejected_loss_mask"),
    "prompts": ("prompt", "answer", "prompt_ids", "extra"),  # extra: the row's other columns, JSON (reward functions)
}
TEXT_COLUMNS = ("kind", "split", "order", "prompt", "chosen", "rejected", "answer", "extra")
ID_COLUMNS = ("input_ids", "loss_mask", "chosen_input_ids", "chosen_loss_mask", "rejected_input_ids",
              "rejected_loss_mask", "prompt_ids", "position_ids")
TOKEN_COLUMN = {"sft": "input_ids", "preference": "chosen_input_ids", "prompts": "prompt_ids"}


def _raw_rows(batch, json_text: bool) -> list[dict | str]:
    """A batch's raw records: JSON sources arrive as one `text` column of records (parsed here, so a
    malformed one is a bad row, not a failed read); other sources as their own columns."""
    rows = batch.to_pylist()
    return [parse_record(r["text"]) for r in rows] if json_text else rows


def split_with_eval(kind: str, group: str, seed: int, eval_fraction: float, eval_groups: frozenset | None) -> str:
    """A row's split. Without a user's eval set: the seeded hash of its group. With one (`eval_groups`): the
    eval rows are the prompts' eval split, every row sharing a group with them is held out of training
    (sft and preference rows go to their eval split; prompt rows are not written), and the other prompt rows
    all train, since the user's set is the evaluation."""
    if kind == "eval":
        return "eval"
    if eval_groups is None:
        return split_of(group, seed, eval_fraction)
    if group in eval_groups:
        return "in_eval_set" if kind == "prompts" else "eval"
    return "train" if kind == "prompts" else split_of(group, seed, eval_fraction)


def _validate_batch(batch, kind: str, source: str, fmt: str, columns: dict, json_text: bool, seed: int,
                    eval_fraction: float, eval_groups: frozenset | None = None):
    """Raw rows -> one uniform schema (kind, key, split, order, payload JSON, code, error, source)."""
    import pyarrow as pa

    out: dict[str, list] = {c: [] for c in ("kind", "key", "split", "order", "payload", "code", "error", "source")}
    rows_kind = "prompts" if kind == "eval" else kind  # a user's eval rows are prompt rows
    for row in _raw_rows(batch, json_text):
        good, code, error = ((None, "invalid_json", row) if isinstance(row, str)
                             else classify_row(rows_kind, row, fmt, columns))
        payload = json.dumps(good, sort_keys=True) if good else ""
        out["kind"].append(kind)
        out["key"].append(good["key"] if good else "")
        out["split"].append(split_with_eval(kind, good["group"], seed, eval_fraction, eval_groups) if good else "")
        out["order"].append(shuffle_key(payload, seed))
        out["payload"].append(payload)
        out["code"].append(code)
        out["error"].append(error)
        out["source"].append(source)
    return pa.table(out)


def read_kind(kind: str, source: SourceConfig | list[dict], cfg: DataConfig, seed: int,
              eval_groups: frozenset | None = None):
    """A lazy Ray dataset of validated rows from one source or from generated rows."""
    import ray.data

    if isinstance(source, list):
        parts, name, fmt, columns = [(ray.data.from_items(source), False)], "generated", "auto", {}
    else:
        # `auto` is decided per row: one file may mix shapes (chat rows beside prompt + response rows)
        parts, name, fmt, columns = read_source(source), source.path, source.format, source.columns
    validated = [ds.map_batches(_validate_batch, batch_format="pyarrow", batch_size=cfg.batch_size,
                                fn_kwargs={"kind": kind, "source": name, "fmt": fmt, "columns": columns,
                                           "json_text": json_text, "seed": seed, "eval_fraction": cfg.eval_fraction,
                                           "eval_groups": eval_groups})
                 for ds, json_text in parts]
    return validated[0].union(*validated[1:]) if len(validated) > 1 else validated[0]


def first_row(group):
    return group.slice(0, 1)


def _partial_counts(batch, columns: list[str]):
    """Row counts per distinct value of `columns` within one batch (summed by `count_by`)."""
    import pyarrow as pa

    return pa.table({"counts": [json.dumps(batch.group_by(columns).aggregate([([], "count_all")]).to_pylist())]})


def count_by(ds, columns: list[str]) -> dict[tuple, int]:
    """Rows per value of `columns`, from per-block partial counts: no shuffle.

    A `groupby().count()` would start Ray Data's hash-shuffle aggregators, seconds of fixed
    cost for a few small numbers.
    """
    totals: dict[tuple, int] = {}
    for row in ds.map_batches(_partial_counts, batch_format="pyarrow", fn_kwargs={"columns": columns}).take_all():
        for part in json.loads(row["counts"]):
            key = tuple(part[c] for c in columns)
            totals[key] = totals.get(key, 0) + part["count_all"]
    return totals


def _table(rows: list[dict]):
    """Rows -> a pyarrow table with explicit types (ragged int lists, not numpy object arrays)."""
    import pyarrow as pa

    cols = {c: pa.array([r.get(c, "") for r in rows], pa.string()) for c in TEXT_COLUMNS}
    cols.update({c: pa.array([r.get(c, []) for r in rows], pa.list_(pa.int32())) for c in ID_COLUMNS})
    cols["num_tokens"] = pa.array([len(r.get(TOKEN_COLUMN[r["kind"]], [])) for r in rows], pa.int64())
    return pa.table(cols)


class Tokenize:
    """Validated payload rows of any kind -> token ids and loss masks (one per process: `tokenize_batch`).

    Rows too long to use are kept as `split = "dropped:<split>"`, and rows the chat template cannot
    render as given (tool calls a template ignores) as `split = "invalid:<code>"`, so the stage can
    count them in the same pass; neither is ever written.
    """

    def __init__(self, tokenizer_path: str, max_len: int, system_prompt: str | None, total_rows: int | None = None):
        from stages.common.models import load_tokenizer

        self.tok, self.max_len, self.system = load_tokenizer(tokenizer_path), max_len, system_prompt
        self.total_rows = total_rows  # for the console's progress (rows done out of this, over all processes)

    def _with_system(self, messages: list[dict]) -> list[dict]:
        if self.system and messages[0]["role"] != "system":
            return [{"role": "system", "content": self.system}] + messages
        return messages

    def _conversation(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        messages = self._with_system(messages)
        text, spans = render_with_spans(self.tok, messages)
        if any(m.get("tool_calls") for m in messages):
            bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
            if self.tok.apply_chat_template(bare, tokenize=False) == text:
                raise RowError("template_ignores_tools", "the model's chat template does not render tool_calls; "
                               "use a model whose template supports tools, or drop these rows")
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], loss_mask(enc["offset_mapping"], spans)

    def _row(self, kind: str, row: dict) -> tuple[dict, bool]:
        """(tokenized row, fits in max_len)."""
        if kind == "sft":
            ids, mask = self._conversation(row["messages"])
            ids, mask = ids[: self.max_len], mask[: self.max_len]  # truncate; usable while a reply remains
            return {"prompt": row["key"], "input_ids": ids, "loss_mask": mask}, any(mask)
        prompt = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if kind == "preference" and "label" in row:  # unpaired (KTO): one conversation, the absent side masked out
            ids, mask = self._conversation(prompt
                                           + [{"role": "assistant", "content": row["chosen"] or row["rejected"]}])
            none = [0] * len(ids)
            out = {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"],
                   "chosen_input_ids": ids, "chosen_loss_mask": mask if row["label"] else none,
                   "rejected_input_ids": ids, "rejected_loss_mask": none if row["label"] else mask}
            return out, len(ids) <= self.max_len
        if kind == "preference":
            c_ids, c_mask = self._conversation(prompt + [{"role": "assistant", "content": row["chosen"]}])
            r_ids, r_mask = self._conversation(prompt + [{"role": "assistant", "content": row["rejected"]}])
            out = {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"],
                   "chosen_input_ids": c_ids, "chosen_loss_mask": c_mask,
                   "rejected_input_ids": r_ids, "rejected_loss_mask": r_mask}
            return out, max(len(c_ids), len(r_ids)) <= self.max_len  # truncation could erase the difference
        text = self.tok.apply_chat_template(self._with_system(prompt), tokenize=False, add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        extra = json.dumps(row["extra"], sort_keys=True) if row.get("extra") else ""
        return {"prompt": row["prompt"], "answer": row["answer"], "prompt_ids": ids,
                "extra": extra}, len(ids) < self.max_len

    def __call__(self, batch):
        rows = []
        for kind, split, order, payload in zip(batch["kind"].to_pylist(), batch["split"].to_pylist(),
                                               batch["order"].to_pylist(), batch["payload"].to_pylist()):
            try:
                if kind == "eval":  # the user's eval set: prompt rows, in the prompts' eval split
                    kind = "prompts"
                out, fits = self._row(kind, json.loads(payload))
                rows.append({**out, "kind": kind, "split": split if fits else f"dropped:{split}", "order": order})
            except RowError as exc:
                rows.append({"kind": kind, "split": f"invalid:{exc.code}", "prompt": str(exc), "order": order})
        if self.total_rows:
            events.advance("data: tokenize", by=len(rows), total=self.total_rows, unit="row")
        return _table(rows)


_TOKENIZERS: dict[tuple, Tokenize] = {}  # per process: (path, its mtime, max_len, system prompt, total) -> Tokenize


def tokenize_batch(batch, tokenizer_path: str, max_len: int, system_prompt: str | None, total_rows: int | None = None):
    """Ray Data task: `Tokenize` a batch with this process's own `Tokenize`, made on its first batch and kept.

    Tasks, not an actor pool: the stage's worker processes are up already (they read and validated the
    rows), where a pool started processes of its own, each importing transformers before its first row
    (11 of the default's 45 s, issue 60). A process keeps the tokenizer it loaded, keyed by the model
    directory and its modification time, so a rewritten directory is loaded anew."""
    import os

    try:
        mtime = os.stat(tokenizer_path).st_mtime_ns
    except OSError:
        mtime = 0
    key = (tokenizer_path, mtime, max_len, system_prompt, total_rows)
    if key not in _TOKENIZERS:  # (not `startup.lean_imports`: it would put the Train stages' code in this key)
        _TOKENIZERS[key] = Tokenize(tokenizer_path, max_len, system_prompt, total_rows)
    return _TOKENIZERS[key](batch)


def first_of_each(table, keys: list[str]):
    """`table` sorted by `keys`, one row per distinct key (the first): the dedupe of a small dataset in one
    process, in the order Ray Data's `groupby(keys, num_partitions=1).map_groups(first_row)` gives."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = table.sort_by([(k, "ascending") for k in keys])
    if table.num_rows < 2:
        return table
    same = None
    for k in keys:
        column = table.column(k)
        equal = pc.equal(column.slice(1), column.slice(0, table.num_rows - 1))
        same = equal if same is None else pc.and_(same, equal)
    return table.filter(pa.concat_arrays([pa.array([True]), pc.invert(same).combine_chunks()]))


def pack_batch(batch, max_len: int):
    import pyarrow as pa

    rows = list(zip(batch["input_ids"].to_pylist(), batch["loss_mask"].to_pylist()))
    packed = pack_rows(rows, max_len)
    return pa.table({
        "prompt": pa.array([""] * len(packed), pa.string()),
        "input_ids": pa.array([p["input_ids"] for p in packed], pa.list_(pa.int32())),
        "loss_mask": pa.array([p["loss_mask"] for p in packed], pa.list_(pa.int32())),
        "position_ids": pa.array([p["position_ids"] for p in packed], pa.list_(pa.int32())),
        "num_tokens": pa.array([len(p["input_ids"]) for p in packed], pa.int64()),
    })
