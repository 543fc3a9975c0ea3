"""The dpo stage's loss math against TRL's trainers (trl 1.16.0, the `bench` extra): on the same tiny model,
batch and settings, our loss and its gradient equal TRL's to 1e-5 in fp32.

`stages/dpo/losses.py` writes its losses as TRL writes them so that a user's beta (and SimPO's gamma) means what
it means there; the unit tests (tests/test_dpo_units.py) check the formulas against numbers worked by hand, this
module checks them against the library itself, through its own tokenization, collation and loss:
- dpo: `DPOTrainer` with `loss_type=["sigmoid"]` (a list in 1.16; a string is wrapped into one);
- ipo: `DPOTrainer` with `loss_type=["ipo"]` (its log-ratios divided by the answers' token counts);
- simpo: `trl.experimental.cpo.CPOTrainer` with `loss_type="simpo"`, `cpo_alpha=0` (pure SimPO, no NLL term)
  and its `simpo_gamma` (mean token log-probs, no reference).
Non-default beta and gamma, answers of different lengths (so padding and the length normalisation count), and
a policy perturbed away from its reference after TRL made its reference (DPOTrainer loads a second copy of the
model from the policy's path: the start model, as our frozen copy is), so the log-ratios are not 0 and a
wrong beta, sign or normalisation changes the numbers. The token ids are TRL's own: our `collate` is fed the
rows of TRL's collated batch and must rebuild that batch exactly. Gradients compared: every parameter's
(the embedding matrix and the first layer's q_proj among them) after TRL's loss.backward() and after ours,
on the same policy object. No network, no Ray: a character-level tokenizer and a random LlamaForCausalLM
saved to a temporary directory.
"""

from __future__ import annotations

import copy
import math
import os

_ENV = dict(os.environ)  # before any library import (see below)

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402

# Importing TRL sets VLLM_LOGGING_LEVEL=ERROR (trl/_compat.py) and vLLM's KMP_* and inductor variables in
# os.environ. Collection imports this module before any test runs, so every subprocess the suite starts
# afterwards (the command-line smoke run among them) would inherit them and lose vLLM's log lines.
os.environ.clear()
os.environ.update(_ENV)

from helpers.tiny_llama import load, loss_and_grads, perturb, tiny_model_dir
from stages.dpo import collate, logps
from stages.dpo.losses import pair_losses

PAIRS = {  # answers of different lengths, chosen longer in some pairs and shorter in others
    "prompt": ["what is two plus two?", "name a color.", "say hi", "count to three"],
    "chosen": [" four", " blue is a nice color", " hi", " one two three"],
    "rejected": [" five or six", " no", " hello there friend", " one"],
}
BETA = {"dpo": 0.3, "ipo": 0.5, "simpo": 0.3}
SIMPO_GAMMA = 0.7


def common_args(tmp_path) -> dict:
    return {"output_dir": str(tmp_path / "out"), "report_to": "none", "use_cpu": True, "bf16": False,
            "fp16": False, "per_device_train_batch_size": len(PAIRS["prompt"]), "seed": 0, "disable_tqdm": True}


def ours(pairs: dict, pad_id: int, policy, ref, loss: str):
    """Our batch loss on `pairs` (collate's input), and the collated batch."""
    batch = collate(pairs, pad_id)
    chosen_and_rejected, lengths = logps(policy, batch)
    n = len(pairs["chosen_input_ids"])
    ref_c = ref_r = None
    if ref is not None:
        with torch.no_grad():
            ref_logps, _ = logps(ref, batch)
        ref_c, ref_r = ref_logps[:n], ref_logps[n:]
    per_pair, _, _ = pair_losses(loss, BETA[loss], chosen_and_rejected[:n], chosen_and_rejected[n:], ref_c, ref_r,
                                 lengths[:n], lengths[n:], simpo_gamma=SIMPO_GAMMA)
    return per_pair.mean(), batch


def assert_same(theirs, mine, trivial: float):
    (trl_loss, trl_grads), (our_loss, our_grads) = theirs, mine
    assert abs(trl_loss.item() - trivial) > 1e-2, "the policy equals its reference: the check would be trivial"
    torch.testing.assert_close(our_loss, trl_loss, atol=1e-5, rtol=1e-5)
    assert trl_grads.keys() == our_grads.keys()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert trl_grads[name].abs().max() > 1e-4, name  # a gradient that is there to compare
    for name, grad in trl_grads.items():
        torch.testing.assert_close(our_grads[name], grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("loss, trl_loss_type", [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_equal_trl_dpo_trainer(tmp_path, loss, trl_loss_type):
    tokenizer = tiny_model_dir(tmp_path / "model")
    policy = load(tmp_path / "model")
    ref = copy.deepcopy(policy).eval()  # our frozen copy of the start model
    args = DPOConfig(beta=BETA[loss], loss_type=[trl_loss_type], **common_args(tmp_path))
    trainer = DPOTrainer(model=policy, args=args, train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    assert trainer.model is policy and trainer.loss_types == [trl_loss_type] and trainer.beta == BETA[loss]
    theirs_ref, ours_ref = trainer.ref_model.state_dict(), ref.state_dict()
    assert theirs_ref.keys() == ours_ref.keys()
    for name, weights in theirs_ref.items():
        assert torch.equal(weights, ours_ref[name]), f"TRL's reference differs from the start model at {name}"
    perturb(policy)

    inputs = next(iter(trainer.get_train_dataloader()))
    n = len(PAIRS["prompt"])
    # TRL's tokenization is the plain one: the prompt's ids, then the answer's and EOS
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    expected = {(tuple(enc(p) + enc(c) + [tokenizer.eos_token_id]), tuple(enc(p) + enc(r) + [tokenizer.eos_token_id]))
                for p, c, r in zip(PAIRS["prompt"], PAIRS["chosen"], PAIRS["rejected"])}
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    masks = [m[a.bool()].tolist() for m, a in zip(inputs["completion_mask"], inputs["attention_mask"])]
    assert {(tuple(rows[i]), tuple(rows[n + i])) for i in range(n)} == expected
    pairs = {"chosen_input_ids": rows[:n], "chosen_loss_mask": masks[:n],
             "rejected_input_ids": rows[n:], "rejected_loss_mask": masks[n:]}

    policy.train()  # as in training (the models have no dropout; TRL disables it anyway)
    theirs = loss_and_grads(policy, lambda: trainer.compute_loss(policy, inputs))
    mine = loss_and_grads(policy, lambda: ours(pairs, tokenizer.pad_token_id, policy, ref, loss)[0])
    ours_batch = collate(pairs, tokenizer.pad_token_id)  # rebuilds TRL's batch exactly
    assert torch.equal(ours_batch["input_ids"], inputs["input_ids"])
    assert torch.equal(ours_batch["attention_mask"], inputs["attention_mask"])
    assert torch.equal(ours_batch["mask"], inputs["completion_mask"])
    trivial = math.log(2) if loss == "dpo" else (1 / (2 * BETA[loss])) ** 2  # the loss at policy == reference
    assert_same(theirs, mine, trivial)


def test_simpo_equals_trl_cpo_trainer(tmp_path):
    tokenizer = tiny_model_dir(tmp_path / "model")
    policy = load(tmp_path / "model")
    perturb(policy)  # reference-free; perturbed only so the weights are not the initialisation
    args = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=BETA["simpo"], simpo_gamma=SIMPO_GAMMA, max_length=128,
                     **common_args(tmp_path))
    trainer = CPOTrainer(model=policy, args=args, train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    assert trainer.model is policy and (trainer.loss_type, trainer.cpo_alpha, trainer.alpha) == ("simpo", 0.0, 0.0)
    assert (trainer.beta, trainer.simpo_gamma) == (BETA["simpo"], SIMPO_GAMMA)

    inputs = next(iter(trainer.get_train_dataloader()))
    pairs = {}
    for side in ("chosen", "rejected"):
        keep = [a.bool() for a in inputs[f"{side}_attention_mask"]]
        pairs[f"{side}_input_ids"] = [ids[k].tolist() for ids, k in zip(inputs[f"{side}_input_ids"], keep)]
        pairs[f"{side}_loss_mask"] = [(labels[k] != -100).long().tolist()
                                      for labels, k in zip(inputs[f"{side}_labels"], keep)]
    assert all(ids[-1] == tokenizer.eos_token_id for ids in pairs["chosen_input_ids"] + pairs["rejected_input_ids"])
    lengths = [sum(m) for m in pairs["chosen_loss_mask"] + pairs["rejected_loss_mask"]]
    assert len(set(lengths)) > 2  # the length normalisation matters

    policy.train()
    theirs = loss_and_grads(policy, lambda: trainer.compute_loss(policy, inputs))
    mine = loss_and_grads(policy, lambda: ours(pairs, tokenizer.pad_token_id, policy, None, "simpo")[0])
    concatenated = trainer.concatenated_inputs(inputs, padding_value=trainer.pad_token_id)
    ours_batch = collate(pairs, tokenizer.pad_token_id)  # rebuilds TRL's concatenated batch exactly
    assert torch.equal(ours_batch["input_ids"], concatenated["concatenated_input_ids"])
    assert torch.equal(ours_batch["attention_mask"], concatenated["concatenated_attention_mask"])
    assert torch.equal(ours_batch["mask"].bool(), concatenated["concatenated_labels"] != -100)
    assert_same(theirs, mine, math.log(2))  # log 2: the loss of a policy indifferent between its answers
