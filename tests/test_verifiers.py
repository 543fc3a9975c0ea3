"""The answer verifiers (stages/common/verifiers.py, `task.verifier`): each built-in on hand-written responses in
the forms chat models write, right and wrong, and the lookup by name. Pure functions, no Ray; a few seconds."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from pipeline.errors import UserError
from stages.common import tasks, verifiers
from stages.common.verifiers import BUILTINS, choice, exact, final_answer, math, number, regex, verifier_function


# --------------------------------------------------------------------------- number


@pytest.mark.parametrize("response, answer, expected", [
    ("12 + 30 = 42", "42", True),
    ("so the answer is 1,024", "1024", True),
    ("The answer is 12.0", "12", True),
    ("12 (7 more than 5)", "12", True),
    ("12 + 30 = 43", "42", False),
    ("The answer is 142.", "42", False),  # contains the right number, is not it
    ("", "0", False),
    ("12", "twelve", False),  # a reference that is not a number matches nothing
])
def test_number_is_the_arithmetic_tasks_verifier(response, answer, expected):
    assert number(response, answer) is expected
    assert tasks.verify(response, answer) is expected


# --------------------------------------------------------------------------- exact


@pytest.mark.parametrize("response", [
    "Paris",
    "paris",
    "The answer is Paris.",
    "**Paris**",
    "Answer: Paris",
    "**Answer:** Paris",
    "Final answer: PARIS!",
    "**Final answer:**\nParis",
    "The answer is \"Paris\"",
    "  The   answer is  paris  ",
    "The answer is Paris. It is the capital of France.",  # a same-line explanation after the sentence
    "Answer: Paris\nIt has been the capital since 987.",  # an explanation on the next line
    "France's capital city...\nParis",  # no marker: the last non-empty line
    "The answer is Lyon. No wait, the answer is Paris.",  # the last stated answer
    "The answer is $\\boxed{Paris}$",
])
def test_exact_accepts_the_reference_in_the_forms_chat_models_write(response):
    assert exact(response, "Paris")


@pytest.mark.parametrize("response", [
    "Lyon",
    "The answer is Lyon.",
    "Paris or Lyon",  # a hedge is not an answer
    "Paris, France",  # strict: more than the reference
    "Parisian",  # contains the reference
    "not Paris",
    "The capital of France is Paris.",  # no marker: the whole last line must be the answer
    "The answer is Paris.\nThe answer is Lyon.",
    "The answer is",  # cut off
    "",
    "   \n  ",
])
def test_exact_rejects_wrong_and_hedged_answers(response):
    assert not exact(response, "Paris")


@pytest.mark.parametrize("response, answer, expected", [
    ("The Beatles", "Beatles", True),  # articles drop
    ("an apple", "Apple", True),
    ("St. Louis.", "St. Louis", True),  # an abbreviation inside the answer is not a sentence end
    ("The answer is 3.5", "3.5", True),
    ("The answer is 35", "3.5", False),  # inner punctuation stays (unlike SQuAD)
    ("-7", "7", False),  # a sign is part of the answer
    ("C++", "C", False),
    ("The answer is A.", "a", True),  # a lone letter is not an article
    ("The answer is A.", "B", False),
    ("anything", "", False),  # a reference that normalises to nothing matches nothing
    ("", "", False),
])
def test_exact_normalisation(response, answer, expected):
    assert exact(response, answer) is expected


def test_final_answer_takes_the_last_box_then_the_last_marker_then_the_last_line():
    assert final_answer("\\boxed{1} then \\boxed{2}. The answer is 3") == "2"
    assert final_answer("Answer: 1. Hmm. Final answer: 2\nbecause") == "2"
    assert final_answer("first\nsecond\n\n") == "second"
    assert final_answer("To answer this, think.\nParis") == "Paris"  # "to answer" is not a marker
    assert final_answer("The answer is") is None
    assert final_answer("") is None


# --------------------------------------------------------------------------- choice


@pytest.mark.parametrize("response", [
    "B",
    "b",
    "(B)",
    "(b)",
    "B.",
    "**B**",
    "B) Paris",
    "The answer is B.",
    "The answer is (B) Paris.",
    "Answer: (b)",
    "answer: b",
    "**Answer:** B",
    "Final answer: **(B)**",
    "I think the correct option is B",
    "The answer is option B because Paris is the capital.",
    "Option B",
    "My choice: B",
    "The answer is B, not C.",  # the marker decides
    "Answer: A\nWait, that is wrong. The answer is B.",  # the last marker
    "A careful reading of the question shows B is right.",  # "A" the article
    "I think it is B.",  # "I" the pronoun
    "\\boxed{B}",
    "Paris is the capital, so (B).",
])
def test_choice_accepts_the_forms_chat_models_write(response):
    assert choice(response, "B")


@pytest.mark.parametrize("response", [
    "C",
    "The answer is C.",
    "Answer: (c)",
    "The answer is C, not B.",
    "A or B",  # two letters, no marker: ambiguous
    "B and C both look right",
    "A) Paris\nB) Lyon",  # the options restated
    "Berlin",  # a word starting with the letter
    "Paris",  # no letter at all
    "The answer is a bit unclear.",  # an article after the marker, no letter
    "",
])
def test_choice_rejects_other_ambiguous_and_missing_letters(response):
    assert not choice(response, "B")


@pytest.mark.parametrize("answer", ["B", "(B)", "b", "B) Paris", "B. Paris", " B "])
def test_choice_reads_the_reference_letter_in_its_forms(answer):
    assert choice("The answer is (B).", answer)
    assert not choice("The answer is (C).", answer)


@pytest.mark.parametrize("answer", ["Paris", "", "K", "Bob"])
def test_choice_refuses_a_reference_that_is_not_a_letter(answer):
    with pytest.raises(ValueError, match="choice verifier: the reference answer .* is not a choice letter A-J"):
        choice("B", answer)


# --------------------------------------------------------------------------- regex


@pytest.mark.parametrize("response, answer, expected", [
    ("The answer is 42 km.", r"\d+ ?km", True),
    ("**Answer:** 42km", r"\d+ ?km", True),
    ("42 km", r"\d+ ?km", True),
    ("Mount Everest", r"(?i)(mount |mt\.? )?everest", True),
    ("The answer is Mt. Everest.", r"(?i)(mount |mt\.? )?everest", True),
    ("everest", r"Everest", False),  # case-sensitive unless the expression says (?i)
    ("The answer is 42 km or 43 km", r"\d+ ?km", False),  # fullmatch: extra text fails
    ("It is 42 km away, I think\nnot sure", r"\d+ ?km", False),  # the final answer only, not a search
    ("The answer is 142", r"42", False),  # contains a match, is not one
    ("", r".*", False),
])
def test_regex_fullmatches_the_final_answer(response, answer, expected):
    assert regex(response, answer) is expected


def test_regex_refuses_an_invalid_expression():
    with pytest.raises(ValueError, match=r"regex verifier: the reference answer '\(unclosed' is not a valid regular"):
        regex("anything", "(unclosed")


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize("response, answer", [
    ("The answer is $\\boxed{0.5}$", "\\frac{1}{2}"),
    ("$\\boxed{\\frac{1}{2}}$", "0.5"),
    ("1/2", "\\frac{1}{2}"),
    ("The answer is $\\boxed{1+x^2}$.", "x^2+1"),
    ("$\\boxed{\\sqrt{12}}$", "2\\sqrt{3}"),
    ("So $x = \\sqrt 2$.", "\\sqrt{2}"),
    ("**12**", "12"),
    ("7 + 5 = 12", "12"),
    ("The answer is 12. I added 7 and 5.", "12"),
    ("Answer: 1,000", "1000"),
    ("We get $\\pi$, so the final answer is $\\boxed{\\pi}$", "$\\pi$"),  # a delimited reference as is
])
def test_math_accepts_equal_answers_in_latex_and_plain_forms(response, answer):
    assert math(response, answer)


@pytest.mark.parametrize("response, answer", [
    ("The answer is $\\boxed{13}$", "3"),  # contains the right answer, is not it
    ("The answer is $\\boxed{0.6}$", "\\frac{1}{2}"),
    ("$\\boxed{x^2-1}$", "x^2+1"),
    ("Final answer: 55", "5"),
    ("$\\boxed{3}$ or $\\boxed{4}$", "3"),  # two boxed answers are a set, not 3
    ("I don't know.", "3"),
    ("", "3"),
    ("3", ""),
])
def test_math_rejects_wrong_and_missing_answers(response, answer):
    assert not math(response, answer)


def test_math_works_off_the_main_thread():
    # math-verify's signal-based timeout would raise ValueError here; the verifier turns it off in threads.
    results = []
    worker = threading.Thread(target=lambda: results.append(math("The answer is $\\boxed{0.5}$", "\\frac{1}{2}")))
    worker.start()
    worker.join(timeout=60)
    assert results == [True]


def test_math_bounds_a_response_sympy_cannot_finish(monkeypatch):
    monkeypatch.setattr(verifiers, "MATH_TIMEOUT_S", 1)
    started = time.monotonic()
    assert not math("$\\boxed{9^{9^{9^{9}}}}$", "2")  # without a timeout this comparison never returns
    assert time.monotonic() - started < 10


def test_math_keeps_an_outer_alarm_armed():
    previous_handler = signal.signal(signal.SIGALRM, lambda *_: None)
    previous_timer = signal.setitimer(signal.ITIMER_REAL, 60)
    try:
        assert math("$\\boxed{2}$", "2")
        assert 50 < signal.getitimer(signal.ITIMER_REAL)[0] <= 60
    finally:
        signal.setitimer(signal.ITIMER_REAL, *previous_timer)
        signal.signal(signal.SIGALRM, previous_handler)


# --------------------------------------------------------------------------- by name


def test_the_built_ins_by_name():
    assert list(BUILTINS) == ["number", "exact", "choice", "regex", "math"]
    cases = {"number": ("7 + 5 = 12", "12"), "exact": ("Answer: Paris.", "Paris"), "choice": ("Answer: (b)", "B"),
             "regex": ("The answer is 42 km.", r"\d+ ?km"), "math": ("$\\boxed{0.5}$", "\\frac{1}{2}")}
    for name, fn in BUILTINS.items():
        assert verifier_function(name)(*cases[name]) and fn(*cases[name])
        assert not verifier_function(name)("nothing", cases[name][1])
    # for scoring many rows: a reference the verifier cannot read scores False instead of raising
    with pytest.raises(ValueError):
        BUILTINS["choice"]("B", "maybe")
    assert verifier_function("choice")("B", "maybe") is False


def test_a_module_function_verifier(tmp_path, monkeypatch):
    (tmp_path / "verifier_plugin_for_tests.py").write_text(
        "def ends_with(response, answer):\n    return response.strip().endswith(answer)\n")
    monkeypatch.syspath_prepend(tmp_path)
    fn = verifier_function("verifier_plugin_for_tests:ends_with")
    assert fn("so it is 42", "42") and not fn("42 it is", "42")
    with pytest.raises(UserError, match="task.verifier: cannot load 'verifier_plugin_for_tests:missing'"):
        verifier_function("verifier_plugin_for_tests:missing")


@pytest.mark.parametrize("spec", ["exactly", "", "module:", ":function", "no_such_module_for_tests:fn"])
def test_a_bad_verifier_spec_is_a_clear_error(spec):
    with pytest.raises(UserError, match="task.verifier") as err:
        verifier_function(spec)
    assert "number, exact, choice, regex, math or an importable 'module:function'" in str(err.value)


def test_importing_the_verifiers_stays_light():
    code = ("import sys, stages.common.verifiers; "
            "print(sorted(m for m in ('math_verify', 'sympy', 'torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_task_verifier_keys_the_stages_that_score_and_only_them(tmp_path, monkeypatch):
    """`task.verifier` changes SFT's accuracy, PPO's rule reward and evaluation: it is in their cache keys and
    not in data's; a custom verifier's module is code of theirs (editing it reruns them)."""
    from conftest import smoke_config
    from pipeline.runner import build_plan

    (tmp_path / "my_check.py").write_text("def same(response, answer):\n    return response.strip() == answer\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def keys(*overrides):
        return {p.spec.name: p.key for p in build_plan(smoke_config(tmp_path / "run", *overrides))}

    number, exact, custom = keys(), keys("task.verifier=exact"), keys("task.verifier=my_check:same")
    # reward and serve are downstream of sft and ppo; the model and data stages generate the task and ignore it
    assert {s for s in number if number[s] != exact[s]} == {"sft", "reward", "ppo", "serve"}
    assert number["data"] == exact["data"] == custom["data"]
    (tmp_path / "my_check.py").write_text("def same(response, answer):\n    return response == answer\n")
    edited = keys("task.verifier=my_check:same")
    assert edited["sft"] != custom["sft"] and edited["data"] == custom["data"]


def test_the_rule_reward_and_scores_use_the_task_verifier():
    from stages.common.models import verified_share
    from stages.ppo.scoring import rule_reward

    assert rule_reward("verifier", "exact")("", "The answer is Paris.", "paris") == 1.0
    assert rule_reward("verifier")("", "The answer is Paris.", "paris") == 0.0  # number: no number in it
    rows = [{"answer": "B"}, {"answer": "C"}, {"answer": "maybe"}]  # an unreadable reference scores 0, no crash
    assert verified_share(["(B)", "Answer: A", "B"], [False, True, False], rows, "choice") == (1 / 3, 1 / 3)
