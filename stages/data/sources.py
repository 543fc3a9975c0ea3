"""Where the data stage's rows come from: a user's sources (a path, a directory or a glob, a format,
a column mapping) and the Ray datasets that read them.

A source is written as a path, or as a mapping when it needs more:

    stages:
      data:
        sources:
          sft: [data/chats.jsonl.gz]                                   # format recognised from its columns
          prompts:
            - {path: "data/rl/*.parquet", columns: {prompt: question, answer: final}}
            - {path: data/hf_saved, split: test}                      # a `datasets` save_to_disk directory

Files: JSON Lines (`.jsonl`, `.json`, also gzipped), JSON arrays (`.json` starting with `[`), Parquet
(one file, shards, directories), CSV, and datasets saved with `datasets`' `save_to_disk` (read with
`datasets.load_from_disk` and handed to Ray Data as its Arrow table: `ray.data.from_huggingface`
first asks the Hub for Parquet files of the dataset, a network call this pipeline must not make).

JSON is read as text, one record per row, and parsed in the validation step rather than by
Ray Data's columnar JSON reader: chat data mixes types within a column (`content` a string on one
turn and a list of parts on the next, `arguments` an object or a string), which a columnar reader
refuses for the whole file, while here only a row that is actually malformed is dropped and counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.schema import Section
import stages.data.safe_read as safe_read
import stages.data.files as reader
from stages.data.files import SUFFIXES, file_type, is_json_array, iter_rows, open_text
from stages.data.formats import FORMATS, KINDS, detect_format, map_columns

FORMAT_NAMES = ("auto", *dict.fromkeys(f for fmts in FORMATS.values() for f in fmts))
# The canonical columns a mapping may name, per kind (what `formats` reads).
CANONICAL = {
    "sft": ("messages", "conversations", "instruction", "input", "output", "system", "prompt", "completion",
            "response", "group"),
    "preference": ("prompt", "chosen", "rejected", "group"),
    "prompts": ("prompt", "answer", "group"),
}
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_hf_dataset(path: Path) -> bool:
    """A directory written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict of splits)."""
    return path.is_dir() and any((path / m).is_file() for m in HF_MARKERS)


class SourceConfig(Section):
    """One source of rows: a file, a directory or a glob, with an optional format and column mapping."""

    path: str = Field(..., description="A file, a directory (every supported file under it, or a `datasets` "
                      "save_to_disk directory) or a glob (`data/*.parquet`, `data/**/*.jsonl`).")
    format: Literal[FORMAT_NAMES] = Field("auto", description="Row format: `auto` (recognised by the columns; the "
                                          "data stage says what it chose), or sft: messages / sharegpt / alpaca / "
                                          "prompt_completion; preference: preference; prompts: prompts.")
    columns: dict[str, str] = Field({}, description="Column mapping, ours to yours: `{prompt: question, answer: "
                                    "solution}` reads your `question` column as `prompt`.")
    split: str | None = Field(None, description="For a save_to_disk DatasetDict: the split to read (default: train).")

    @field_validator("path")
    @classmethod
    def _resolves(cls, v: str) -> str:
        path = Path(v).expanduser()
        text = str(path if path.is_absolute() else Path.cwd() / path)
        if not safe_read.has_magic(text) and not Path(text).exists():
            raise ValueError(f"not found: {text} (check the path; relative paths start at the current directory)")
        return text

    @model_validator(mode="after")
    def _has_files(self) -> "SourceConfig":
        self.files()  # raises naming the path when nothing usable is there
        return self

    def files(self) -> list[Path]:
        """The files this source reads, sorted (a save_to_disk directory: its own files, for the cache key)."""
        return list_files(self.path)

    def describe(self) -> str:
        return self.path if not self.columns else f"{self.path} (columns {self.columns})"


def list_files(path: str) -> list[Path]:
    """The files a source path reads, sorted: the file, every supported file under the directory, or the glob's
    matches (a save_to_disk directory: its own files, for the cache key). A file reached twice through links
    is read once, under its first name in sorted order; a link out of the directory (or the glob's fixed
    part) is refused (`safe_read.inside`). Raises ValueError naming the path when nothing usable is there."""
    root = Path(path)
    if is_hf_dataset(root):
        return safe_read.inside(safe_read.unique_files([p for p in safe_read.walk_files(root) if p.is_file()]), root)
    if safe_read.has_magic(path):
        folder, found = safe_read.glob_root(path), safe_read.glob_files(path)
    elif root.is_dir():
        folder, found = root, list(safe_read.walk_files(root))
    else:
        folder, found = None, [root]
    usable = safe_read.unique_files([p for p in found if p.is_file() and file_type(p)])
    if not usable:
        unsupported = sorted({p.suffix or p.name for p in found if p.is_file()})
        raise ValueError(f"{path}: no files to read{' (found ' + ', '.join(unsupported) + ')' if unsupported else ''}; "
                         f"supported: {', '.join(SUFFIXES)} and `datasets` save_to_disk directories")
    if root.is_file() and not file_type(root):
        raise ValueError(f"{root.name}: unsupported file type; use one of {', '.join(SUFFIXES)}")
    return safe_read.inside(usable, folder)


def source_list(value):
    """A source written as a bare path is `{path: ...}`."""
    if value is None:
        return []
    return [{"path": str(v)} if isinstance(v, (str, Path)) else v for v in value]


class SourcesConfig(Section):
    """Raw sources per row kind: a path, directory or glob each, or {path, format, columns, split}."""

    sft: list[SourceConfig] = Field([], description="SFT conversations: OpenAI `messages`, ShareGPT, Alpaca or "
                                    "prompt + completion rows.")
    preference: list[SourceConfig] = Field([], description="Preference pairs: `prompt`, `chosen`, `rejected` "
                                           "(text or message lists, TRL's shape).")
    prompts: list[SourceConfig] = Field([], description="RL prompts: `prompt` (+ optional `answer`; other columns are "
                                        "kept for reward functions).")
    eval: list[SourceConfig] = Field([], description="Your own held-out prompts (the prompts format): they become "
                                     "the prompts' eval split that SFT's accuracy and PPO's evaluation and eval_every "
                                     "curve score, and every row of any kind sharing a prompt (group) with them is "
                                     "kept out of training.")

    @field_validator("sft", "preference", "prompts", "eval", mode="before")
    @classmethod
    def _paths_are_sources(cls, v):
        return source_list(v)

    @model_validator(mode="after")
    def _formats_fit_kinds(self) -> "SourcesConfig":
        for kind in (*KINDS, "eval"):
            rows = "prompts" if kind == "eval" else kind  # eval rows are prompt rows
            for i, src in enumerate(getattr(self, kind)):
                where = f"stages.data.sources.{kind}[{i}]"
                if src.format != "auto" and src.format not in FORMATS[rows]:
                    raise ValueError(f"{where}.format: {src.format!r} is not a {kind} format; use auto or "
                                     f"{', '.join(FORMATS[rows])}")
                unknown = sorted(set(src.columns) - set(CANONICAL[rows]))
                if unknown:
                    raise ValueError(f"{where}.columns: {', '.join(unknown)} not a {kind} column; the keys are ours "
                                     f"({', '.join(CANONICAL[rows])}) and the values yours, e.g. {{prompt: question}}")
        return self

    def any(self) -> bool:
        return any(getattr(self, k) for k in (*KINDS, "eval"))


# --------------------------------------------------------------------------- reading


def peek_columns(src: SourceConfig) -> list[str]:
    """The columns of a source's first record, read on the driver without Ray (for `auto`)."""
    if is_hf_dataset(Path(src.path)):
        return list(load_hf(src).column_names)
    first = src.files()[0]
    if file_type(first) == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(first).names)
    for _, row in iter_rows(first):
        if isinstance(row, dict):
            return [k for k, v in row.items() if v is not None]
    return []


def resolve_format(kind: str, src: SourceConfig) -> str:
    """The source's format: as configured, or recognised from its first record's (mapped) columns."""
    if src.format != "auto":
        return src.format
    columns = peek_columns(src)
    return detect_format(kind, map_columns(dict.fromkeys(columns, ""), src.columns))


def load_hf(src: SourceConfig):
    """A `datasets` Dataset from a save_to_disk directory (the split of a DatasetDict), memory-mapped;
    refused, naming the column, when a column is of an extension type (`safe_read.extension_problem`),
    before any value is read."""
    import datasets

    loaded = datasets.load_from_disk(src.path)
    if isinstance(loaded, datasets.DatasetDict):
        split = src.split or "train"
        if split not in loaded:
            raise ValueError(f"{src.path}: no split {split!r} in this DatasetDict (it has {', '.join(loaded)}); "
                             "set `split:` on the source")
        loaded = loaded[split]
    problem = safe_read.extension_problem(loaded.data.schema)
    if problem:
        raise ValueError(f"{src.path}: {problem}")
    return loaded


def json_array_records(path: Path) -> list[dict]:
    """A JSON array file's items as `text` records, parsed one item at a time (an item that is not an
    object stays, to be counted bad); a malformed or too large array, or an item nested too deeply to
    find its end, is an error naming the file."""
    out: list[dict] = []
    try:
        with open_text(path) as f:
            for _, item in safe_read.json_array_items(f):
                out.append({"text": item})
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path}: row {len(out) + 1}: {safe_read.too_deep()}") from None
    except safe_read.ArrayTooLarge:
        raise ValueError(f"{path}: {safe_read.array_too_large()}") from None
    return out


def read_source(src: SourceConfig) -> list[tuple[object, bool]]:
    """Lazy Ray datasets of the source's raw rows, each with whether it holds JSON text: a `text` column
    of JSON records for JSON files, the file's own columns for Parquet, CSV and save_to_disk datasets.
    Every file is checked first, on the driver (`files.check`): a refused one raises `safe_read.Refused`
    (a ValueError) naming it, where and the fix, before Ray reads anything."""
    import pyarrow.csv
    import ray.data

    from stages.common.parquet import read_parquet

    if is_hf_dataset(Path(src.path)):
        return [(ray.data.from_arrow(load_hf(src).with_format("arrow")[:]), False)]  # memory-mapped; indices applied
    by_type: dict[str, list[Path]] = {}
    for f in src.files():
        reader.check(f)
        by_type.setdefault(file_type(f), []).append(f)
    parts: list[tuple[object, bool]] = []
    for typ, paths in by_type.items():
        if typ == "parquet":
            parts.append((read_parquet(paths), False))
        elif typ == "csv":  # a block holds at least one whole row: a row over the cap fails the read, then is named
            options = pyarrow.csv.ReadOptions(use_threads=False, block_size=safe_read.MAX_RECORD_BYTES)
            parts.append((ray.data.read_csv([str(f) for f in paths], read_options=options), False))
        else:
            lines = [f for f in paths if not is_json_array(f)]
            if lines:
                parts.append((ray.data.read_text([str(f) for f in lines]), True))
            for f in paths:
                if f not in lines:  # a JSON array is one document: the driver parses it, item by item
                    parts.append((ray.data.from_items(json_array_records(f)), True))
    return parts


def records(src: SourceConfig):
    """A source's raw records on the driver, in file order (invalid rows are skipped: the Ray pass counts them);
    a refused file raises `safe_read.Refused`, as `read_source` does (`files.rows`)."""
    if is_hf_dataset(Path(src.path)):
        yield from load_hf(src)
        return
    for f in src.files():
        yield from reader.rows(f)
