"""The arithmetic task: determinism, correct answers, wrong rejected answers, the verifier."""

import pytest

from stages.common import tasks
from stages.common.tasks import TaskConfig, extract_answer, verify

CFG = TaskConfig(min_digits=1, max_digits=3, ops=["+", "-", "*"])


def _eval(expr: str) -> int:
    a, op, b = expr.split()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_generators_are_deterministic_under_the_seed():
    assert tasks.sft_rows(50, 3, CFG) == tasks.sft_rows(50, 3, CFG)
    assert tasks.sft_rows(50, 3, CFG) != tasks.sft_rows(50, 4, CFG)
    assert tasks.preference_rows(20, 1, CFG) == tasks.preference_rows(20, 1, CFG)


def test_sft_answers_are_correct():
    for row in tasks.sft_rows(300, 0, CFG):
        reply = row["messages"][1]["content"]
        expr, value = reply.split(" = ")
        assert _eval(expr) == int(value)


def test_preference_pairs_prefer_the_correct_answer():
    for row in tasks.preference_rows(300, 0, CFG):
        expr = row["chosen"].split(" = ")[0]
        truth = str(_eval(expr))
        assert verify(row["chosen"], truth)
        assert not verify(row["rejected"], truth)
        assert row["rejected"].split(" = ")[0] == expr  # same working, wrong result


def test_prompt_answers_match_the_question():
    for row in tasks.prompt_rows(200, 0, CFG):
        numbers = [int(t.strip("?.")) for t in row["prompt"].split() if t.strip("?.").isdigit()]
        op = next(t for t in row["prompt"].split() if t in "+-*")
        assert _eval(f"{numbers[0]} {op} {numbers[1]}") == int(row["answer"])


def test_digit_bounds_are_respected():
    cfg = TaskConfig(min_digits=3, max_digits=3, ops=["+"])
    for row in tasks.prompt_rows(100, 0, cfg):
        a, b = [int(t.strip("?.")) for t in row["prompt"].split() if t.strip("?.").isdigit()]
        assert 100 <= a <= 999 and 100 <= b <= 999


def test_verifier():
    assert extract_answer("12 + 30 = 42") == 42
    assert extract_answer("3 - 10 = -7") == -7
    assert extract_answer("no number") is None
    assert verify("so the answer is 1,024", "1024")
    assert not verify("12 + 30 = 43", "42")
    assert not verify("", "0")
    assert not verify("12", "twelve")  # a reference that is not a number matches nothing, without an error


@pytest.mark.parametrize("response, ok", [
    ("7 + 5 = 12.", True),
    ("The answer is 12", True),
    ("12 (7 more than 5)", True),  # the last integer was 5
    ("12.0", True),  # the last integer was 0
    ("12. To get this, I added 7 and 5 together.", True),  # an answer followed by an explanation
    ("To add 7 and 5, you simply add them together: 7 + 5 = 12. So 7 + 5 makes 12.", True),
    ("The sum of 7 and 5 is 12.", True),
    ("**Answer:** 12", True),
    ("To add 7 and 5, you simply add them together: 7 + 5 =", False),  # truncated before the answer
    ("To add 7 and 5, you", False),  # truncated before any number but the question's
    ("7 + 5 = 13. The answer is 13", False),
    ("12.5", False),
])
def test_the_verifier_reads_the_forms_chat_models_answer_in(response, ok):
    assert verify(response, "12") is ok, extract_answer(response)


def test_three_operands_show_each_step_and_prompts_are_distinct_problems():
    cfg = TaskConfig(min_digits=1, max_digits=1, ops=["+", "-"], operands=3)
    for row in tasks.sft_rows(200, 0, cfg):
        a, op1, b, op2, c = row["group"].split()
        first = int(a) + int(b) if op1 == "+" else int(a) - int(b)
        final = first + int(c) if op2 == "+" else first - int(c)
        assert row["messages"][1]["content"] == f"{first} {op2} {c} = {final}"  # e.g. 3 + 5 - 7 -> "8 - 7 = 1"
    rows = tasks.prompt_rows(5000, 0, cfg)
    assert len(rows) == len({r["group"] for r in rows}) == 4000  # 10 x 10 x 10 x 2 x 2 problems, each once
    pref = tasks.preference_rows(100, 0, cfg)
    assert all(r["chosen"].rsplit("=", 1)[0] == r["rejected"].rsplit("=", 1)[0] for r in pref)
