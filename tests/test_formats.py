"""Raw row validation and locating the first bad row of a file."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from stages.data.formats import check_row, locate_problem


def test_sft_formats():
    good, err = check_row("sft", {"prompt": "hi", "response": "hello"})
    assert err == "" and good["messages"][1] == {"role": "assistant", "content": "hello"}
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert check_row("sft", {"messages": json.dumps(msgs)})[0]["messages"] == msgs  # CSV carries JSON text
    assert "no non-empty assistant" in check_row("sft", {"messages": [{"role": "user", "content": "q"}]})[1]
    assert "role must be one of" in check_row("sft", {"messages": [{"role": "bot", "content": "q"}]})[1]
    assert "needs 'messages'" in check_row("sft", {"text": "x"})[1]


def test_preference_and_prompt_formats():
    assert check_row("preference", {"prompt": "p", "chosen": "a", "rejected": "b"})[1] == ""
    assert "identical" in check_row("preference", {"prompt": "p", "chosen": "a", "rejected": "a"})[1]
    assert "missing field 'rejected'" in check_row("preference", {"prompt": "p", "chosen": "a"})[1]
    good, err = check_row("prompts", {"prompt": "p", "answer": 42})
    assert err == "" and good["answer"] == "42"
    assert "field 'prompt' is empty" in check_row("prompts", {"prompt": "  "})[1]


def test_locate_problem_jsonl_line(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n{"prompt": "e", "resp\n')
    assert locate_problem(f, "sft").startswith(f"{f}: line 3: invalid JSON")


def test_locate_problem_csv_and_parquet(tmp_path):
    c = tmp_path / "rows.csv"
    c.write_text("prompt,chosen,rejected\np,a,b\nq,a,a\n")
    assert locate_problem(c, "preference") == f"{c}: line 3: 'chosen' and 'rejected' are identical"
    p = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["x", ""], "answer": ["1", "2"]}), p)
    assert locate_problem(p, "prompts") == f"{p}: row 2: field 'prompt' is empty"
    assert locate_problem(c, "sft") is not None  # wrong kind: no 'messages'/'response'


def test_absent_cells_of_mixed_schema_files_count_as_missing():
    # Ray's JSON reader fills a row's absent `messages` with NaN when the column falls back to objects.
    good, err = check_row("sft", {"messages": float("nan"), "prompt": "q", "response": "a"})
    assert err == "" and good["messages"][0]["content"] == "q"
    assert "needs 'messages'" in check_row("sft", {"messages": float("nan"), "prompt": None})[1]


def test_type_changes_between_lines_are_located_for_read_errors(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "a", "answer": 8}\n{"prompt": "b", "answer": 9}\n{"prompt": "c", "answer": "10"}\n')
    assert locate_problem(f, "prompts", parse_only=True) == (
        f"{f}: line 3: 'answer' is text here but number on line 1; use one type per column")
    assert locate_problem(f, "prompts") is None  # every row is valid on its own


def test_conversations_must_start_with_the_user():
    msgs = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    assert "must start with a user message" in check_row("sft", {"messages": msgs})[1]


def test_group_decides_the_split_key():
    assert check_row("prompts", {"prompt": "What is 2 + 3?", "group": "2 + 3"})[0]["group"] == "2 + 3"
    assert check_row("sft", {"prompt": "hi", "response": "hello"})[0]["group"] == "hi"  # default: the prompt
    assert check_row("preference", {"prompt": "p", "chosen": "a", "rejected": "b", "group": 7})[0]["group"] == "7"
