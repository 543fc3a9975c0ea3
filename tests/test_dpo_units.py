"""The dpo stage's math and configuration, without Ray: each loss against values computed by hand, the
answer log-probs, KTO's mismatched sequences, the batches, the reference, and the config's refusals.
(TRL agrees on loss and gradients: tests/test_dpo_oracle.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import SMOKE
from pipeline.config import load_config
from pipeline.errors import ConfigError
from stages.dpo import (DPOConfig, Reference, averages, batch_loss, batch_metrics, collate, completions, logps,
                        mismatched, sequence_logps)
from stages.dpo.losses import kto_kl, kto_losses, pair_losses


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def nls(x: float) -> float:
    """-log sigmoid(x), by hand."""
    return math.log1p(math.exp(-x))


# --------------------------------------------------------------------------- the losses, by hand


def test_dpo_loss_is_minus_log_sigmoid_of_beta_times_the_margin_of_log_ratios():
    # chosen log-ratio -1 - (-2) = 1, rejected -3 - (-2) = -1: margin 2; beta 0.5 -> -log sigmoid(1)
    loss, rc, rr = pair_losses("dpo", 0.5, t(-1.0), t(-3.0), t(-2.0), t(-2.0), t(4), t(2))
    assert loss.item() == pytest.approx(nls(1.0), abs=1e-6) == pytest.approx(0.313262, abs=1e-6)
    assert (rc.item(), rr.item()) == (pytest.approx(0.5), pytest.approx(-0.5))  # beta x log-ratio


def test_label_smoothing_mixes_in_the_opposite_preference():
    loss, _, _ = pair_losses("dpo", 0.5, t(-1.0), t(-3.0), t(-2.0), t(-2.0), t(4), t(2), label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.9 * nls(1.0) + 0.1 * nls(-1.0), abs=1e-6)


def test_ipo_divides_each_log_ratio_by_its_answer_length_and_squares_the_gap_to_one_over_two_beta():
    # log-ratios 1 over 4 tokens and -1 over 2 tokens: 0.25 + 0.5 = 0.75; beta 0.5: (0.75 - 1)^2
    loss, _, _ = pair_losses("ipo", 0.5, t(-1.0), t(-3.0), t(-2.0), t(-2.0), t(4), t(2))
    assert loss.item() == pytest.approx(0.0625, abs=1e-6)


def test_simpo_uses_mean_token_log_probs_without_a_reference_and_a_target_margin():
    # mean log-probs -1/4 and -3/2: 1.25 - gamma/beta (0.5/2 = 0.25) = 1; beta 2 -> -log sigmoid(2)
    loss, rc, rr = pair_losses("simpo", 2.0, t(-1.0), t(-3.0), None, None, t(4), t(2), simpo_gamma=0.5)
    assert loss.item() == pytest.approx(nls(2.0), abs=1e-6)
    assert (rc.item(), rr.item()) == (pytest.approx(-0.5), pytest.approx(-3.0))  # beta x mean log-prob


def test_kto_scores_chosen_as_desirable_and_rejected_as_undesirable_around_the_kl():
    # log-ratios 1 and -1, KL 0.5, beta 2: desirable 1 - sigmoid(2 x 0.5), undesirable 1 - sigmoid(2 x 1.5)
    total, examples, _, _ = kto_losses(2.0, t(-1.0), t(-3.0), t(-2.0), t(-2.0), torch.tensor(0.5), 1.0, 3.0)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert examples.item() == 2  # a pair is two examples
    assert total.item() == pytest.approx(1 - sig(1.0) + 3.0 * (1 - sig(3.0)), abs=1e-6)
    # an unpaired undesirable row is one example: its absent chosen side adds nothing
    total, examples, _, _ = kto_losses(2.0, t(-1.0), t(-3.0), t(-2.0), t(-2.0), torch.tensor(0.5), 1.0, 3.0,
                                       has_chosen=t(0.0), has_rejected=t(1.0))
    assert examples.item() == 1 and total.item() == pytest.approx(3.0 * (1 - sig(3.0)), abs=1e-6)


def test_kto_kl_is_the_mean_mismatched_log_ratio_and_never_negative():
    assert kto_kl(t(-1.0, -2.0), t(-2.0, -2.0)).item() == pytest.approx(0.5)
    assert kto_kl(t(-3.0, -3.0), t(-2.0, -2.0)).item() == 0.0


def test_an_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown loss"):
        pair_losses("orpo", 0.1, t(0.0), t(0.0), t(0.0), t(0.0), t(1), t(1))


# --------------------------------------------------------------------------- log-probs and batches


def test_sequence_logps_sums_the_answer_tokens_log_probs_shifted_by_one():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = math.log(3.0)  # position 0 predicts token 1 (= 2): p = 3 / 6
    logits[0, 1, 1] = math.log(5.0)  # position 1 predicts token 2 (= 1): p = 5 / 8
    ids, mask = torch.tensor([[0, 2, 1]]), torch.tensor([[0, 1, 1]])
    total, n = sequence_logps(logits, ids, mask)
    assert total.item() == pytest.approx(math.log(0.5) + math.log(5 / 8), abs=1e-6) and n.item() == 2
    total, n = sequence_logps(logits, ids, torch.tensor([[0, 0, 1]]))  # the prompt's tokens never count
    assert total.item() == pytest.approx(math.log(5 / 8), abs=1e-6) and n.item() == 1


def test_kto_pairs_each_prompt_with_the_next_rows_answer():
    ids = [[1, 2, 10, 11, 0], [3, 20, 0]]
    masks = [[0, 0, 1, 1, 0], [0, 1, 0]]
    out_ids, out_masks = mismatched(ids, masks)
    assert out_ids == [[1, 2, 20, 0], [3, 10, 11, 0]]
    assert out_masks == [[0, 0, 1, 0], [0, 1, 1, 0]]


def test_kto_mismatches_take_an_unpaired_rows_one_answer():
    batch = {"chosen_input_ids": [[1, 10, 0], [2, 20, 0]], "chosen_loss_mask": [[0, 1, 1], [0, 0, 0]],
             "rejected_input_ids": [[1, 10, 0], [2, 20, 0]], "rejected_loss_mask": [[0, 0, 0], [0, 1, 1]]}
    assert completions(batch) == ([[1, 10, 0], [2, 20, 0]], [[0, 1, 1], [0, 1, 1]])
    assert mismatched(*completions(batch))[0] == [[1, 20, 0], [2, 10, 0]]
    b = collate(batch, pad_id=0, kto=True)
    assert b["has_chosen"].tolist() == [1.0, 0.0] and b["has_rejected"].tolist() == [0.0, 1.0]


def test_averages_take_the_loss_over_rows_and_the_rest_over_pairs():
    assert averages({"loss": 3.0, "rows": 3.0, "pairs": 2.0, "reward_accuracy": 1.0}) == {
        "loss": 1.0, "reward_accuracy": 0.5}
    assert averages({"loss": 3.0, "rows": 3.0, "pairs": 0.0, "reward_accuracy": 0.0}) == {"loss": 1.0}  # no pairs


PAIRS = {"chosen_input_ids": [[5, 6, 7], [5, 8, 9, 9]], "chosen_loss_mask": [[0, 1, 1], [0, 0, 1, 1]],
         "rejected_input_ids": [[5, 6, 8, 8], [5, 8]], "rejected_loss_mask": [[0, 1, 1, 1], [0, 1]]}


def test_collate_puts_chosen_then_rejected_then_kto_mismatches_right_padded():
    b = collate(PAIRS, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [5, 8, 9, 9], [5, 6, 8, 8], [5, 8, 0, 0]]
    assert b["mask"].tolist() == [[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 1], [0, 1, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    k = collate(PAIRS, pad_id=0, kto=True)
    assert k["input_ids"].shape[0] == 6 and k["input_ids"][4].tolist() == [5, 9, 9, 0]


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()


def test_padding_does_not_change_a_sequences_log_prob(tiny):
    alone = logps(tiny, collate({k: v[:1] for k, v in PAIRS.items()}, pad_id=0))[0][0]
    padded = logps(tiny, collate(PAIRS, pad_id=0))[0][0]  # the same chosen answer, padded to the longest
    assert padded.item() == pytest.approx(alone.item(), abs=1e-5)


def test_a_policy_equal_to_its_reference_has_the_loss_of_a_coin_and_learns_from_it(tiny):
    cfg = DPOConfig(beta=0.1)
    b = collate(PAIRS, pad_id=0)
    policy, lengths = logps(tiny, b)
    loss, parts = batch_loss(cfg, policy, lengths, policy.detach(), b)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)  # every log-ratio 0
    m = batch_metrics(parts)
    assert m["pairs"] == 2 and m["reward_accuracy"] == 1.0 and m["reward_margin"] == 0  # two ties: chance
    loss.backward()  # yet the gradient pushes chosen up and rejected down
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny.parameters())
    tiny.zero_grad()


def test_precomputed_reference_equals_the_start_models_forward_and_survives_a_checkpoint(tiny):
    batches = [collate(PAIRS, pad_id=0)]
    ref = Reference("precomputed", tiny, init="unused")
    ref.precompute({"train": batches}, say=lambda _m: None)
    expected = logps(tiny, batches[0])[0]
    assert torch.allclose(ref(batches[0], "train", 0), expected)
    again = Reference("precomputed", tiny, init="unused")
    again.load(ref.state())  # what a resumed rank reads from the trainer state (JSON)
    assert torch.allclose(again(batches[0], "train", 0), expected)
    assert Reference(None, tiny, init="unused")(batches[0], "train", 0) is None  # simpo


# --------------------------------------------------------------------------- configuration


def test_reference_auto_is_adapter_off_with_lora_and_precomputed_without():
    assert DPOConfig().reference_kind() == "precomputed"
    assert DPOConfig(lora={"r": 4}).reference_kind() == "adapter_off"
    assert DPOConfig(loss="simpo", reference="frozen_copy").reference_kind() is None


@pytest.mark.parametrize("fields, message", [
    ({"reference": "adapter_off"}, "adapter_off needs a LoRA adapter"),
    ({"loss": "ipo", "label_smoothing": 0.1}, "label_smoothing applies to dpo and simpo"),
    ({"loss": "orpo"}, "loss"),
    ({"beta": 0}, "beta"),
])
def test_a_config_that_cannot_work_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        DPOConfig(**fields)


DPO = 'stages.dpo={"max_steps": 2, "batch_size": 4, "micro_batch_size": 2}'


def test_serve_takes_the_dpo_model_when_no_ppo_follows():
    cfg = load_config(SMOKE, ["stages.ppo=null", DPO])
    assert cfg.stages.serve.source == "dpo_model"
    assert load_config(SMOKE, [DPO]).stages.serve.source == "policy_model"  # ppo still the last model trained


def test_the_dpo_graph_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="stages.dpo.init_from is sft but stages.sft is null"):
        load_config(SMOKE, ["stages.sft=null", "stages.reward=null", "stages.ppo.rewards.model_weight=0", DPO])
    with pytest.raises(ConfigError, match="stages.serve.source is dpo_model but stages.dpo is null"):
        load_config(SMOKE, ["stages.serve.source=dpo_model"])
    cfg = load_config(SMOKE, ["stages.sft=null", "stages.reward=null", "stages.ppo=null",
                              DPO[:-1] + ', "init_from": "base"}'])
    from pipeline.registry import stages_for

    dpo = next(s for s in stages_for(cfg) if s.name == "dpo")
    assert "sft_model" not in dpo.inputs and "base_model" in dpo.inputs


def test_tune_sweeps_dpo_on_what_it_reports():
    sweep = ('stages.tune={"target": "dpo", "metric": "eval_reward_accuracy", "mode": "max", '
             '"search_space": {"beta": {"choice": [0.1, 0.5]}}}')
    cfg = load_config(SMOKE, ["stages.ppo=null", DPO, sweep])
    assert cfg.stages.tune.target == "dpo"
    from pipeline.registry import stages_for

    assert next(s for s in stages_for(cfg) if s.name == "tune").code == ("stages.dpo",)
    with pytest.raises(ConfigError, match="dpo does not report 'eval_accuracy_gold'"):
        load_config(SMOKE, ["stages.ppo=null", DPO, sweep.replace("eval_reward_accuracy", "eval_accuracy_gold")])
    with pytest.raises(ConfigError, match="beta"):  # every listed value must be valid for the target
        load_config(SMOKE, ["stages.ppo=null", DPO, sweep.replace("0.5", "-1")])


def test_sft_weight_adds_the_chosen_answers_mean_token_nll():
    from stages.dpo.losses import chosen_nll

    # chosen log-probs -2 over 4 tokens and -4 over 4 tokens: NLL 6 / 8; an unpaired undesirable row left out
    assert chosen_nll(t(-2.0, -4.0, -9.0), t(4, 4, 3), t(1, 1, 0)).item() == pytest.approx(0.75)
    b = collate(PAIRS, pad_id=0)
    policy = t(-1.0, -2.0, -3.0, -3.0)
    lengths = t(2, 2, 3, 1)
    plain, _ = batch_loss(DPOConfig(), policy, lengths, policy, b)
    mixed, _ = batch_loss(DPOConfig(sft_weight=0.5), policy, lengths, policy, b)
    assert mixed.item() == pytest.approx(plain.item() + 0.5 * 3.0 / 4, abs=1e-6)
