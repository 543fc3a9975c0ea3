"""The data stage's readers on files made to break them (issue 48, item 7): every bad row is counted or the
error names the file (and line), never a traceback, never code run, never the driver's memory exhausted.

Unit-level: the readers the stage runs on the driver, and the batch function Ray runs on the rows; Ray's own
read calls are replaced by ones that fail the test, so a refused file is refused before Ray would read it."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.data.steps import _raw_rows, _validate_batch
from stages.data.files import iter_rows, locate_problem
from stages.data.formats import classify_row
from stages.data.sources import SourceConfig, json_array_records, read_source, records


@pytest.fixture
def no_ray_reads(monkeypatch):
    """Ray Data's readers, replaced: a test that reaches one has let a refused file through."""
    import ray.data

    def refuse(*args, **kwargs):
        raise AssertionError(f"Ray was asked to read {args[0] if args else kwargs}")

    for name in ("read_text", "read_parquet", "read_csv", "from_items", "from_arrow"):
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


def test_a_parquet_column_of_pickled_objects_is_refused_unread(tmp_path, no_ray_reads):
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectType

    marker = tmp_path / "ran"
    kind = ArrowPythonObjectType()
    payload = pa.array([pickle.dumps(_Marker(marker))], kind.storage_type)
    evil = tmp_path / "evil.parquet"
    pq.write_table(pa.table({"prompt": ["q"], "answer": pa.ExtensionArray.from_storage(kind, payload)}), evil)

    problem = locate_problem(evil, "prompts", parse_only=True)  # what the stage runs when Ray's read fails
    assert problem.startswith(f"{evil}: column 'answer' is of the extension type 'ray.data.arrow_pickled_object'")
    assert "refused unread" in problem
    assert list(records(SourceConfig(path=str(evil)))) == []  # the driver's read of a user's eval set
    with pytest.raises(ValueError, match=rf"{evil}: column 'answer' .*arrow_pickled_object"):
        read_source(SourceConfig(path=str(evil)))
    assert not marker.exists()


def test_an_unregistered_extension_type_is_refused_too(tmp_path):
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
        f = tmp_path / "other.parquet"
        pq.write_table(pa.table({"prompt": ["q"], "meta": pa.ListArray.from_arrays([0, 1], column)}), f)
    finally:
        pa.unregister_extension_type("someone.elses.type")
    assert locate_problem(f, "prompts").startswith(f"{f}: column 'meta' is of the extension type 'someone.elses.type'")


# --------------------------------------------------------------------------- deep nesting


def test_a_deeply_nested_json_record_is_a_counted_bad_row(tmp_path):
    deep = '{"prompt": "q", "response": ' + "[" * 100_000 + "]" * 100_000 + "}"
    f = tmp_path / "deep.jsonl"
    f.write_text(json.dumps(GOOD[0]) + "\n" + deep + "\n" + json.dumps(GOOD[1]) + "\n")
    rows = list(iter_rows(f))
    assert [n for n, _ in rows] == [1, 2, 3] and rows[1][1] == "invalid JSON (nested too deeply to parse)"
    assert locate_problem(f, "sft", parse_only=True) == f"{f}: line 2: invalid JSON (nested too deeply to parse)"
    # what Ray runs on each batch with on_bad_rows: drop: the row is counted, the others kept
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
    assert rows[0] == (1, {**GOOD[0]}) and rows[1][0] == 2 and "nested too deeply" in rows[1][1]
    with pytest.raises(ValueError, match=rf"{f}: row 2: invalid JSON \(nested too deeply"):
        json_array_records(f)


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
        assert all(isinstance(r, dict) for r in records(SourceConfig(path=str(f))))  # the good lines, no traceback
        with pytest.raises(ValueError, match=rf"{f}: {says}"):
            read_source(SourceConfig(path=str(f)))
    array = tmp_path / "cut.json.gz"  # a JSON array cut short: the same
    array.write_bytes(_gz(tmp_path / "a.json.gz", json.dumps(GOOD * 2000)).read_bytes()[:200])
    assert "the gzip data ends early" in locate_problem(array, "sft")


def test_a_gzip_bomb_is_refused_at_the_cap(tmp_path, monkeypatch, no_ray_reads):
    from stages.data import safe_read

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
    from stages.data import safe_read

    monkeypatch.setattr(safe_read, "MAX_RECORD_BYTES", 64 << 10)
    assert locate_problem(f, "sft", parse_only=True) == f"{f}: line 2: {safe_read.record_too_large()}"
    assert "64 KiB" in safe_read.record_too_large()


def test_ray_reads_csv_rows_up_to_the_record_cap(tmp_path, monkeypatch):
    import ray.data

    from stages.data import safe_read

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
    from stages.data import safe_read

    monkeypatch.setattr(safe_read, "MAX_JSON_ARRAY_BYTES", 64 << 10)
    big = tmp_path / "big.json"
    big.write_text(json.dumps(GOOD * 2000))
    with pytest.raises(ValueError, match=rf"{big}: a JSON array over 64 KiB \(the cap.*convert it to JSON Lines"):
        json_array_records(big)
    assert locate_problem(big, "sft").startswith(f"{big}: a JSON array over 64 KiB")
