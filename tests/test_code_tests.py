"""The `code_tests` verdict (issue 67; docs/security.md): decided by a judge's run that runs nothing the response
chose. The attack corpus (tests/code_corpus.py) scores 0 attack by attack; honest answers score 1 and
honest wrong ones 0 on MBPP-style and HumanEval-style rows; rows that cannot be judged are the reward's error
naming the row. Then the parts, without a sandbox: the value codec and the strict comparison, the plan made from
the tests alone, the referee between the two runs. No Ray."""

from __future__ import annotations

import json

import pytest

import code_corpus as corpus
from stages.ppo.sandbox import SandboxLimits, code_tests, harness, programs, values, verdict
from stages.ppo.sandbox.relay import Concluded

LIMITS = SandboxLimits(cpu_s=2, wall_s=4, memory_mb=256, processes=8)


@pytest.fixture(autouse=True)
def _small_limits(monkeypatch):
    monkeypatch.setattr(harness, "LIMITS", LIMITS)


def score(response: str, row: dict) -> float:
    """As the rule reward scores a call: a ValueError (the row cannot be judged) is its error and scores 0."""
    try:
        return code_tests("", response, row)
    except ValueError:
        return 0.0


def row_of(tests) -> dict:
    return tests if isinstance(tests, dict) else {"tests": tests, "test_setup_code": "K = 2"}


# --------------------------------------------------------------------------- the corpus
@pytest.mark.parametrize("attack", list(corpus.ATTACKS))
def test_an_attack_scores_zero(attack):
    response, row = corpus.ATTACKS[attack]
    assert score(response, row) == 0.0


@pytest.mark.parametrize("tests, right, wrong", corpus.MBPP + corpus.HUMANEVAL,
                         ids=[f"mbpp{i}" for i in range(len(corpus.MBPP))] +
                             [f"humaneval{i}" for i in range(len(corpus.HUMANEVAL))])
def test_an_honest_answer_scores_one_and_a_wrong_one_zero(tests, right, wrong):
    row = row_of(tests)
    assert code_tests("", right, row) == 1.0
    assert code_tests("", wrong, row) == 0.0


def test_an_answers_own_output_and_fences_do_not_matter():
    tests, right, _ = corpus.MBPP[0]
    noisy = right + "\nprint('hello', end='')\nif __name__ == '__main__':\n    print(repr(1))\n"
    assert code_tests("", f"Here it is:\n```python\n{noisy}\n```\nDone.", row_of(tests)) == 1.0


@pytest.mark.parametrize("case", list(corpus.ERRORS))
def test_a_row_that_cannot_be_judged_is_an_error_naming_it(case):
    row, response, fragment = corpus.ERRORS[case]
    with pytest.raises(ValueError) as err:
        code_tests("", response, row)
    assert f"row {row['task_id']!r}" in str(err.value) and fragment in str(err.value), str(err.value)


def test_the_judge_runs_only_its_own_literals_as_code_whatever_the_alias():
    """eval of a literal of the test runs; eval reached through an alias, on a returned string, is refused at the
    call (the plan cannot see it); the standard library's own use of eval (namedtuple) is not the test's."""
    assert code_tests("", "def f(x):\n    return x * 2", {"test": "assert f(eval('1 + 1')) == 4"}) == 1.0
    with pytest.raises(ValueError, match="runs eval\\(\\) on a value that is not one of its own literals"):
        code_tests("", "def g():\n    return '2'", {"test": "e = eval\nassert e(g()) == 2", "task_id": 3})
    named = "from collections import namedtuple\nP = namedtuple('P', 'x y')\nassert f(P(1, 2).y) == 4"
    assert code_tests("", "def f(x):\n    return x * 2", {"test": named}) == 1.0


def test_the_response_runs_its_calls_in_the_tests_order_with_their_arguments():
    counter = "n = 0\ndef nxt(step=1):\n    global n\n    n += step\n    return n"
    tests = {"test": "assert nxt() == 1\nassert nxt(step=2) == 3\nvals = [nxt() for _ in range(2)]\n"
                     "assert vals == [4, 5]"}
    assert code_tests("", counter, tests) == 1.0
    with pytest.raises(ValueError, match="passes a function to the response's code"):
        code_tests("", "def apply(f):\n    return f(1)", {"test": "assert apply(lambda x: x + 1) == 2"})


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("a, b, same", [
    (3, 3.0, True), (True, 1, False), (1.0, True, False), ([1, 0], [True, False], False),
    ([{1}], [frozenset({1})], False), ({True: 1}, {1: True}, False), ({"a": (1, True)}, {"a": (1, 1)}, False),
    ({1: [2, {3}]}, {1: [2, {3}]}, True), ([1, 2], (1, 2), False), ("a", b"a", False), (None, None, True),
    (float("nan"), float("nan"), False), (__import__("collections").Counter("aab"), {"a": 2, "b": 1}, True),
    ({frozenset({True})}, {frozenset({1})}, False), (range(3), range(3), True), ([[1]], [[1.0]], True),
])
def test_equality_is_type_strict_all_the_way_down(a, b, same):
    assert values.equal(a, b) is same and values.equal(b, a) is same


def test_contains_and_nan_follow_the_same_rules():
    assert values.contains([1, 2], 1) and not values.contains([1, 2], True) and not values.contains({1}, True)
    assert values.contains({"a": 1}, "a") and values.contains("abc", "b") and not values.contains(range(3), True)
    assert values.has_nan([1.0, (2, float("nan"))]) and values.has_nan(complex(0, float("nan")))
    assert not values.has_nan([1.0, "nan"]) and values.has_nan({"k": float("nan")})


def test_values_round_trip_as_data_and_anything_else_is_refused():
    value = [2 ** 20000, -5, 1.5, float("inf"), 2j, "s", b"\x00b", (1,), {2}, frozenset({3}), {"k": None},
             range(1, 9, 2)]
    tagged = values.encode(value)
    assert values.decode(json.loads(json.dumps(tagged))) == value  # ints in hex: no 4,300-digit limit
    assert values.decode(values.canonical(tagged)) == value
    assert list(values.decode(values.encode(iter([1, 2])))) == [1, 2]
    with pytest.raises(TypeError):
        values.encode(type("E", (int,), {})(3))  # a subclass of int is not an int
    for bad in (["object", "x"], ["int", "12"], ["int", "0x1_0"], ["handle", 0, "f"], ["ref", 0, []], ["set"], "x",
                ["list", [["float", "1" * 50]]], ["dict", [[["int", "0x1"]]]]):
        with pytest.raises(ValueError):
            values.canonical(bad)
    assert values.canonical(["handle", 3, "Stack" * 40], values.HANDLE_TAGS) == ["handle", 3, ("Stack" * 40)[:80]]
    with pytest.raises(ValueError):
        values.canonical(["ref", 1, ["__class__; x"]], values.REF_TAGS)


# --------------------------------------------------------------------------- the plan, from the tests alone
def test_whose_names_are_decided_from_the_tests_alone():
    tests = ["import json", "def helper(x):\n    return sorted(x)",
             "assert helper(f(K)) == [1]\nassert math.isclose(g(), 0.5)\nfor i in range(2):\n    assert h(i) >= 0",
             "assert json.loads(to_json([1])) == [1]"]
    plan = verdict.plan("K = 2", tests, {})
    assert plan.names == ["f", "g", "h", "to_json"]  # not helper (the test's), K (setup), json (imported), sorted
    assert plan.modules == ["math"]  # used only as math.attr and never bound: the judge imports it
    assert "__judge_assert__" in plan.source and "__judge_cmp__('==', helper(f(K)), [1])" in plan.source
    assert "__judge_chain__" in verdict.plan("", ["assert 0 < f() < 3"], {}).source


def test_a_humaneval_check_is_called_with_its_entry_point_once():
    check = "def check(candidate):\n    assert candidate(1) == 2\n"
    assert verdict.plan("", [check], {"entry_point": "f"}).source.endswith("check(f)")
    assert verdict.plan("", [check + "check(f)\n"], {"entry_point": "f"}).source.count("check(f)") == 1
    with pytest.raises(ValueError, match="entry_point must be a function's name"):
        verdict.plan("", [check], {"entry_point": "f(); import os"})


def test_the_responses_run_never_holds_a_test_or_an_expected_value():
    row = {"test_list": ["assert add(2, 3) == 987654321", "assert set(add(1, 1)) == {55443322}"]}
    plan = verdict.plan("", row["test_list"], row)
    response = programs.response_program("def add(a, b):\n    return a + b", "", plan.names)
    assert "987654321" not in response and "55443322" not in response and "assert" not in response.split("serve(")[-1]
    judge = programs.judge_program(plan)
    assert "987654321" in judge and "return a + b" not in judge


# --------------------------------------------------------------------------- the referee
def _line(message) -> bytes:
    return json.dumps(message).encode()


def _concluded(referee, who, message):
    with pytest.raises(Concluded) as done:
        referee.line(who, _line(message) if not isinstance(message, bytes) else message)
    return done.value.outcome


def test_the_referee_forwards_only_answers_to_questions_rebuilt_as_data():
    ref = harness.Referee(["f"])
    assert _concluded(ref, "judge", {"call": [0, [], [], []]}).detail.startswith("the judge's run broke")
    ref = harness.Referee(["f"])
    assert not _concluded(ref, "response", {"names": {"g": ["missing"]}}).passed  # not the names asked
    ref = harness.Referee(["f"])
    [(to, data)] = ref.line("response", _line({"names": {"f": ["handle", 0, "function"]}}))
    assert to == "judge" and json.loads(data) == {"names": {"f": ["handle", 0, "function"]}}
    assert "no question" in _concluded(ref, "response", {"ok": ["int", "0x5"]}).detail  # unsolicited
    ref = harness.Referee(["f"])
    ref.line("response", _line({"names": {"f": ["handle", 0, "function"]}}))
    [(to, data)] = ref.line("judge", _line({"call": [0, [], [["int", "0x2"]], [["k", ["str", "v"]]]]}))
    assert to == "response" and json.loads(data)["call"][2] == [["int", "0x2"]]
    assert "not plain data" in _concluded(ref, "response", {"ok": ["object", "x"]}).detail
    for bad in (b"not json", _line([1]), _line({"ok": 1, "raise": 2})):
        assert not _concluded(harness.Referee(["f"]), "response", bad).passed


def test_the_referee_passes_only_a_verdict_with_checks_and_reports_refusals():
    def ended(verdict_body):
        ref = harness.Referee(["f"])
        ref.line("response", _line({"names": {"f": ["handle", 0, "function"]}}))
        return _concluded(ref, "judge", {"verdict": verdict_body})

    assert ended({"checks": 2, "failed": None, "refused": None}).passed
    assert not ended({"checks": 0, "failed": None, "refused": None}).passed
    assert not ended({"checks": 3, "failed": "AssertionError: x", "refused": None}).passed
    assert ended({"checks": 0, "failed": None, "refused": "the test runs eval()"}).refused == "the test runs eval()"
    ref = harness.Referee(["f"])
    with pytest.raises(Concluded):
        ref.closed("response")


def test_a_long_conversation_is_bounded_per_message_not_in_total():
    """300 answers of 1 KB each (300 KB, past the 64 KiB a message may take) score as their values say."""
    row = {"test": "def check(candidate):\n    for i in range(300):\n        assert candidate(i) == str(i) * 1000\n",
           "entry_point": "rep"}
    assert code_tests("", "def rep(i):\n    return str(i) * 1000", row) == 1.0
    assert code_tests("", "def rep(i):\n    return str(i) * (1000 if i < 299 else 999)", row) == 0.0


def test_a_row_without_an_id_is_named_by_its_tests():
    with pytest.raises(ValueError, match="the row whose test_list begins 'import math': its tests hold no check"):
        code_tests("", "def f():\n    return 1", {"test_list": ["import math"]})
    with pytest.raises(ValueError, match="the row whose prompt begins 'Write f': it has no tests"):
        code_tests("", "def f():\n    return 1", {"prompt": "Write f"})
