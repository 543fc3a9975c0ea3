"""The ppo stage's policy objectives against TRL's `GRPOTrainer` (trl 1.16.0, the `bench` extra): on the same tiny
model and the same rollouts, our loss and its gradient equal TRL's `_compute_loss` to 1e-5 in fp32.

`stages/ppo/rl.py` writes `loss_type`, `clip_eps_high` (TRL's epsilon_high) and `importance_sampling` (TRL's
importance_sampling_level) as TRL does, so that a setting copied from a TRL recipe means the same here; the unit
tests (tests/test_rl_math.py) check the formulas against numbers worked by hand, this module checks them against
the library, through TRL's own forward pass and loss:
- every `loss_type` we offer (grpo, bnpo, dr_grpo, dapo, cispo), with and without clip-higher;
- GSPO: `importance_sampling: sequence` with the GSPO paper's loss_type grpo;
- the KL term (`beta`, k3 per token, added before aggregating), plain and times the importance ratio
  (`kl.importance_weighted`, TRL's use_bias_correction_kl).
The rollouts: four responses of different lengths (padding and each normalisation count), advantages of both
signs, and old and reference log-probs moved away from the policy's by noise of +-0.4 per token, so ratios fall
on both sides of every clip range and a wrong clip, sign or normaliser changes the numbers. Our side runs the
ppo worker's own forward pass (`PPOWorker._logprobs`) on the batch `rl.make_batch` builds. Also DAPO's overlong
penalty against `trl.rewards.get_soft_overlong_punishment`. No network, no Ray.
"""

from __future__ import annotations

import os
import types

_ENV = dict(os.environ)  # before any library import (tests/test_dpo_oracle.py says why)

import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.rewards import get_soft_overlong_punishment  # noqa: E402

os.environ.clear()
os.environ.update(_ENV)

from helpers.tiny_llama import load, loss_and_grads, perturb, tiny_model_dir  # noqa: E402
from stages.ppo import losses, rl  # noqa: E402
from stages.ppo.worker import PPOWorker  # noqa: E402

PROMPTS = ["abc", "xyz", "abc", "xyz"]  # one length: no left padding, so both sides use positions 0, 1, ...
RESPONSES = ["hello there", "hi", "a longer answer", "nope"]
ADVANTAGES = [1.0, -0.5, 0.7, -1.2]
MAX_LEN = 20  # dr_grpo's constant (max_completion_length)
NOISE = 0.4

CASES = {  # id: (loss_type, epsilon, epsilon_high, importance level, beta, KL times the ratio)
    "grpo": ("grpo", 0.2, None, "token", 0.0, False),
    "bnpo+kl": ("bnpo", 0.2, None, "token", 0.04, False),
    "dr_grpo+weighted kl": ("dr_grpo", 0.2, None, "token", 0.04, True),
    "dapo (clip-higher)+kl": ("dapo", 0.2, 0.28, "token", 0.04, False),
    "cispo+weighted kl": ("cispo", 0.2, 1.2, "token", 0.04, True),  # cap 1.2 (5.0 is usual): some capped
    "gspo+weighted kl": ("grpo", 0.05, 0.08, "sequence", 0.04, True),
}


def rollouts(tokenizer):
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [enc(p) for p in PROMPTS], [enc(r) + [tokenizer.eos_token_id] for r in RESPONSES]


def noisy(logp: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (logp + (torch.rand(logp.shape, generator=generator) * 2 - 1) * NOISE).detach()


def our_logprobs(batch: dict, model) -> torch.Tensor:
    worker = types.SimpleNamespace(engine=None)
    worker._forward = lambda b, m=None: PPOWorker._forward(worker, b, m)
    return PPOWorker._logprobs(worker, batch, model=model)


@pytest.mark.parametrize("case", list(CASES))
def test_our_objective_equals_trl_grpo_trainers_loss(tmp_path, case):
    loss_type, eps, eps_high, level, beta, weighted = CASES[case]
    tokenizer = tiny_model_dir(tmp_path / "model")
    policy = load(tmp_path / "model")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False, fp16=False,
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=MAX_LEN,
                      temperature=1.0, loss_type=loss_type, epsilon=eps, epsilon_high=eps_high,
                      importance_sampling_level=level, beta=beta, use_bias_correction_kl=weighted, seed=0,
                      disable_tqdm=True)
    trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)
    assert trainer.model is policy and (trainer.loss_type, trainer.importance_sampling_level) == (loss_type, level)
    assert not trainer.use_vllm and trainer.temperature == 1.0
    perturb(policy)
    policy.eval()  # eval mode: TRL then divides by no gradient-accumulation count (the models have no dropout)

    prompts, responses = rollouts(tokenizer)
    batch = rl.make_batch(prompts, responses, tokenizer.pad_token_id)
    mask = batch["response_mask"]
    assert len({int(n) for n in mask.sum(1)}) == 4  # four response lengths
    with torch.no_grad():
        current = our_logprobs(batch, policy)
    old, ref = noisy(current, 1) * mask, noisy(current, 2) * mask
    width = batch["prompt_width"]
    inputs = {"prompt_ids": batch["input_ids"][:, :width], "prompt_mask": batch["attention_mask"][:, :width],
              "completion_ids": batch["response_ids"], "completion_mask": mask.long(),
              "advantages": torch.tensor(ADVANTAGES), "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}

    def mine():
        logp = our_logprobs(batch, policy)
        kl = rl.kl_penalty(logp, ref, "k3") if beta else None
        advantages = torch.tensor(ADVANTAGES)[:, None] * mask
        # the ppo stage's own settings -> policy_loss's keywords (PPOConfig.objective)
        loss, stats = losses.policy_loss(logp, old, advantages, mask, eps, agg=loss_type, max_len=MAX_LEN,
                                     clip_eps_high=eps_high, level=level, kl=kl, kl_coef=beta,
                                     kl_weighted=weighted)
        assert 0 < stats["clip_frac"] < 1, "no token (or every token) clipped: the clip range is not checked"
        return loss

    theirs = loss_and_grads(policy, lambda: trainer._compute_loss(policy, inputs))
    ours = loss_and_grads(policy, mine)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert theirs[1][name].abs().max() > 1e-4, name  # a gradient that is there to compare
    for name, grad in theirs[1].items():
        torch.testing.assert_close(ours[1][name], grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_a_config_means_what_it_means_in_trl():
    """PPOConfig's defaults resolve as TRL's do: epsilon_high = epsilon, and CISPO's cap 5.0 when unset."""
    from stages.ppo.config import PPOConfig

    grpo = PPOConfig(algorithm="grpo", sampling={"n": 4}).objective()
    assert grpo == {"agg": "bnpo", "clip_eps": 0.2, "clip_eps_high": 0.2, "level": "token", "kl_weighted": False}
    assert PPOConfig(algorithm="dr_grpo", sampling={"n": 4}).objective()["agg"] == "dr_grpo"
    cispo = PPOConfig(algorithm="grpo", sampling={"n": 4}, loss_type="cispo").objective()
    assert cispo["clip_eps_high"] == 5.0
    gspo = PPOConfig(algorithm="grpo", sampling={"n": 4}, loss_type="grpo", importance_sampling="sequence",
                     clip_eps=3e-4, clip_eps_high=4e-4).objective()
    assert gspo == {"agg": "grpo", "clip_eps": 3e-4, "clip_eps_high": 4e-4, "level": "sequence",
                    "kl_weighted": False}


def test_the_overlong_penalty_equals_trls():
    lengths = list(range(0, 130, 3))
    trl = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=30)
    assert rl.overlong_penalty(lengths, max_len=100, cache=30) == pytest.approx(trl([[0] * n for n in lengths]))
