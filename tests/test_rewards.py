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
    finally:
        reward.close()
