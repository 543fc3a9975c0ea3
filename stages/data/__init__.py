"""Data stage: raw rows -> tokenized Parquet datasets for SFT, preference pairs and RL prompts.

Built on Ray Data, reading top to bottom:

    read (jsonl / parquet / csv, or the generated task set)
      -> validate each row (`on_bad_rows: drop | fail`; a bad file is named with its line)
      -> deduplicate -> split train/eval by a seeded hash of the row's group (default: its prompt)
      -> chat template + tokenize (`map_batches` tasks; each process keeps its tokenizer) + truncate to `max_len`
         + loss mask (1 on assistant tokens only) [+ pack SFT rows]
      -> Parquet: <out>/sft/{train,eval}, <out>/preference/{train,eval}, <out>/prompts/{train,eval}

The split is a pure function of (seed, group), not a random permutation: it needs no global
shuffle, is the same on every rerun, and a prompt that is held out is held out in *every* dataset
(SFT eval prompts never appear in preference or RL training), which keeps later accuracy honest.
A row's group is its optional `group` field, else its prompt: the generated task sets it to the
problem itself (`7 + 35`), so a held-out problem is held out in every wording.

Run alone: `python -m pipeline run configs/full.yaml --only data` (after the `model` stage).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from pipeline import events
from pipeline.errors import DataError
from pipeline.schema import Section
from stages.data.files import locate_problem
from stages.data.formats import KINDS, RowError, check_row
from stages.data.sources import SourceConfig, SourcesConfig, resolve_format
from stages.data.steps import COLUMNS, count_by, first_of_each, first_row, pack_batch, read_kind, tokenize_batch

if TYPE_CHECKING:  # annotations only: the data stage's key does not cover the storage code
    from pipeline.stage import StageContext
    from pipeline.run_storage import RunStorage


# A validated dataset up to this size is deduplicated in the driver (`_unique`), a larger one by Ray Data.
DRIVER_DEDUPE_MAX_BYTES = 256 * 2**20

# The generated task's default row counts per kind, used when the config gives no sources at all.
GENERATE_DEFAULTS = {"sft": 4000, "preference": 2000, "prompts": 1000}


class GenerateConfig(Section):
    """Row counts drawn from the task for kinds without sources of their own. Unset: the defaults when no
    sources are given at all, else 0 (a user's own data is never topped up with generated arithmetic unless
    asked, and a kind with its own sources is never mixed with it)."""

    sft: int | None = Field(None, ge=0,
                            description="SFT conversations to generate (unset: 4000 without sources, else 0).")
    preference: int | None = Field(None, ge=0,
                                   description="Preference pairs to generate (unset: 2000 without sources, else 0).")
    prompts: int | None = Field(None, ge=0, description="RL prompts with reference answers to generate (unset: 1000 "
                                "without sources, else 0).")

    def count(self, kind: str, sources: SourcesConfig) -> int:
        n = getattr(self, kind)
        return n if n is not None else (0 if sources.any() else GENERATE_DEFAULTS[kind])


class DataConfig(Section):
    """The data stage."""

    sources: SourcesConfig = Field(default_factory=SourcesConfig,
                                   description="Raw sources per row kind (docs/data.md).")
    generate: GenerateConfig = Field(default_factory=GenerateConfig, description="Generated rows per kind.")
    max_len: int = Field(128, ge=8, le=65536,
                         description="Tokens per row; longer SFT rows are truncated, longer pairs/prompts dropped.")
    pack: bool = Field(False, description="Pack several SFT conversations into each max_len row (position ids restart "
                                          "per conversation).")
    eval_fraction: float = Field(0.05, gt=0, lt=1,
                                 description="Share of prompts held out for evaluation (by seeded hash of the prompt).")
    dedupe: bool = Field(True, description="Drop exact duplicate rows within each kind.")
    on_bad_rows: Literal["drop", "fail"] = Field("drop", description="'drop': skip invalid rows and count them; "
                                                                     "'fail': stop at the first, naming file and line.")
    system_prompt: str | None = Field(None, description="System message prepended to conversations that have none.")
    batch_size: int = Field(256, ge=1, description="Rows per Ray Data batch for validation and tokenization.")
    tokenizer_actors: int = Field(2, ge=1, description="Processes that tokenize at once (Ray Data tasks; each process "
                                  "loads the tokenizer on its first batch and keeps it).")

    @model_validator(mode="after")
    def _some_data(self) -> "DataConfig":
        kinds = [k for k in KINDS if getattr(self.sources, k) or self.generate.count(k, self.sources)]
        if not kinds:
            raise ValueError("no data: give stages.data.sources files or a stages.data.generate count above 0")
        return self


# --------------------------------------------------------------------------- the stage


def check(pipeline_cfg) -> None:
    """Rows of `max_len` tokens fit the embedded model's positions."""
    limit, data = pipeline_cfg.model.builtin.max_position_embeddings, pipeline_cfg.stages.data
    if pipeline_cfg.model.is_builtin and data.max_len > limit:
        raise ValueError(f"stages.data.max_len ({data.max_len}) exceeds model.builtin.max_position_embeddings "
                         f"({limit}); lower one or raise the other")


def raw_inputs(pcfg) -> list[Path]:
    """Files whose contents are part of this stage's cache key."""
    s = pcfg.stages.data.sources
    return [f for kind in (*KINDS, "eval") for src in getattr(s, kind) for f in src.files()]


def _sources(cfg: DataConfig, pcfg) -> list[tuple[str, SourceConfig | list[dict]]]:
    """(kind, source or generated rows) for every input. A kind with sources of its own is never mixed with
    generated rows; one without gets them when its count is set, or by default when the config gives no
    sources at all (`GenerateConfig.count`)."""
    from stages.common import tasks

    make = {"sft": tasks.sft_rows, "preference": tasks.preference_rows, "prompts": tasks.prompt_rows}
    out: list[tuple[str, SourceConfig | list[dict]]] = []
    for kind in KINDS:
        own = getattr(cfg.sources, kind)
        n = 0 if own else cfg.generate.count(kind, cfg.sources)
        out += [(kind, src) for src in own] + ([(kind, make[kind](n, pcfg.seed, pcfg.task))] if n else [])
    return out + [("eval", src) for src in cfg.sources.eval]


def eval_groups(cfg: DataConfig) -> frozenset | None:
    """The groups (prompts) of the user's own eval set, read on the driver (an eval set is small), or None."""
    from stages.data.sources import records

    if not cfg.sources.eval:
        return None
    groups = set()
    for i, src in enumerate(cfg.sources.eval):
        try:
            for row in records(src):
                good, _ = check_row("prompts", row, src.format, src.columns)
                if good:
                    groups.add(good["group"])
        except ValueError as exc:  # a file refused (safe_read.Refused), as the other kinds' are; a missing split
            raise DataError(f"stages.data.sources.eval[{i}]: {exc}") from None
    if not groups:
        raise DataError("stages.data.sources.eval: no usable rows (they need a 'prompt'; map yours with `columns:`)")
    return frozenset(groups)


def _locate(kind: str, src: SourceConfig, parse_only: bool = False) -> str | None:
    """The first problem in a source's files (in file order), naming the file and line."""
    from stages.data.sources import is_hf_dataset

    if is_hf_dataset(Path(src.path)):
        return None
    kind = "prompts" if kind == "eval" else kind
    fmt = "auto" if parse_only else resolve_format(kind, src)
    return next(filter(None, (locate_problem(f, kind, fmt, src.columns, parse_only) for f in src.files())), None)


def _format_note(kind: str, src: SourceConfig) -> str:
    """What the progress line says about a source's format: as set, or what its first record looks like."""
    kind = "prompts" if kind == "eval" else kind
    if src.format != "auto":
        return f"format {src.format}"
    try:
        return f"format {resolve_format(kind, src)} (recognised from its columns; each row is checked on its own)"
    except RowError as exc:
        return f"first record fits no format: {exc}"


def _checked(sources, cfg: DataConfig, pcfg, progress):
    """Read and validate all sources into one materialised dataset; name the source on read errors."""
    parts, held_out = [], eval_groups(cfg)
    if held_out is not None:
        progress(f"eval: {len(held_out)} prompts of your own held out of every training split")
    for kind, src in sources:
        try:
            parts.append(read_kind(kind, src, cfg, pcfg.seed, held_out))
        except ValueError as exc:  # a file refused (safe_read.Refused), columns that fit no format, a missing split
            at = f"[{getattr(cfg.sources, kind).index(src)}]" if isinstance(src, SourceConfig) else ""
            raise DataError(f"stages.data.sources.{kind}{at}: {exc}") from None
        progress(f"{kind}: {len(src)} generated rows" if isinstance(src, list) else
                 f"{kind}: {src.describe()}: {len(src.files())} file(s), {_format_note(kind, src)}")
    ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    try:
        return ds.materialize()
    except Exception:  # Ray wraps reader errors; locate the bad file and line ourselves
        for kind, src in sources:
            problem = _locate(kind, src, parse_only=True) if isinstance(src, SourceConfig) else None
            if problem:
                raise DataError(f"{problem} (fix the file, or remove it from stages.data.sources.{kind})") from None
        raise  # not a problem in the user's files: a real failure, shown with its traceback


def _counts(checked, on_bad_rows: str, sources) -> tuple[dict[tuple[str, str], int], dict[tuple[str], int]]:
    """(invalid rows per (kind, reason code), valid rows per (kind,)), counted in one pass; with
    on_bad_rows=fail, raise naming the first invalid row's file and line."""
    from ray.data.expressions import col

    both = count_by(checked, ["kind", "code"])  # a valid row's code is ""
    counts = {(kind, code): n for (kind, code), n in both.items() if code}
    valid = {(kind,): n for (kind, code), n in both.items() if not code}
    if counts and on_bad_rows == "fail":
        first = checked.filter(expr=col("error") != "").take(1)[0]
        src = next((s for k, s in sources if k == first["kind"] and isinstance(s, SourceConfig)
                    and s.path == first["source"]), None)
        where = _locate(first["kind"], src) if src is not None else None
        raise DataError(f"{where or first['source'] + ': ' + first['error']} ({sum(counts.values())} invalid rows; "
                        "fix them, or set stages.data.on_bad_rows=drop to skip and count them)")
    return counts, valid


def _unique(good, dedupe: bool):
    """(the valid rows, each once when `dedupe`; how many). A small dataset is deduplicated here, in this
    process (`first_of_each`): Ray Data's groupby starts a shuffle whose fixed cost (13 of the default's
    45 s for 19k rows, issue 60) dwarfs the work at that size; a larger one goes through the groupby.
    Both give the same rows in the same order (tests/test_data_stage.py)."""
    import pyarrow as pa
    import ray
    import ray.data

    if not dedupe:
        return good, good.count()
    keys = ["kind", "order", "payload"]
    good = good.materialize()
    if good.size_bytes() <= DRIVER_DEDUPE_MAX_BYTES:
        tables = [t for t in ray.get(good.to_arrow_refs()) if t.num_rows]
        if not tables:
            return good, 0
        table = first_of_each(pa.concat_tables(tables), keys)
        return ray.data.from_arrow(table), table.num_rows
    # Grouping by the seeded `order` hash first shuffles the rows as a side effect of the sort.
    # One partition: its output is one sorted stream, the same every run (with several, the
    # partitions came out in completion order); the default (200) costs seconds of set-up.
    unique = good.groupby(keys, num_partitions=1).map_groups(first_row, batch_format="pyarrow").materialize()
    return unique, unique.count()


def _first_error(checked, kind: str) -> str:
    """'<source>: <reason>' of the first row of `kind` the validation refused."""
    rows = checked.filter(lambda r: r["kind"] == kind and r["error"] != "").take(1)
    return f"{rows[0]['source']}: {rows[0]['error']}" if rows else ""


def _first_invalid(tokens, kind: str) -> str:
    """The reason the tokenizer gave for the first row of `kind` it could not render."""
    return tokens.filter(lambda r: r["kind"] == kind and r["split"].startswith("invalid:")).take(1)[0]["prompt"]


def _reasons(counts: dict[str, int]) -> str:
    """': 3 missing_field, 1 invalid_json' for a progress line (empty without invalid rows)."""
    return (": " + ", ".join(f"{n} {code}" for code, n in counts.items())) if counts else ""


def _write(tokens, kind: str, split: str, cfg: DataConfig, dest: Path, run_storage: RunStorage) -> tuple[int, int, int]:
    """Write one (kind, split) to Parquet; return (rows, tokens, unpaired preference rows) read back from the files."""
    import pyarrow.parquet as pq

    from ray.data.expressions import col

    part = tokens.filter(expr=(col("kind") == kind) & (col("split") == split))
    # Written in the seeded `order`, whatever order the blocks came back in: with preserve_order on,
    # a ShareGPT run still wrote its two tokenizer batches swapped now and then (fact 13).
    part = part.sort("order").select_columns([*COLUMNS[kind], "num_tokens"])
    if kind == "sft" and cfg.pack:
        part = part.map_batches(pack_batch, batch_format="pyarrow", batch_size=cfg.batch_size,
                                fn_kwargs={"max_len": cfg.max_len})
    dest.mkdir(parents=True, exist_ok=True)
    run_storage.write_parquet(part, dest)
    files = sorted(dest.glob("*.parquet"))
    if not files:
        return 0, 0, 0
    n_tokens = pq.ParquetDataset(files).read(columns=["num_tokens"]).column("num_tokens").to_pylist()
    unpaired = 0
    if kind == "preference":  # one side empty: a completion labelled desirable or undesirable
        sides = pq.ParquetDataset(files).read(columns=["chosen", "rejected"]).to_pydict()
        unpaired = sum(not c or not r for c, r in zip(sides["chosen"], sides["rejected"]))
    return len(n_tokens), sum(n_tokens), unpaired


def _check_not_empty(kind: str, m: dict[str, int], had_input: bool, first_reason=lambda kind: "") -> None:
    """A kind that had input must yield both splits: an empty split is not a usable artifact.
    `first_reason(kind)` gives why the first invalid row was refused, for the message."""
    if not had_input:
        return
    for split, fix in (("train", "check stages.data.on_bad_rows / stages.data.max_len, or the data itself"),
                       ("eval", "raise stages.data.eval_fraction or bring more rows")):
        if m[f"{kind}_{split}_rows"] == 0:
            why = first_reason(kind) if m[f"{kind}_rows_bad"] else ""
            raise DataError(
                f"no {kind} rows left in the {split} split ({m[f'{kind}_rows_bad']} invalid, "
                f"{m[f'{kind}_rows_duplicate']} duplicate, {m[f'{kind}_rows_too_long']} too long); {fix}"
                + (f". The first invalid row: {why}" if why else "")
            )


def _quiet_ray_data() -> None:
    """Our tokenize progress (rows, rate, ETA) replaces Ray Data's bars and per-execution log blocks,
    dozens per stage, which would only fill the stage's log file."""
    import logging

    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def run(cfg: DataConfig, ctx: StageContext) -> dict[str, Path]:
    """Build the three datasets; log row, token and dropped counts per kind."""
    clock = events.StartupClock()  # the stage's fixed cost: everything before the first row is tokenized
    ctx.ray()
    clock.mark("ray")
    _quiet_ray_data()
    # Blocks leave the groupby and the tokenizer pool in completion order unless told otherwise,
    # and the Parquet part files are numbered in that order: two runs wrote the same rows with
    # `part 0` and `part 1` swapped, so SFT saw another batch order and ended 5 points apart
    # (docs/architecture.md, fact 13).
    from ray.data import DataContext

    DataContext.get_current().execution_options.preserve_order = True
    ctx.progress("reading and validating sources")
    sources = _sources(cfg, ctx.pipeline)
    checked = _checked(sources, cfg, ctx.pipeline, ctx.progress)
    clock.mark("read")
    bad, valid = _counts(checked, cfg.on_bad_rows, sources)
    clock.mark("count")
    from ray.data.expressions import col

    good, n_good = _unique(checked.filter(expr=col("error") == ""), cfg.dedupe)  # counted for the progress total
    clock.mark("dedupe")
    clock.done()
    ctx.progress(clock.line("tokenizing"))
    ctx.progress(f"tokenizing {n_good} {'unique ' if cfg.dedupe else ''}valid rows ({sum(bad.values())} invalid) "
                 f"in {cfg.tokenizer_actors} process(es)")
    tokens = good.map_batches(
        tokenize_batch, batch_format="pyarrow", batch_size=cfg.batch_size, concurrency=cfg.tokenizer_actors,
        fn_kwargs={"tokenizer_path": str(ctx.inputs["base_model"]), "max_len": cfg.max_len,
                   "system_prompt": cfg.system_prompt, "total_rows": n_good},
    ).materialize()
    tokenized = clock.mark("tokenize")
    per_kind = count_by(tokens, ["kind", "split"])
    metrics: dict[str, int] = {}
    for kind in KINDS:
        unique = sum(n for (k, _), n in per_kind.items() if k == kind)
        late = {s.split(":", 1)[1]: n for (k, s), n in per_kind.items() if k == kind and s.startswith("invalid:")}
        if late and cfg.on_bad_rows == "fail":
            raise DataError(f"{sum(late.values())} {kind} row(s) the chat template cannot render: "
                            f"{_first_invalid(tokens, kind)} (or set stages.data.on_bad_rows=drop to skip and count "
                            f"them)")
        reasons = {code: bad.get((kind, code), 0) + late.get(code, 0)
                   for code in sorted({c for k, c in bad if k == kind} | set(late))}
        metrics |= {f"{kind}_rows_bad": sum(reasons.values()),
                    **{f"{kind}_rows_bad_{c}": n for c, n in reasons.items()},
                    f"{kind}_rows_duplicate": valid.get((kind,), 0)
                    + (valid.get(("eval",), 0) if kind == "prompts" else 0)
                    - unique,
                    f"{kind}_rows_too_long": sum(n for (k, s), n in per_kind.items()
                                                 if k == kind and s.startswith("dropped"))}
        for split in ("train", "eval"):
            rows, n_tokens, unpaired = _write(tokens, kind, split, cfg, ctx.out_dir / kind / split, ctx.storage)
            metrics |= {f"{kind}_{split}_rows": rows, f"{kind}_{split}_tokens": n_tokens}
            if kind == "preference":
                metrics[f"preference_{split}_unpaired"] = unpaired
        if kind == "prompts" and cfg.sources.eval:  # the user's eval set: its own counts
            metrics |= {"eval_rows_bad": sum(n for (k, _), n in bad.items() if k == "eval"),
                        "prompts_rows_in_eval_set": per_kind.get(("prompts", "in_eval_set"), 0)}
            if not metrics["prompts_eval_rows"]:
                raise DataError(f"stages.data.sources.eval: no eval rows left ({metrics['eval_rows_bad']} invalid); "
                                f"the first invalid row: {_first_error(checked, 'eval')}")
        _check_not_empty(kind, metrics, had_input=any(k == kind for k, _ in sources),
                         first_reason=lambda k: _first_error(checked, k))
        (ctx.out_dir / kind / "meta.json").write_text(json.dumps({
            "kind": kind, "tokenizer": str(ctx.inputs["base_model"]), "max_len": cfg.max_len,
            "packed": cfg.pack and kind == "sft", "columns": [*COLUMNS[kind], "num_tokens"],
            "rows": {s: metrics[f"{kind}_{s}_rows"] for s in ("train", "eval")},
            **({"unpaired": {s: metrics[f"preference_{s}_unpaired"] for s in ("train", "eval")}}
               if kind == "preference" else {}),
        }, indent=2))
        ctx.progress(f"{kind}: {metrics[f'{kind}_train_rows']} train / {metrics[f'{kind}_eval_rows']} eval rows "
                     f"({metrics[f'{kind}_rows_bad']} invalid{_reasons(reasons)}, {metrics[f'{kind}_rows_duplicate']} "
                     f"duplicate, "
                     f"{metrics[f'{kind}_rows_too_long']} too long dropped)")
    written = clock.mark("write")
    ctx.progress(f"tokenized in {tokenized:.1f}s (each process's tokenizer load included), written in {written:.1f}s")
    ctx.log_metrics(metrics | clock.metrics() | {"tokenize_s": tokenized, "write_s": written})
    return {"sft_data": ctx.out_dir / "sft", "preference_data": ctx.out_dir / "preference",
            "prompt_data": ctx.out_dir / "prompts"}
