"""The rule reward (stages/ppo/rewards.py): the whole prompt row reaches a user's function, async functions
are awaited, and a call that hangs or raises scores the configured value, is counted and never stalls the
batch for more than the timeout; a worker stuck in a call is replaced."""

from __future__ import annotations

import json
import time

import pytest

from conftest import ROOT
from stages.ppo.rewards import RuleReward, bind, row_of

ROW = {"prompt": "Write f.", "answer": "4", "tests": ["assert f() == 4"]}


def test_a_function_gets_what_it_names():
    def by_column(response, tests):
        return float(len(tests))

    def legacy(prompt, response, answer):
        return float(answer == "4")

    def other_names(p, r, a):  # positional (prompt, response, answer), as documented before
        return float(a == "4")

    def whole_row(prompt, response, row):
        return float(row["tests"] == ROW["tests"])

    def everything(**columns):
        return float(sorted(columns) == ["answer", "completion", "prompt", "response", "tests"])

    for fn in (by_column, legacy, other_names, whole_row, everything):
        assert bind(fn)("Write f.", "def f(): return 4", ROW) == 1.0, fn.__name__


def test_the_row_a_function_sees_holds_the_users_columns_not_token_ids():
    stored = {"prompt": "q", "answer": "", "prompt_ids": [1, 2], "num_tokens": 2, "extra": json.dumps({"tests": [1]})}
    assert row_of(stored) == {"prompt": "q", "answer": "", "tests": [1]}


def test_the_verifier_scores_in_the_driver():
    reward = RuleReward("verifier", "exact")
    assert reward.scores(["The answer is Paris.", "Lyon"], [{"prompt": "q", "answer": "paris"}] * 2) == [1.0, 0.0]
    assert reward.counts() == {"rule_timeouts": 0, "rule_errors": 0}


def test_user_rewards_on_workers_time_out_and_fail_without_stalling(ray_local, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import asyncio\n"
        "def by_tests(response, tests):\n    return float(response in tests)\n"
        "async def later(response):\n    await asyncio.sleep(0.01)\n    return float(len(response))\n"
        "def hang(response):\n"
        "    if response == 'hang':\n        while True:\n            pass\n"
        "    if response == 'boom':\n        raise RuntimeError('boom')\n"
        "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # a user's module beside their config: the workers find it too
    rows = [{"prompt": "q", "answer": "", "extra": json.dumps({"tests": ["a"]})}] * 4
    logged: list[str] = []
    columns, awaited = RuleReward("my_rewards:by_tests", workers=2), RuleReward("my_rewards:later", workers=2)
    stuck = RuleReward("my_rewards:hang", workers=2, timeout_s=1.0, timeout_score=-1.0, log=logged.append)
    try:
        assert columns.scores(["a", "b", "a", "c"], rows) == [1.0, 0.0, 1.0, 0.0]
        assert awaited.scores(["a", "bb", "ccc", ""], rows) == [1.0, 2.0, 3.0, 0.0]
        t0 = time.monotonic()
        assert stuck.scores(["ok", "hang", "boom", "ok"], rows) == [1.0, -1.0, -1.0, 1.0]
        assert time.monotonic() - t0 < 1.0 + 5  # one timeout, not a stall
        assert stuck.counts() == {"rule_timeouts": 1, "rule_errors": 1}
        assert stuck.counts() == {"rule_timeouts": 0, "rule_errors": 0}  # counts are per read (per iteration)
        assert len(logged) == 1 and "RuntimeError: boom" in logged[0]
        t0 = time.monotonic()  # the worker stuck in `while True` was replaced: the next batch is quick and right
        assert stuck.scores(["ok"] * 4, rows) == [1.0] * 4 and time.monotonic() - t0 < 5
    finally:
        for reward in (columns, awaited, stuck):
            reward.close()


def test_a_reward_that_is_not_importable_is_a_config_error():
    from pipeline.errors import UserError

    with pytest.raises(UserError, match="stages.ppo.rewards.rule"):
        RuleReward("no_such_module_anywhere:f")


def test_code_tests_scores_mbpp_rows_in_the_sandbox_within_the_timeout(ray_local):
    """The code-execution reward through the workers, as an iteration calls it: a correct solution scores 1,
    a wrong one 0, and one that loops forever 0 within the call's timeout, not slowing the batch past it."""
    rows = [json.loads(line) for line in (ROOT / "tests" / "helpers" / "mbpp_sample.jsonl").read_text().splitlines()]
    stored = [{"prompt": r["text"], "answer": "", "extra": json.dumps({"test_list": r["test_list"]})} for r in rows]
    fenced = [f"Here you go:\n```python\n{r['code']}\n```" for r in rows]
    wrong = ["```python\ndef add(a, b):\n    return a - b\n```", "def is_even(n):\n    return True",
             "```python\ndef rev(s):\n    while True:\n        pass\n```"]
    reward = RuleReward("code_tests", workers=2, timeout_s=20.0)
    try:
        assert reward.scores(fenced, stored) == [1.0, 1.0, 1.0]
        t0 = time.monotonic()
        assert reward.scores(wrong, stored) == [0.0, 0.0, 0.0]  # the loop is ended by the sandbox's own limits
        assert time.monotonic() - t0 < 15
        assert reward.counts() == {"rule_timeouts": 0, "rule_errors": 0}
        # HumanEval's columns (test, entry_point) reach the reward whole; a row with nothing to check is its error
        check = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
        humaneval = [{"prompt": "add", "answer": "", "extra": json.dumps({"test": check, "entry_point": "add"})},
                     {"prompt": "none", "answer": "", "extra": json.dumps({"test_list": ["import math"]})}]
        assert reward.scores([fenced[0], fenced[0]], humaneval) == [1.0, 0.0]
        assert reward.counts() == {"rule_timeouts": 0, "rule_errors": 1}
    finally:
        reward.close()


# --------------------------------------------------------------------------- issue 48: the user's code fails loudly


def test_a_reward_must_be_a_finite_number():
    """nan, inf and strings float() would read ("nan", "1e999") are errors, not scores: one NaN turns a GRPO
    group's advantages into NaN."""
    import numpy as np

    from stages.ppo.rewards import finite_score

    for bad in (float("nan"), float("inf"), -float("inf"), "nan", "1e999", "0.5", None, [1.0], np.float64("nan")):
        with pytest.raises(ValueError, match="finite number"):
            finite_score(bad)
    assert [finite_score(x) for x in (1, 0.25, True, np.float32(0.5), np.array(2.0))] == [1.0, 0.25, 1.0, 0.5, 2.0]


def test_an_environments_non_finite_reward_is_its_error():
    from stages.ppo.environments import Step, as_step

    for bad in (([], float("nan"), False), ([], "nan", True), Step([], float("inf"))):
        with pytest.raises(ValueError, match="Step.reward must be a finite number"):
            as_step(bad)
    assert as_step(([], None, True)) == Step([], 0.0, True)


def test_the_error_budget_stops_past_its_share_and_on_a_first_batch_that_all_fails():
    from pipeline.errors import StageError
    from stages.ppo.rewards import ErrorBudget, over_budget

    assert not over_budget(4, 8, 0.5, first=True) and over_budget(5, 8, 0.5, first=False)
    assert over_budget(8, 8, 1.0, first=True) and not over_budget(8, 8, 1.0, first=False)
    assert not over_budget(0, 8, 0.0, first=True)
    budget = ErrorBudget("the rule reward my:f", 0.5)
    budget.check(1, 8, "", None)
    with pytest.raises(StageError) as exc:
        budget.check(6, 8, "Traceback...\nKeyError: 'solution'", {"prompt": "What is 2+2?", "answer": "4"})
    message = str(exc.value)
    for part in ("the rule reward my:f", "6 of 8", "KeyError: 'solution'", "What is 2+2?", "answer, prompt",
                 "stages.ppo.rewards.max_error_share"):
        assert part in message


def test_a_mapped_column_reaches_the_reward_under_the_users_name_too():
    """`columns: {prompt: question, answer: solution}`: the reward's row has `solution` as well as `answer`, and
    a function naming `solution` gets it by keyword (TRL's convention)."""
    from stages.data.formats import check_row

    good, reason = check_row("prompts", {"question": "What is 2+2?", "solution": "4", "level": 1}, "auto",
                             {"prompt": "question", "answer": "solution"})
    assert reason == "" and good["answer"] == "4"
    stored = {"prompt": good["prompt"], "answer": good["answer"], "extra": json.dumps(good["extra"])}
    row = row_of(stored)
    assert row["solution"] == "4" and row["question"] == "What is 2+2?" and row["answer"] == "4" and row["level"] == 1
    assert bind(lambda response, solution: float(response == solution))("q", "4", row) == 1.0


def test_a_reward_that_always_raises_stops_the_stage_naming_it(ray_local, tmp_path, monkeypatch):
    """The reproduction of issue 48: a reward reading a column the config renamed raised on every call and a
    run trained on zeros. Now the first batch stops the stage with the function, the exception, a row and the
    key to raise; a NaN-returning reward counts as failing too; a few failures are counted, not fatal."""
    from pipeline.errors import StageError

    (tmp_path / "user_rewards.py").write_text(
        "def reads_solution(response, row):\n    return float(response == row['solution'])\n"
        "def nan_sometimes(response):\n    return float('nan') if response == 'x' else 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(4)]
    broken = RuleReward("user_rewards:reads_solution", workers=2, log=lambda _: None)
    flaky = RuleReward("user_rewards:nan_sometimes", workers=2, log=lambda _: None)
    try:
        with pytest.raises(StageError) as exc:
            broken.scores(["2", "4", "6", "8"], rows)
        for part in ("user_rewards:reads_solution", "4 of 4", "KeyError: 'solution'", "What is 0+0?",
                     "stages.ppo.rewards.max_error_share"):
            assert part in str(exc.value)
        assert flaky.scores(["x", "y", "y", "y"], rows) == [0.0, 1.0, 1.0, 1.0]  # 1 of 4: counted, goes on
        assert flaky.counts() == {"rule_timeouts": 0, "rule_errors": 1}
        assert flaky.totals() == {"rule_errors_total": 1}
        with pytest.raises(StageError, match="3 of 4"):
            flaky.scores(["x", "x", "x", "y"], rows)
    finally:
        broken.close()
        flaky.close()


@pytest.mark.timeout(120)
def test_a_timeout_holds_while_the_call_holds_the_interpreter(ray_local, tmp_path, monkeypatch):
    """A regex in catastrophic backtracking holds the GIL: no thread in the worker can time it out (it returned
    after 25 s against a 1 s timeout, and `(a+)+$` on 40 a's never would). The driver kills the worker at the
    deadline and a fresh one scores the next batch."""
    (tmp_path / "stuck_rewards.py").write_text(
        "import re\n"
        "def backtrack(response):\n"
        "    if response == 'stuck':\n        re.match(r'(a+)+$', 'a' * 40 + 'b')\n"
        "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": "q", "answer": ""}] * 4
    reward = RuleReward("stuck_rewards:backtrack", workers=2, timeout_s=1.0, timeout_score=-1.0, log=lambda _: None)
    try:
        assert reward.scores(["ok", "stuck", "ok", "ok"], rows) == [1.0, -1.0, 1.0, 1.0]
        assert reward.counts() == {"rule_timeouts": 1, "rule_errors": 0}
        assert reward.scores(["ok"] * 4, rows) == [1.0] * 4
    finally:
        reward.close()


def test_a_stage_stopped_by_failing_user_code_exits_1_with_its_message_and_no_traceback(monkeypatch, capsys):
    import pipeline.__main__ as cli
    from pipeline.errors import StageError

    def stopped(args, console, state):
        state["summary"]["running"] = "ppo"
        raise StageError("the rule reward my:f failed on 4 of 4 calls of one batch; raise stages.ppo.rewards."
                         "max_error_share")

    monkeypatch.setattr(cli, "_command", stopped)
    assert cli.main(["validate", str(ROOT / "configs" / "full.yaml")]) == 1
    err = capsys.readouterr().err
    assert "failed on 4 of 4 calls" in err and "stage 'ppo' failed" in err and "Traceback" not in err


def test_an_environment_that_breaks_its_protocol_on_most_episodes_stops_the_stage():
    from pipeline.errors import StageError
    from stages.ppo.rewards import ErrorBudget

    rows = [{"prompt": "What is 2+2?", "answer": "4", "extra": json.dumps({"level": 1})},
            {"prompt": "What is 3+3?", "answer": "6"}]
    bad = "ValueError: Step.reward must be a finite number, got nan"
    budget = ErrorBudget("the environment my_env:Env", 0.5, "episodes")
    budget.check_episodes([{"env_error": ""}, {"env_error": bad}, {"env_error": ""}, {"env_error": ""}], rows)
    assert budget.failed == 1  # one of four: counted, the run goes on
    with pytest.raises(StageError) as exc:
        budget.check_episodes([{"env_error": ""}, {"env_error": bad}, {"env_error": bad}, {"env_error": bad}], rows)
    for part in ("the environment my_env:Env", "3 of 4 episodes", "Step.reward must be a finite number", "What is 2+2?",
                 "stages.ppo.rewards.max_error_share"):
        assert part in str(exc.value)
    budget.check_episodes([{"ids": [1]}], rows)  # single-turn samples: nothing to check
