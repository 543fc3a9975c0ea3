"""The gold preference (task.preference) and what judges RL with it: the built-in gold function on
hand-checked answers, the labelled and noisy generated pairs, the win-rate and its sign test, the
reward-model score shaping (normalise, clip) and GRPO's std floor. Pure functions, no Ray."""

from __future__ import annotations

import pytest
import torch

from stages.common import tasks
from stages.common.tasks import TaskConfig, explained, verify
from stages.ppo import rl
from stages.ppo.scoring import RunningMoments, gold_win_rate, shape_model_scores, sign_test_p, win_rate
from stages.reward import gold_signs

GOLD = TaskConfig(min_digits=1, max_digits=1, ops=["+", "-"], operands=3,
                  preference={"gold": "explained", "noise": 0.15})


@pytest.mark.parametrize("response, points", [
    ("1", 0.0),                                  # the bare answer
    ("8 - 7 = 1", 1.0),                          # the work
    ("The answer is 1.", 1.0),                   # the stated answer
    ("8 - 7 = 1. The answer is 1.", 2.0),        # both, consistent
    ("8 - 7 = 2. The answer is 2.", 2.0),        # wrong arithmetic, explained and stated: gold is blind to it
    ("8 - 7 = 1. The answer is 3.", 1.0),        # a stated answer that contradicts its own work
    ("8 - 7 = 1. The answer is 1. 1", 1.0),      # something after the stated answer
    ("The answer is", 0.0),                      # cut off
])
def test_the_built_in_gold_scores_style_not_correctness(response, points):
    assert explained("What is 3 + 5 - 7?", response) == points


def test_every_answer_style_is_correct_and_gold_orders_them():
    work, value = "8 - 7 = 1", 1
    styled = [tasks.styled(work, value, i) for i in range(len(tasks.STYLES))]
    assert all(verify(text, "1") for text in styled)  # the verifier accepts every style
    assert [explained("", t) for t in styled] == [0.0, 1.0, 1.0, 2.0]


def test_generated_pairs_are_two_styles_of_the_right_answer_with_noisy_labels():
    rows = tasks.preference_rows(2000, 0, GOLD)
    flipped = 0
    for row in rows:
        answer = tasks.extract_answer(row["chosen"])
        assert answer == tasks.extract_answer(row["rejected"])  # the same answer, another style
        gc, gr = explained(row["prompt"], row["chosen"]), explained(row["prompt"], row["rejected"])
        assert gc != gr  # gold never ties a generated pair
        flipped += gc < gr
    assert 0.12 < flipped / len(rows) < 0.18  # noise 0.15 of 2000 pairs
    clean = TaskConfig(**{**GOLD.model_dump(), "preference": {"gold": "explained", "noise": 0.0}})
    assert all(explained(r["prompt"], r["chosen"]) > explained(r["prompt"], r["rejected"])
               for r in tasks.preference_rows(300, 0, clean))


def test_sft_answers_mix_the_styles_evenly_and_stay_correct():
    rows = tasks.sft_rows(2000, 0, GOLD)
    counts = {}
    for row in rows:
        reply = row["messages"][1]["content"]
        counts[explained("", reply)] = counts.get(explained("", reply), 0) + 1
    assert set(counts) == {0.0, 1.0, 2.0}
    assert 0.2 < counts[0.0] / len(rows) < 0.3 and 0.2 < counts[2.0] / len(rows) < 0.3
    # without a gold preference the task is what it was: one worked answer per problem
    plain = TaskConfig(min_digits=1, max_digits=1, ops=["+", "-"], operands=3)
    assert all("The answer" not in r["messages"][1]["content"] for r in tasks.sft_rows(200, 0, plain))


def test_a_users_gold_function_labels_the_pairs(tmp_path, monkeypatch):
    (tmp_path / "my_gold.py").write_text("def shortest(prompt, response):\n    return -len(response)\n"
                                         "def flat(prompt, response):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TaskConfig(**{**GOLD.model_dump(), "preference": {"gold": "my_gold:shortest", "noise": 0.0}})
    assert all(len(r["chosen"]) < len(r["rejected"]) for r in tasks.preference_rows(100, 0, cfg))
    flat = TaskConfig(**{**GOLD.model_dump(), "preference": {"gold": "my_gold:flat", "noise": 0.0}})
    with pytest.raises(Exception, match="same score"):
        tasks.preference_rows(5, 0, flat)
    with pytest.raises(Exception, match="cannot load"):
        tasks.gold_function("my_gold:missing")
    with pytest.raises(ValueError, match="module:function"):
        TaskConfig(preference={"gold": "nonsense"})


def test_the_reward_stage_relabels_held_out_pairs_by_gold():
    signs = gold_signs(["q"] * 3, ["8 - 7 = 1. The answer is 1.", "1", "1"], ["1", "8 - 7 = 1", "2"], explained)
    assert signs == [1, -1, 0]


def test_win_rate_counts_ties_as_halves():
    assert win_rate([1.0], [2.0]) == 1.0
    assert win_rate([1.0, 1.0], [1.0, 1.0]) == 0.5
    assert win_rate([0.0, 2.0], [1.0, 1.0]) == 0.5  # wins over 0, loses to 2
    assert win_rate([0.0, 1.0], [1.0, 2.0]) == (1 + 0.5 + 1 + 1) / 4


def test_gold_win_rate_sign_test_over_prompts():
    before = [[0.0, 1.0]] * 10 + [[2.0, 2.0]] * 2
    after = [[2.0, 2.0]] * 10 + [[1.0, 1.0]] * 2
    out = gold_win_rate(before, after)
    assert (out["gold_winrate_wins"], out["gold_winrate_losses"]) == (10, 2)
    assert out["gold_winrate"] == pytest.approx((10 * 1.0 + 2 * 0.0) / 12)
    assert out["gold_winrate_p"] == pytest.approx(sign_test_p(10, 2))
    tied = gold_win_rate([[1.0]] * 4, [[1.0]] * 4)
    assert tied["gold_winrate"] == 0.5 and tied["gold_winrate_p"] == 1.0


def test_running_moments_match_the_whole_sample_and_shape_scores():
    m = RunningMoments()
    xs = [1.0, 2.0, 4.0, 8.0, -3.0, 0.5]
    m.update(xs[:2])
    m.update(xs[2:])
    mean = sum(xs) / len(xs)
    assert m.mean == pytest.approx(mean)
    assert m.std == pytest.approx((sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5)
    z = shape_model_scores(xs, m, None)
    assert sum(z) == pytest.approx(0.0, abs=1e-9)
    assert max(shape_model_scores(xs, m, 1.0)) == 1.0 and min(shape_model_scores(xs, m, 1.0)) == -1.0
    assert shape_model_scores([5.0, -5.0], None, 2.0) == [2.0, -2.0]
    assert shape_model_scores([5.0], None, None) == [5.0]


def test_grpo_std_floor_keeps_near_ties_small():
    # one group of right/wrong answers (0/1), one group of wrong answers told apart by 0.01
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.0, 0.0])
    plain = rl.grpo_advantages(scores, 4)
    floored = rl.grpo_advantages(scores, 4, std_floor=0.1)
    # without the floor a 0.01 gap counts as much as 0/1
    assert float(plain[4]) == pytest.approx(float(plain[0]), rel=1e-3)
    assert floored[:4].tolist() == pytest.approx(plain[:4].tolist())  # the 0/1 group (std 0.43) is untouched
    assert float(floored[4]) == pytest.approx(0.0075 / 0.1, rel=1e-3)  # (0.01 - 0.0025) / floor
