"""PPO/GRPO math against hand-computed values (docs/architecture.md).

Every expected number is worked out in the comments and written as a literal; padded positions
hold garbage (9, 100, ...) so a function that forgets the mask gets a different answer.
"""

import math

import pytest
import torch

from stages.ppo import losses, rl

LN2 = math.log(2)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.tensor(expected, dtype=torch.float32), atol=tol, rtol=0)


# --------------------------------------------------------------------------- masked statistics


def test_masked_mean_ignores_padding_and_guards_empty_rows():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(rl.masked_mean(x, mask), 7 / 3)  # (1 + 2 + 4) / 3; the NaN is padding
    close(rl.masked_mean(x, mask, dim=1), [1.5, 4.0])  # (1+2)/2, 4/1
    close(rl.masked_mean(x, mask, dim=0), [2.5, 2.0, 0.0])  # (1+4)/2, 2/1, empty column -> 0 not NaN
    close(rl.masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, var ((1)^2 + 0 + 1^2) / 3 = 2/3, std 0.8164966 -> -1/0.8164966 = -1.2247449
    out = rl.masked_whiten(x, mask)
    close(out, [[-1.2247449, 0.0, 1.2247449, 0.0]])
    real = out[mask.bool()]
    close(real.mean(), 0.0)
    close(real.std(unbiased=False), 1.0)
    # shift_mean=False adds the mean 2 back: 0.7752551, 2, 3.2247449; padding still 0
    close(rl.masked_whiten(x, mask, shift_mean=False), [[0.7752551, 2.0, 3.2247449, 0.0]])


# --------------------------------------------------------------------------- from logits


def test_logprobs_and_entropy_from_logits():
    # logits log(1), log(2), log(3) (+5, which softmax ignores) -> p = 1/6, 1/3, 1/2
    row = torch.tensor([0.0, LN2, math.log(3)]) + 5
    uniform = torch.zeros(3)
    logits = torch.stack([row, row, uniform]).unsqueeze(0)  # (1, 3, 3)
    labels = torch.tensor([[2, 0, 1]])
    out = rl.logprobs_from_logits(logits.to(torch.bfloat16), labels)
    assert out.shape == (1, 3) and out.dtype == torch.float32
    close(rl.logprobs_from_logits(logits, labels), [[math.log(0.5), math.log(1 / 6), math.log(1 / 3)]])
    # H(1/6, 1/3, 1/2) = ln6/6 + ln3/3 + ln2/2 = 0.2986266 + 0.3662041 + 0.3465736 = 1.0114043; uniform: ln 3
    entropy = rl.entropy_from_logits(logits)
    assert entropy.dtype == torch.float32
    close(entropy, [[1.0114043, 1.0114043, 1.0986123]])
    close(rl.entropy_from_logits(torch.tensor([[[100.0, 0.0, 0.0]]])), [[0.0]])  # near one-hot


# --------------------------------------------------------------------------- KL


def test_kl_estimators_on_known_logprobs():
    logp, ref = torch.tensor([math.log(0.5), math.log(0.25)]), torch.tensor([math.log(0.25), math.log(0.5)])
    # log_ratio = +ln2, -ln2 (ln2 = 0.6931472)
    close(rl.kl_penalty(logp, ref, "k1"), [0.6931472, -0.6931472])
    # k2 = 0.5 * 0.4804530 = 0.2402265 for both signs
    close(rl.kl_penalty(logp, ref, "k2"), [0.2402265, 0.2402265])
    # k3 = exp(-lr) - 1 + lr: 0.5 - 1 + 0.6931472 = 0.1931472; 2 - 1 - 0.6931472 = 0.3068528
    close(rl.kl_penalty(logp, ref, "k3"), [0.1931472, 0.3068528])
    for estimator in rl.KL_ESTIMATORS:
        close(rl.kl_penalty(logp, logp, estimator), [0.0, 0.0])


def test_unknown_kl_estimator_names_the_valid_ones():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        rl.kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# --------------------------------------------------------------------------- rewards and advantages


def test_token_rewards_place_the_score_on_the_last_real_token():
    scores = torch.tensor([1.0, -0.5, 3.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    # kl_coef 0.5: row 0 -0.05, -0.1, -0.15 + 1 = 0.85
    #              row 1 -0.2, -0.25 - 0.5 = -0.75, padding 0
    #              row 2 is empty: no penalty, no score
    out = rl.token_rewards(scores, kl, mask, kl_coef=0.5)
    close(out, [[-0.05, -0.1, 0.85], [-0.2, -0.75, 0.0], [0.0, 0.0, 0.0]])


def test_gae_gamma_one():
    # gamma 1, lam 0.95, rewards 0 0 1, values 0.5 0.6 0.7, value after the end 0:
    # delta2 = 1 + 0 - 0.7 = 0.3                          A2 = 0.3
    # delta1 = 0 + 0.7 - 0.6 = 0.1                        A1 = 0.1 + 0.95 * 0.3 = 0.385
    # delta0 = 0 + 0.6 - 0.5 = 0.1                        A0 = 0.1 + 0.95 * 0.385 = 0.46575
    # returns = A + V = 0.96575, 0.985, 1.0
    adv, ret = rl.gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
                      torch.ones(1, 3), gamma=1.0, lam=0.95)
    close(adv, [[0.46575, 0.385, 0.3]])
    close(ret, [[0.96575, 0.985, 1.0]])


def test_gae_discounted_with_a_padded_row():
    rewards = torch.tensor([[0.1, 0.0, 1.0], [0.5, -1.0, 9.0]])
    values = torch.tensor([[0.2, 0.4, 0.5], [1.0, 0.3, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma 0.9, lam 0.8, gamma*lam 0.72
    # row 0: delta2 = 1 - 0.5 = 0.5                       A2 = 0.5
    #        delta1 = 0 + 0.9*0.5 - 0.4 = 0.05            A1 = 0.05 + 0.72*0.5 = 0.41
    #        delta0 = 0.1 + 0.9*0.4 - 0.2 = 0.26          A0 = 0.26 + 0.72*0.41 = 0.5552
    #        returns 0.7552, 0.81, 1.0
    # row 1 (last token padding, its reward 9 and value 7 ignored):
    #        A2 = 0
    #        delta1 = -1 + 0.9*0 - 0.3 = -1.3             A1 = -1.3
    #        delta0 = 0.5 + 0.9*0.3 - 1.0 = -0.23         A0 = -0.23 + 0.72*(-1.3) = -1.166
    #        returns -0.166, -1.0, 0
    adv, ret = rl.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.5552, 0.41, 0.5], [-1.166, -1.3, 0.0]])
    close(ret, [[0.7552, 0.81, 1.0], [-0.166, -1.0, 0.0]])


def test_grpo_advantages():
    # group 1 all equal -> 0; group 2 (0, 1, 2): mean 1, std sqrt(2/3) = 0.8164966 -> -+1.2247449
    close(rl.grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0]), group_size=3),
          [0.0, 0.0, 0.0, -1.2247449, 0.0, 1.2247449])
    # (0, 0, 0, 1): mean 0.25, var (3*0.0625 + 0.5625)/4 = 0.1875, std 0.4330127
    # -> -0.25/0.4330127 = -0.5773503, 0.75/0.4330127 = 1.7320508
    close(rl.grpo_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), group_size=4),
          [-0.5773503, -0.5773503, -0.5773503, 1.7320508])


def test_grpo_rejects_ragged_groups():
    with pytest.raises(ValueError, match="divisible by group_size=2"):
        rl.grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError):
        rl.grpo_advantages(torch.zeros(4), group_size=0)


# --------------------------------------------------------------------------- losses


def _policy_case(ratio: float, advantage: float, clip_eps: float = 0.2):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = losses.policy_loss(logp, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), clip_eps)
    loss.backward()
    return loss.item(), logp.grad.item(), stats["clip_frac"]


def test_policy_loss_inside_the_clip_range():
    # ratio 1.1 within [0.8, 1.2]: loss -A*r = -2.2, d/dlogp (-A*r) = -A*r = -2.2
    loss, grad, clip_frac = _policy_case(1.1, 2.0)
    assert (loss, clip_frac) == (pytest.approx(-2.2), 0.0)
    assert grad == pytest.approx(-2.2)


def test_policy_loss_clips_ratio_above_range_with_positive_advantage():
    # ratio 1.5, A = 1: max(-1.5, -1.2) = -1.2, the clipped constant -> no gradient
    loss, grad, clip_frac = _policy_case(1.5, 1.0)
    assert (loss, grad, clip_frac) == (pytest.approx(-1.2), 0.0, 1.0)


def test_policy_loss_clips_ratio_below_range_with_negative_advantage():
    # ratio 0.5, A = -1: max(0.5, 0.8) = 0.8, clipped -> no gradient
    loss, grad, clip_frac = _policy_case(0.5, -1.0)
    assert (loss, grad, clip_frac) == (pytest.approx(0.8), 0.0, 1.0)


def test_policy_loss_keeps_the_pessimistic_unclipped_side():
    # ratio 1.5, A = -1: max(1.5, 1.2) = 1.5 unclipped, gradient -A*r = 1.5
    loss, grad, clip_frac = _policy_case(1.5, -1.0)
    assert (loss, grad, clip_frac) == (pytest.approx(1.5), pytest.approx(1.5), 0.0)
    # ratio 0.5, A = 1: max(-0.5, -0.8) = -0.5 unclipped, gradient -0.5
    loss, grad, clip_frac = _policy_case(0.5, 1.0)
    assert (loss, grad, clip_frac) == (pytest.approx(-0.5), pytest.approx(-0.5), 0.0)


def test_policy_loss_batch_with_padding():
    ratios = [1.1, 1.5, 0.5, 0.5, 50.0]  # the last token is padding
    logp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    advantages = torch.tensor([[2.0, 1.0, -1.0, 1.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = losses.policy_loss(logp, torch.zeros(1, 5), advantages, mask, clip_eps=0.2)
    loss.backward()
    # per token -2.2, -1.2 (clipped), 0.8 (clipped), -0.5 -> mean -3.1 / 4 = -0.775
    assert loss.item() == pytest.approx(-0.775)
    assert stats["clip_frac"] == pytest.approx(0.5)  # 2 of 4 real tokens
    # 0.5 * (ln1.1^2 + ln1.5^2 + 2 ln0.5^2) / 4 = 0.5 * (0.0090840 + 0.1644020 + 0.9609060) / 4 = 0.1417990
    assert stats["approx_kl"] == pytest.approx(0.141799, abs=1e-6)
    # gradient -A*r / 4 where unclipped and real: -2.2/4, 0, 0, -0.5/4, 0
    close(logp.grad, [[-0.55, 0.0, 0.0, -0.125, 0.0]])
    assert isinstance(stats["clip_frac"], float) and isinstance(stats["approx_kl"], float)


def test_value_loss_clipped_and_unclipped():
    values = torch.tensor([[1.0, 0.5, 2.0, 0.0, 40.0]])
    old = torch.tensor([[0.5, 0.4, 2.0, 0.5, 0.0]])
    returns = torch.tensor([[1.0, 0.0, 3.0, 1.0, -40.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # clip 0.2: token 0 v-old 0.5 -> clipped v 0.7: max(0, 0.09) = 0.09 (clip active)
    #           token 1 v-old 0.1 -> clipped v 0.5: max(0.25, 0.25) = 0.25 (tie: not counted)
    #           token 2 v = old -> max(1, 1) = 1
    #           token 3 v-old -0.5 -> clipped v 0.3: max(1, 0.49) = 1 (unclipped is worse)
    #           loss 0.5 * (0.09 + 0.25 + 1 + 1) / 4 = 0.2925, clip frac 1/4
    loss, stats = losses.value_loss(values, old, returns, mask, clip_value=0.2)
    assert loss.item() == pytest.approx(0.2925)
    assert stats["value_clip_frac"] == pytest.approx(0.25)
    # no clipping: 0.5 * (0 + 0.25 + 1 + 1) / 4 = 0.28125
    loss, stats = losses.value_loss(values, old, returns, mask, clip_value=None)
    assert loss.item() == pytest.approx(0.28125)
    assert stats["value_clip_frac"] == 0.0


# --------------------------------------------------------------------------- KL coefficient


def test_fixed_controller_never_moves():
    ctl = rl.kl_controller("fixed", 0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert isinstance(ctl, rl.FixedKLController) and ctl.value == 0.05


def test_adaptive_controller_moves_toward_the_target():
    # target 6, horizon 10000, 100 steps: n_steps / horizon = 0.01
    up = rl.kl_controller("adaptive", 0.1, target=6.0, horizon=10000)
    up.update(current_kl=12.0, n_steps=100)  # error 12/6 - 1 = 1, clipped to 0.2 -> x 1.002
    assert up.value == pytest.approx(0.1002)
    down = rl.kl_controller("adaptive", 0.1, target=6.0, horizon=10000)
    down.update(current_kl=3.0, n_steps=100)  # error -0.5, clipped to -0.2 -> x 0.998
    assert down.value == pytest.approx(0.0998)
    small = rl.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    small.update(current_kl=6.6, n_steps=100)  # error 0.1, inside the clip -> x 1.001
    assert small.value == pytest.approx(0.1001)


def test_kl_controller_rejects_bad_kinds_and_settings():
    with pytest.raises(ValueError, match="fixed, adaptive"):
        rl.kl_controller("pid", 0.1, 6.0, 10000)
    with pytest.raises(ValueError, match="target > 0"):
        rl.kl_controller("adaptive", 0.1, None, 10000)


# --------------------------------------------------------------------------- critic-free estimators


def test_rloo_leave_one_out_baseline():
    # group [3, 1, 2]: baselines (1+2)/2 = 1.5, (3+2)/2 = 2.5, (3+1)/2 = 2 -> 1.5, -1.5, 0
    # group [1, 0, 0]: baselines 0, 0.5, 0.5 -> 1, -0.5, -0.5
    close(rl.rloo_advantages(torch.tensor([3.0, 1.0, 2.0, 1.0, 0.0, 0.0]), 3), [1.5, -1.5, 0.0, 1.0, -0.5, -0.5])
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        rl.rloo_advantages(torch.tensor([1.0, 0.0]), 1)  # one sample has no "others"


def test_dr_grpo_subtracts_the_group_mean_without_std():
    # group [1, 0, 0]: mean 1/3 -> 2/3, -1/3, -1/3 (GRPO would divide by std 0.4714: 1.414, -0.707, -0.707)
    close(rl.dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 5.0, 5.0, 5.0]), 3), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    with pytest.raises(ValueError, match="divisible"):
        rl.dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0]), 2)


def test_reinforce_pp_returns_whitened_over_the_batch():
    # rewards [[0, 1], [0, pad 9]]: returns (gamma 1) [[1, 1], [0, -]]
    # real tokens 1, 1, 0: mean 2/3, variance ((1/3)^2 * 2 + (2/3)^2) / 3 = 2/9, std sqrt(2)/3
    # -> (1/3) / (sqrt(2)/3) = 1/sqrt(2) = 0.7071, (-2/3) / (sqrt(2)/3) = -sqrt(2); padding 0
    rewards = torch.tensor([[0.0, 1.0], [0.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    close(rl.reinforce_pp_advantages(rewards, mask), [[0.70711, 0.70711], [-1.41421, 0.0]], tol=1e-4)
    # gamma 0.5: returns [[0.5, 1], [0]] -> mean 0.5, var (0 + 0.25 + 0.25)/3 = 1/6 -> 0, 1.2247, -1.2247
    close(rl.reinforce_pp_advantages(rewards, mask, gamma=0.5), [[0.0, 1.22474], [-1.22474, 0.0]], tol=1e-4)


def test_tis_weights_are_the_truncated_ratio():
    trainer = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    rollout = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    # ratios 0.5/0.25 = 2 (capped at 1.5), 0.25/0.5 = 0.5, 1
    close(rl.tis_weights(trainer, rollout, cap=1.5), [1.5, 0.5, 1.0])
    with pytest.raises(ValueError, match="cap must be > 0"):
        rl.tis_weights(trainer, rollout, cap=0)


def test_logprob_mismatch_ignores_padding():
    trainer = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]])
    rollout = torch.tensor([[-1.1, -1.7], [-0.5, 0.0]])  # |diff| 0.1, 0.3, 0, and 9 on padding
    got = rl.logprob_mismatch(trainer, rollout, torch.tensor([[1, 1], [1, 0]]))
    assert got["logprob_mismatch_mean"] == pytest.approx(0.4 / 3)
    assert got["logprob_mismatch_max"] == pytest.approx(0.3)


def test_aggregate_by_each_loss_type():
    per_token = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    close(losses.aggregate(per_token, mask, "bnpo"), 2.0)  # (1 + 2 + 3) / 3
    close(losses.aggregate(per_token, mask, "grpo"), 2.25)  # ((1 + 2) / 2 + 3 / 1) / 2
    close(losses.aggregate(per_token, mask, "dr_grpo", max_len=4), 0.75)  # (1 + 2 + 3) / (2 rows x 4)
    close(losses.aggregate(per_token, mask, "dapo", tokens=4.0), 1.5)  # the step's tokens per micro-batch, not these 3
    close(losses.aggregate(per_token, mask, "dapo"), 2.0)  # no normalizer given: this micro-batch's own tokens
    with pytest.raises(ValueError, match="needs max_len"):
        losses.aggregate(per_token, mask, "dr_grpo")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        losses.aggregate(per_token, mask, "token_mean")


def test_sequence_level_ratios_are_each_responses_mean_log_ratio():
    logp = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, 0.0, 0.0]])
    old = torch.tensor([[-1.2, -1.6, 0.0], [-0.7, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # the padded 5.0 must not count
    got = losses.importance_log_ratio(logp, old, mask, "sequence")
    close(got, torch.tensor([[(0.2 - 0.4) / 2], [0.2]]))
    assert losses.importance_log_ratio(logp, old, mask, "token").shape == (2, 3)


def test_cispo_clips_the_weight_but_keeps_every_tokens_gradient():
    # ratio e^1 ~ 2.72 > cap 2 with a positive advantage: PPO's clip zeroes the gradient, CISPO's does not
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-1.0]])
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    loss, stats = losses.policy_loss(logp, old, adv, mask, 0.2, agg="cispo", clip_eps_high=2.0)
    loss.backward()
    close(loss, -2.0 * 0.0)  # -w A log p with log p = 0
    close(logp.grad, torch.tensor([[-2.0]]))  # -w A: the capped weight, no gradient through it
    assert stats["clip_frac"] == 1.0
    logp.grad = None
    loss, _ = losses.policy_loss(logp, old, adv, mask, 0.2, clip_eps_high=0.28)
    loss.backward()
    close(logp.grad, torch.tensor([[0.0]]))  # the clipped surrogate: no gradient past 1 + 0.28


def test_clip_higher_lets_a_positive_advantage_ratio_grow_further():
    logp, old = torch.tensor([[0.25]]), torch.tensor([[0.0]])  # ratio e^0.25 ~ 1.284
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    symmetric, s1 = losses.policy_loss(logp, old, adv, mask, 0.2)
    higher, s2 = losses.policy_loss(logp, old, adv, mask, 0.2, clip_eps_high=0.3)
    close(symmetric, -1.2)
    close(higher, -torch.exp(torch.tensor(0.25)))  # inside [0.8, 1.3]: unclipped
    assert (s1["clip_frac"], s2["clip_frac"]) == (1.0, 0.0)


def test_the_kl_term_is_added_per_token_before_aggregating():
    logp, mask = torch.zeros(2, 2), torch.tensor([[1, 1], [1, 0]])
    kl = torch.tensor([[1.0, 2.0], [6.0, 100.0]])  # the padded 100 must not count
    loss, _ = losses.policy_loss(logp, logp.clone(), torch.zeros(2, 2), mask, 0.2, agg="grpo", kl=kl, kl_coef=0.5)
    close(loss, 0.5 * ((1 + 2) / 2 + 6) / 2)


def test_overlong_penalty_ramps_to_minus_one_at_the_limit():
    assert rl.overlong_penalty([10, 80, 90, 100, 120], max_len=100, cache=20) == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="overlong cache"):
        rl.overlong_penalty([1], max_len=10, cache=20)


def test_dynamic_keep_drops_groups_whose_scores_are_all_equal():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert rl.dynamic_keep(scores, 2).tolist() == [False, True, False, False]


def test_policy_loss_with_tis_weights():
    # ratio 1 (logp == old), advantage 1 -> per-token term -1; weights 0.5 and 2 -> mean of -0.5, -2 = -1.25
    logp = torch.tensor([[-1.0, -1.0]])
    loss, _ = losses.policy_loss(logp, logp.clone(), torch.ones(1, 2), torch.ones(1, 2), 0.2,
                             weights=torch.tensor([[0.5, 2.0]]))
    close(loss, -1.25)
