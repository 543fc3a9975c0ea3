"""The readers of a user's files on files made to break them (issue 48, item 7; issue 59, items 4 and 9): every
bad row is counted or the error names the file (and line, or column), never a traceback, never code run, never
the driver's memory exhausted; and a refused file gets one message whichever kind of source it enters as (sft,
preference, prompts, eval, batch inference's prompts). Then what else a run reads of another's making: a Parquet
directory read whole (`read_rows`), a distillation teacher's checkpoint.

Unit-level: the readers the stage runs on the driver, and the batch function Ray runs on the rows; Ray's own
read calls are replaced by ones that fail the test, so a refused file is refused before Ray would read it."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.data.steps import _raw_rows, _validate_batch
from stages.data import files, safe_read
from stages.data.files import iter_rows, locate_problem
from stages.data.formats import classify_row
from stages.data.sources import SourceConfig, json_array_records, read_source, records


@pytest.fixture
def no_ray_reads(monkeypatch):
    """Ray Data's readers, replaced: a test that reaches one has let a refused file through."""
    import ray.data

    def refuse(*args, **kwargs):
        raise AssertionError(f"Ray was asked to read {args[0] if args else kwargs}")

    for name in ("read_text", "read_parquet", "read_csv", "read_json", "from_items", "from_arrow"):
        monkeypatch.setattr(ray.data, name, refuse)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(3)]


# --------------------------------------------------------------------------- a pickled Parquet column


class _Marker:
    """Unpickling this writes the marker file: proof that a reader ran the file's code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _pickled_parquet(path: Path, marker: Path) -> Path:
    """A Parquet file whose 'answer' column is Ray's pickled-object type, each value writing `marker` when read."""
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectType

    kind = ArrowPythonObjectType()
    payload = pa.array([pickle.dumps(_Marker(marker))], kind.storage_type)
    pq.write_table(pa.table({"prompt": ["q"], "answer": pa.ExtensionArray.from_storage(kind, payload)}), path)
    return path


def _other_extension_parquet(path: Path) -> Path:
    """A Parquet file with a list column of an extension type no library here registers."""

    class Other(pa.ExtensionType):
        def __init__(self):
            super().__init__(pa.binary(), "someone.elses.type")

        def __arrow_ext_serialize__(self):
            return b""

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type, serialized):
            return cls()

    other = Other()
    pa.register_extension_type(other)
    try:
        column = pa.ExtensionArray.from_storage(other, pa.array([b"x"], pa.binary()))
        pq.write_table(pa.table({"prompt": ["q"], "meta": pa.ListArray.from_arrays([0, 1], column)}), path)
    finally:
        pa.unregister_extension_type("someone.elses.type")
    return path


def test_a_parquet_column_of_pickled_objects_is_refused_unread(tmp_path, no_ray_reads):
    marker = tmp_path / "ran"
    evil = _pickled_parquet(tmp_path / "evil.parquet", marker)

    problem = locate_problem(evil, "prompts", parse_only=True)  # what the stage runs when Ray's read fails
    assert problem.startswith(f"{evil}: column 'answer' is of the extension type 'ray.data.arrow_pickled_object'")
    assert "refused unread" in problem
    with pytest.raises(safe_read.Refused, match=rf"{evil}: column 'answer' .*arrow_pickled_object"):
        list(records(SourceConfig(path=str(evil))))  # the driver's read of a user's eval set
    with pytest.raises(ValueError, match=rf"{evil}: column 'answer' .*arrow_pickled_object"):
        read_source(SourceConfig(path=str(evil)))
    assert not marker.exists()


def test_an_unregistered_extension_type_is_refused_too(tmp_path):
    f = _other_extension_parquet(tmp_path / "other.parquet")
    assert locate_problem(f, "prompts").startswith(f"{f}: column 'meta' is of the extension type 'someone.elses.type'")


# --------------------------------------------------------------------------- deep nesting


def test_a_record_nested_past_the_cap_refuses_its_file(tmp_path):
    deep = '{"prompt": "q", "response": ' + "[" * 100_000 + "]" * 100_000 + "}"  # past what the parser can
    f = tmp_path / "deep.jsonl"
    f.write_text(json.dumps(GOOD[0]) + "\n" + deep + "\n" + json.dumps(GOOD[1]) + "\n")
    rows = list(iter_rows(f))
    assert [n for n, _ in rows] == [1, 2, 3] and isinstance(rows[1][1], safe_read.Refusal)
    assert locate_problem(f, "sft", parse_only=True) == f"{f}: line 2: {safe_read.too_deep()}"
    assert files.refusal(f) == f"{f}: line 2: a record nested more than 100 levels deep (the cap on one JSON " \
                               "record); flatten it or leave it out"
    # the cap is ours, not the parser's (which stops near 1,000 levels, fewer in a deeper stack)
    for depth, refused in ((101, True), (100, False)):
        record = '{"prompt": "q", "response": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
        assert isinstance(safe_read.parse_record(record), safe_read.Refusal) is refused, depth
        assert (safe_read.record_refusal(record) is not None) is refused, depth  # the check before Ray reads
    # what Ray runs on each batch, should a file change after its check: a bad row, never a traceback
    batch = pa.table({"text": [json.dumps(GOOD[0]), deep]})
    assert isinstance(_raw_rows(batch, True)[1], str)
    out = _validate_batch(batch, "sft", str(f), "auto", {}, True, 0, 0.1).to_pydict()
    assert out["code"] == ["", "invalid_json"]
    # a value nested deep enough to parse but not to re-encode (an `extra` column of a Parquet or a CSV row)
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    assert classify_row("prompts", {"prompt": "q", "tree": nested})[1] == "too_deep"


def test_a_deeply_nested_json_array_item_names_the_file_and_row(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text("[" + json.dumps(GOOD[0]) + ", " + "[" * 100_000 + "]" * 100_000 + "]")
    rows = list(iter_rows(f))
    assert rows[0] == (1, {**GOOD[0]}) and rows[1][0] == 2 and "nested more than 100 levels" in rows[1][1]
    with pytest.raises(ValueError, match=rf"{f}: row 2: a record nested more than 100 levels deep"):
        json_array_records(f)
    assert files.refusal(f).startswith(f"{f}: row 2: a record nested more than 100 levels deep")


# --------------------------------------------------------------------------- gzip


def _gz(path: Path, text: str) -> Path:
    with gzip.open(path, "wt") as out:
        out.write(text)
    return path


def test_a_truncated_or_non_gzip_file_names_the_file_and_the_fix(tmp_path, no_ray_reads):
    whole = _gz(tmp_path / "whole.jsonl.gz", "".join(json.dumps(r) + "\n" for r in GOOD * 2000))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_text(json.dumps(GOOD[0]) + "\n")
    for f, says in ((cut, "the gzip data ends early"), (plain, "not gzip data, though its name ends in .gz")):
        assert says in locate_problem(f, "sft", parse_only=True)
        with pytest.raises(safe_read.Refused, match=rf"{f}: {says}"):  # not the good lines alone: the file is refused
            list(records(SourceConfig(path=str(f))))
        with pytest.raises(ValueError, match=rf"{f}: {says}"):
            read_source(SourceConfig(path=str(f)))
    array = tmp_path / "cut.json.gz"  # a JSON array cut short: the same
    array.write_bytes(_gz(tmp_path / "a.json.gz", json.dumps(GOOD * 2000)).read_bytes()[:200])
    assert "the gzip data ends early" in locate_problem(array, "sft")


def test_a_gzip_bomb_is_refused_at_the_cap(tmp_path, monkeypatch, no_ray_reads):
    monkeypatch.setattr(safe_read, "MAX_GZIP_BYTES", 1 << 20)
    bomb = _gz(tmp_path / "bomb.jsonl.gz", json.dumps(GOOD[0]) + "\n" + " " * (3 << 20) + "\n")
    assert bomb.stat().st_size < 20_000
    with pytest.raises(ValueError, match=rf"{bomb}: unpacks to more than 1 MiB \(the cap on one gzip file"):
        read_source(SourceConfig(path=str(bomb)))
    assert locate_problem(bomb, "sft").startswith(f"{bomb}: unpacks to more than 1 MiB")


# --------------------------------------------------------------------------- CSV


def test_a_csv_field_over_128_kib_is_read_and_one_over_the_cap_is_named(tmp_path, monkeypatch):
    f = tmp_path / "long.csv"
    long = "x" * (200 << 10)
    f.write_text(f"prompt,response\nq,{long}\nq2,a2\n")
    assert [row["response"] for _, row in iter_rows(f)] == [long, "a2"]
    monkeypatch.setattr(safe_read, "MAX_RECORD_BYTES", 64 << 10)
    assert locate_problem(f, "sft", parse_only=True) == f"{f}: line 2: {safe_read.record_too_large()}"
    assert "64 KiB" in safe_read.record_too_large()


def test_ray_reads_csv_rows_up_to_the_record_cap(tmp_path, monkeypatch):
    import ray.data

    seen = {}
    monkeypatch.setattr(ray.data, "read_csv", lambda paths, **kw: seen.update(kw) or "dataset")
    f = tmp_path / "rows.csv"
    f.write_text("prompt,response\nq,a\n")
    assert read_source(SourceConfig(path=str(f))) == [("dataset", False)]
    assert seen["read_options"].block_size == safe_read.MAX_RECORD_BYTES


# --------------------------------------------------------------------------- links


def test_links_are_followed_once_and_a_loop_ends(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    _jsonl(d / "a.jsonl", GOOD)
    _jsonl(d / "sub" / "b.jsonl", GOOD)
    os.symlink(".", d / "loop")  # a loop: glob's ** went round it 40 times
    os.symlink("sub", d / "again")  # a directory reached twice
    os.symlink("a.jsonl", d / "alias.jsonl")  # a file reached twice
    real = {str(d / "a.jsonl"), str(d / "sub" / "b.jsonl")}
    for path in (f"{d}/**/*.jsonl", str(d)):
        found = SourceConfig(path=path).files()
        assert sorted(os.path.realpath(p) for p in found) == sorted(real), path
    assert [p.name for p in SourceConfig(path=f"{d}/*.jsonl").files()] == ["a.jsonl"]


# --------------------------------------------------------------------------- JSON arrays


def test_a_json_array_is_parsed_item_by_item_and_capped(tmp_path, monkeypatch):
    broken = tmp_path / "broken.json"
    broken.write_text("[\n" + json.dumps(GOOD[0]) + ",\n" + json.dumps(GOOD[1]) + ",\n{\"prompt\": oops}\n]")
    rows = list(iter_rows(broken))  # the items before the break are rows; the break names its line
    assert rows[:2] == [(1, GOOD[0]), (2, GOOD[1])] and rows[2][1].startswith("line 4: invalid JSON")
    with pytest.raises(ValueError, match=rf"{broken}: line 4: invalid JSON"):
        json_array_records(broken)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps([*GOOD, 7]))
    assert [json.loads(r["text"]) for r in json_array_records(ok)] == [*GOOD, 7]
    assert list(iter_rows(ok))[-1] == (4, "a record must be one JSON object")
    monkeypatch.setattr(safe_read, "MAX_JSON_ARRAY_BYTES", 64 << 10)
    big = tmp_path / "big.json"
    big.write_text(json.dumps(GOOD * 2000))
    with pytest.raises(ValueError, match=rf"{big}: a JSON array over 64 KiB \(the cap.*convert it to JSON Lines"):
        json_array_records(big)
    assert locate_problem(big, "sft").startswith(f"{big}: a JSON array over 64 KiB")


# --------------------------------------------------------------------------- one refusal per cause, every kind


def _truncated_gzip(path: Path) -> Path:
    whole = _gz(path.with_name("whole.jsonl.gz"), "".join(json.dumps(r) + "\n" for r in GOOD * 2000))
    path.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return path


def _deep_jsonl(path: Path) -> Path:
    path.write_text(json.dumps(GOOD[0]) + "\n" + '{"prompt": "q", "response": ' + "[" * 5000 + "]" * 5000 + "}\n")
    return path


def _long_csv_field(path: Path) -> Path:  # over the cap the test sets: 64 KiB
    path.write_text("prompt,response,chosen,rejected\nq," + "x" * (100 << 10) + ",a,b\n")
    return path


_EXTENSION_FIX = "write the column as text, numbers or lists (JSON text for structured values), or drop it"
CAUSES = {  # cause: (the file, what the message says after the file's name, the fix it ends with)
    "pickled column": (lambda d: _pickled_parquet(d / "pickled.parquet", d / "ran"),
                       "column 'answer' is of the extension type 'ray.data.arrow_pickled_object'", _EXTENSION_FIX),
    "unknown extension type": (lambda d: _other_extension_parquet(d / "other.parquet"),
                               "column 'meta' is of the extension type 'someone.elses.type'", _EXTENSION_FIX),
    "truncated gzip": (lambda d: _truncated_gzip(d / "cut.jsonl.gz"), "the gzip data ends early after line ",
                       "(the file is truncated); copy or compress it again, whole"),
    "over-deep JSON": (lambda d: _deep_jsonl(d / "deep.jsonl"), "line 2: a record nested more than 100 levels deep",
                       "(the cap on one JSON record); flatten it or leave it out"),
    "over-long field": (lambda d: _long_csv_field(d / "long.csv"), "line 2: a record over 64 KiB",
                        "(the cap on one JSON line or CSV row); split it or leave it out"),
}


def _read_as(kind: str, f: Path, good: Path) -> str:
    """What reading `f` as a source of `kind` says: the data stage's read of its sources (before Ray reads a
    file), or batch inference's read of its prompts; '' when nothing refused it."""
    from pipeline.errors import UserError
    from stages.batch_infer import BatchInferConfig, read_prompts
    from stages.data import DataConfig, _checked, _sources

    try:
        if kind == "batch-infer":
            cfg = BatchInferConfig(prompts=f)
            read_prompts(cfg.prompts, cfg.prompt_field)
        else:  # an eval set beside prompts of its own: the data stage needs rows to train on
            cfg = DataConfig(sources={kind: [str(f)], **({"prompts": [str(good)]} if kind == "eval" else {})})
            pcfg = types.SimpleNamespace(seed=0)
            _checked(_sources(cfg, pcfg), cfg, pcfg, lambda line: None)
    except (UserError, ValueError) as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("cause", CAUSES)
@pytest.mark.parametrize("kind", ["sft", "preference", "prompts", "eval", "batch-infer"])
def test_each_source_kind_refuses_each_cause_with_one_message(tmp_path, monkeypatch, no_ray_reads, kind, cause):
    monkeypatch.setattr(safe_read, "MAX_RECORD_BYTES", 64 << 10)
    make, says, fix = CAUSES[cause]
    f = make(tmp_path)
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": "q", "answer": "1"}])
    message = _read_as(kind, f, good)
    prefix = "" if kind == "batch-infer" else f"stages.data.sources.{kind}[0]: "  # where the file was named
    assert message.startswith(f"{prefix}{f}: {says}"), message
    assert message.endswith(fix), message
    assert message == prefix + files.refusal(f)  # the one check every kind runs, word for word
    assert not (tmp_path / "ran").exists()


# --------------------------------------------------------------------------- links out of the folder


def test_a_link_out_of_the_source_folder_is_refused_naming_the_link_and_its_target(tmp_path, no_ray_reads):
    from pipeline.errors import UserError
    from stages.batch_infer import read_prompts

    d = tmp_path / "data"
    d.mkdir()
    _jsonl(d / "a.jsonl", GOOD)
    os.symlink("/proc/self/environ", d / "env.jsonl")  # was listed, and read, as a data file
    says = (rf"{re.escape(str(d / 'env.jsonl'))}: a link to /proc/self/environ \(/proc/\d+/environ\), outside "
            rf"{re.escape(str(d))} \(the source's folder\).*copy what it names into the folder, or give that path "
            "as a source of its own")
    for path in (str(d), f"{d}/*.jsonl", f"{d}/**/*.jsonl"):
        with pytest.raises(ValueError, match=says):
            SourceConfig(path=path)
    with pytest.raises(UserError, match=says):  # batch inference's prompts: the same
        read_prompts(d, "prompt")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    _jsonl(outside / "b.jsonl", GOOD)
    os.unlink(d / "env.jsonl")
    os.symlink(outside, d / "more")  # a directory out: refused before anything in it is listed
    with pytest.raises(ValueError,
                       match=rf"{re.escape(str(d / 'more'))}: a link to {re.escape(str(outside))}, outside"):
        SourceConfig(path=str(d))
    assert SourceConfig(path=str(d / "more" / "b.jsonl")).files() == [d / "more" / "b.jsonl"]  # named: read


# --------------------------------------------------------------------------- what else a run reads


def test_read_rows_refuses_a_pickled_column_with_ray_data_imported(tmp_path):
    import numpy as np
    import ray.data  # noqa: F401 - registers Ray's pickled-object type: reading its values unpickles them
    from ray.data._internal.tensor_extensions.arrow import ArrowTensorArray

    from pipeline.errors import UserError
    from stages.common.parquet import read_rows

    marker = tmp_path / "ran"
    (tmp_path / "eval").mkdir()
    _pickled_parquet(tmp_path / "eval" / "part-0.parquet", marker)  # another run's held-out prompts (`compare`)
    with pytest.raises(UserError, match=r"part-0.parquet: column 'answer' is of the extension type "
                                        r"'ray.data.arrow_pickled_object'.*refused unread"):
        read_rows(tmp_path / "eval")
    assert not marker.exists()
    (tmp_path / "ok").mkdir()  # Ray's tensor type (what Ray Data writes of an ndarray column) is read
    pq.write_table(pa.table({"prompt": ["q", "r"], "v": ArrowTensorArray.from_numpy(np.zeros((2, 3)))}),
                   tmp_path / "ok" / "part-0.parquet")
    assert [r["prompt"] for r in read_rows(tmp_path / "ok")] == ["q", "r"]


def test_a_distillation_teacher_gets_the_checkpoint_check_model_source_gets(tmp_path):
    from stages.common.models import checkpoint_safety_problem
    from stages.ppo.config import DistillConfig

    run = tmp_path / "run"  # another run's directory: its newest policy is the teacher
    art = run / "artifacts" / "sft" / "k1"
    teacher = art / "model"
    teacher.mkdir(parents=True)
    (art / "manifest.json").write_text(json.dumps({"stage": "sft", "key": "k1", "outputs": {"sft_model": "model"},
                                                   "finished": "2026-12-01"}))
    (teacher / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (teacher / "pytorch_model.bin").write_bytes(b"a pickle, never loaded")
    problem = checkpoint_safety_problem(teacher)  # what model.source says of the same directory
    assert "only pickle weights (pytorch_model.bin)" in problem
    for given in (teacher, run):
        with pytest.raises(ValueError, match=re.escape(problem)):
            DistillConfig(teacher=str(given))
    (teacher / "model.safetensors").write_bytes(b"")
    (teacher / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoModel": "m.M"}}))
    with pytest.raises(ValueError, match="needs its own model code"):
        DistillConfig(teacher=str(teacher))
    (teacher / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert DistillConfig(teacher=str(run)).teacher == teacher
