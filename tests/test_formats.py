"""Raw row formats (recognised by their columns), their validation, sources and locating a bad row."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from stages.data.files import locate_problem
from stages.data.formats import check_row, classify_row, detect_format
from stages.data.sources import SourceConfig, SourcesConfig, json_array_records, resolve_format

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"}]


def test_the_same_conversation_in_every_sft_format_is_the_same_row():
    as_messages = {"messages": CHAT}
    as_sharegpt = {"conversations": [{"from": "system", "value": "Be brief."},
                                     {"from": "human", "value": "What is 2 + 2?"},
                                     {"from": "gpt", "value": "4"}]}
    as_alpaca = {"system": "Be brief.", "instruction": "What is 2 + 2?", "input": "", "output": "4"}
    as_completion = {"prompt": CHAT[:2], "completion": [CHAT[2]]}
    rows = [check_row("sft", r) for r in (as_messages, as_sharegpt, as_alpaca, as_completion)]
    assert all(err == "" for _, err in rows), rows
    assert all(good == rows[0][0] for good, _ in rows) and rows[0][0]["messages"] == CHAT
    assert [detect_format("sft", r) for r in (as_messages, as_sharegpt, as_alpaca, as_completion)] == [
        "messages", "sharegpt", "alpaca", "prompt_completion"]


def test_alpaca_input_follows_the_instruction_and_prompt_response_still_works():
    good, _ = check_row("sft", {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"})
    assert good["messages"] == [{"role": "user", "content": "Add the numbers.\n\n2 and 3"},
                                {"role": "assistant", "content": "5"}]
    good, err = check_row("sft", {"prompt": "hi", "response": "hello"})
    assert err == "" and good["messages"][1] == {"role": "assistant", "content": "hello"}
    assert check_row("sft", {"messages": json.dumps(CHAT)})[0]["messages"] == CHAT  # CSV carries JSON text


def test_tool_calls_tool_turns_and_text_parts():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
            {"role": "assistant", "content": "It is -3 C."}]
    good, err = check_row("sft", {"messages": msgs})
    assert err == ""
    assert good["messages"][0] == {"role": "user", "content": "Weather in Oslo?"}
    assert good["messages"][1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert good["messages"][2] == {"role": "tool", "content": "-3 C", "tool_call_id": "c1"}
    # Parquet fills absent struct fields with None: they are absent, not values
    parquet_like = [{"role": "user", "content": "q", "tool_calls": None, "name": None},
                    {"role": "assistant", "content": "a"}]
    assert check_row("sft", {"messages": parquet_like})[0]["messages"][0] == {"role": "user", "content": "q"}


def test_images_and_unknown_roles_are_refused_with_their_reason():
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}, CHAT[2]]
    assert classify_row("sft", {"messages": image})[1:] == (
        "non_text_content", "messages[0].content[0] is a part of type 'image_url': only text parts are supported "
        "(this pipeline trains text models); drop the part or the row")
    assert "role must be one of" in check_row("sft", {"messages": [{"role": "bot", "content": "q"}]})[1]
    assert "from must be one of" in check_row("sft", {"conversations": [{"from": "robot", "value": "q"}]})[1]
    assert classify_row("sft", {"messages": [{"role": "user", "content": "q"}]})[1] == "no_assistant"
    assert classify_row("sft", {"text": "x"})[1] == "unknown_format"
    assert "must start with a user message" in check_row("sft", {"messages": [CHAT[2], CHAT[1]]})[1]


def test_preference_strings_and_trl_conversational_shapes():
    assert check_row("preference", {"prompt": "p", "chosen": "a", "rejected": "b"}) == (
        {"key": "p", "prompt": "p", "chosen": "a", "rejected": "b", "group": "p"}, "")
    explicit = {"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}]}
    implicit = {"chosen": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "b"}]}
    assert check_row("preference", explicit)[0] == check_row("preference", implicit)[0] == check_row(
        "preference", {"prompt": "p", "chosen": "a", "rejected": "b"})[0]
    system = {**implicit, "chosen": [CHAT[0], *implicit["chosen"]], "rejected": [CHAT[0], *implicit["rejected"]]}
    assert check_row("preference", system)[0]["messages"] == [CHAT[0], {"role": "user", "content": "p"}]
    assert classify_row("preference", {"prompt": "p", "chosen": "a", "rejected": "a"})[1] == "identical_pair"
    assert classify_row("preference", {"prompt": "p", "chosen": "a"})[1] == "unknown_format"


def test_unpaired_rows_labelled_desirable_or_undesirable_fill_one_side():
    """TRL's unpaired preference shape (KTO's data): the completion is the chosen side when desirable, the
    rejected side when not, the other side empty; labels as people write them (CSV cells are strings)."""
    for label in (True, 1, "true", "desirable", "1", 1.0):
        good, err = check_row("preference", {"prompt": "p", "completion": "a", "label": label})
        assert err == "" and (good["chosen"], good["rejected"], good["label"]) == ("a", "", True), label
    for label in (False, 0, "False", "undesirable", "0"):
        good, err = check_row("preference", {"prompt": "p", "completion": "a", "label": label})
        assert err == "" and (good["chosen"], good["rejected"], good["label"]) == ("", "a", False), label
    conversational = {"prompt": [{"role": "user", "content": "p"}],
                      "completion": [{"role": "assistant", "content": "a"}], "label": True}
    assert check_row("preference", conversational)[0] == check_row(
        "preference", {"prompt": "p", "completion": "a", "label": True})[0]
    assert classify_row("preference", {"prompt": "p", "completion": "a", "label": "maybe"})[1] == "bad_label"
    assert classify_row("preference", {"prompt": "p", "completion": " ", "label": 1})[1] == "empty_field"


def test_prompt_rows_keep_extra_columns_and_map_theirs():
    good, err = check_row("prompts", {"prompt": "p", "answer": 42, "tests": ["assert f(1) == 2"], "level": 3})
    assert err == "" and good["answer"] == "42" and good["extra"] == {"tests": ["assert f(1) == 2"], "level": 3}
    good, _ = check_row("prompts", {"question": "Capital of France?", "final": "Paris"},
                        columns={"prompt": "question", "answer": "final"})
    assert (good["prompt"], good["answer"]) == ("Capital of France?", "Paris")
    assert good["extra"] == {"question": "Capital of France?", "final": "Paris"}  # and under the user's own names
    assert classify_row("prompts", {"prompt": "  "})[1] == "empty_field"
    assert check_row("prompts", {"prompt": "What is 2 + 3?", "group": "2 + 3"})[0]["group"] == "2 + 3"


def test_absent_cells_of_mixed_schema_files_count_as_missing():
    good, err = check_row("sft", {"messages": float("nan"), "prompt": "q", "response": "a"})
    assert err == "" and good["messages"][0]["content"] == "q"
    assert classify_row("sft", {"messages": float("nan"), "prompt": None})[1] == "unknown_format"


def test_locate_problem_in_jsonl_gz_csv_parquet_and_json_arrays(tmp_path):
    f = tmp_path / "rows.jsonl.gz"
    with gzip.open(f, "wt") as out:
        out.write('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n{"prompt": "e", "resp\n')
    assert locate_problem(f, "sft").startswith(f"{f}: line 3: invalid JSON")
    c = tmp_path / "rows.csv"
    c.write_text("prompt,chosen,rejected\np,a,b\nq,a,a\n")
    assert locate_problem(c, "preference") == f"{c}: line 3: 'chosen' and 'rejected' are identical"
    p = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["x", ""], "answer": ["1", "2"]}), p)
    assert locate_problem(p, "prompts") == f"{p}: row 2: field 'prompt' is empty"
    a = tmp_path / "rows.json"
    a.write_text(json.dumps([{"instruction": "i", "output": "o"}, {"instruction": "i"}]))
    assert locate_problem(a, "sft", "alpaca") == f"{a}: row 2: missing field 'output'"
    assert [json.loads(r["text"]) for r in json_array_records(a)][0] == {"instruction": "i", "output": "o"}


def test_sources_resolve_globs_directories_and_report_the_format(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shards").mkdir()
    for i in range(3):
        pq.write_table(pa.table({"conversations": [[{"from": "human", "value": f"q{i}"},
                                                    {"from": "gpt", "value": "a"}]]}),
                       tmp_path / "shards" / f"part-{i}.parquet")
    (tmp_path / "shards" / "README.txt").write_text("not data")
    src = SourcesConfig(sft=["shards"]).sft[0]
    assert [p.name for p in src.files()] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert resolve_format("sft", src) == "sharegpt"
    assert len(SourceConfig(path="shards/*.parquet").files()) == 3
    with pytest.raises(ValidationError, match="not found: .*missing.jsonl"):
        SourcesConfig(sft=["missing.jsonl"])
    with pytest.raises(ValidationError, match="no files to read .found .txt"):
        SourcesConfig(sft=[{"path": "shards/*.txt"}])
    with pytest.raises(ValidationError, match=r"sources.prompts\[0\].format: 'alpaca' is not a prompts format"):
        SourcesConfig(prompts=[{"path": "shards", "format": "alpaca"}])
    with pytest.raises(ValidationError, match=r"columns: question not a prompts column.*e.g. \{prompt: question\}"):
        SourcesConfig(prompts=[{"path": "shards", "columns": {"question": "prompt"}}])
