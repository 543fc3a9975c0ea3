"""On-policy distillation's per-token math (`stages/ppo/losses.py`'s `reverse_kl`, `stages/ppo/rl.py`'s sampled
estimate) against TRL's `GKDTrainer.generalized_jsd_loss` (trl 1.16.0, `trl.experimental.gkd`; beta 1 is the
reverse KL, KL(student || teacher)), on the same logits: the values per token and, through TRL's masked mean,
the loss and its gradient to 1e-6. And the sampled-token estimate the ppo stage pays as a per-token reward:
its mean over the student's own samples is -reverse KL."""

from __future__ import annotations

import os

_ENV = dict(os.environ)  # before any library import (tests/test_dpo_oracle.py says why)

import pytest  # noqa: E402
import torch  # noqa: E402
from trl.experimental.gkd import GKDTrainer  # noqa: E402

os.environ.clear()
os.environ.update(_ENV)

from stages.ppo import losses, rl  # noqa: E402

B, T, V = 3, 5, 11


def logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_reverse_kl_equals_trls_generalized_jsd_at_beta_1():
    student, teacher = logits(0).requires_grad_(), logits(1)
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    labels[0, 3:] = -100  # padding: masked out of TRL's mean, and of ours
    labels[2, 1:] = -100
    mask = labels != -100

    per_token_trl = GKDTrainer.generalized_jsd_loss(student, teacher, beta=1.0, reduction="none").sum(-1)
    ours = losses.reverse_kl(student, teacher)
    torch.testing.assert_close(ours, per_token_trl, atol=1e-6, rtol=1e-6)
    assert ours.min() > 0.05  # distinct distributions: a check that could fail

    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=1.0)  # batchmean over tokens
    mine = rl.masked_mean(losses.reverse_kl(student, teacher), mask)
    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
    (g_theirs,) = torch.autograd.grad(theirs, student)
    (g_mine,) = torch.autograd.grad(mine, student)
    torch.testing.assert_close(g_mine, g_theirs, atol=1e-6, rtol=1e-6)
    assert g_mine[0, 3:].abs().max() == 0 and g_mine[0, 0].abs().max() > 1e-4  # padding gets no gradient

    beta0 = GKDTrainer.generalized_jsd_loss(student, teacher, beta=0.0, reduction="none").sum(-1)
    assert not torch.allclose(beta0, per_token_trl, atol=1e-3)  # beta 0 (forward KL) differs: the direction matters


def test_the_sampled_estimate_averages_to_minus_the_reverse_kl():
    """Tokens drawn from the student: the mean of log p_t - log p_s over them approaches -KL(student || teacher)."""
    student, teacher = logits(3, 1.0), logits(4, 1.0)
    n = 20000
    probs = torch.softmax(student, -1).view(-1, V)
    draws = torch.multinomial(probs, n, replacement=True, generator=torch.Generator().manual_seed(5))  # (B*T, n)
    log_s = torch.log_softmax(student, -1).view(-1, V).gather(1, draws)
    log_t = torch.log_softmax(teacher, -1).view(-1, V).gather(1, draws)
    estimate = rl.distill_advantages(log_s, log_t, torch.ones_like(log_s)).mean(1).view(B, T)
    torch.testing.assert_close(estimate, -losses.reverse_kl(student, teacher), atol=0.05, rtol=0.0)


def test_distill_advantages_are_zero_on_padding_and_scaled():
    s, t = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-0.5, -2.5, 9.0]])
    got = rl.distill_advantages(s, t, torch.tensor([[1, 1, 0]]), weight=2.0)
    torch.testing.assert_close(got, torch.tensor([[1.0, -1.0, 0.0]]))


# --------------------------------------------------------------------------- the ppo stage's settings


def test_a_teacher_is_a_model_directory_and_rewards_the_policy_alone(tmp_path):
    from conftest import smoke_config
    from pipeline.errors import ConfigError

    teacher = tmp_path / "teacher"
    with pytest.raises(ConfigError, match="stages.ppo.distill.teacher: .*not a model directory"):
        smoke_config(tmp_path, f"stages.ppo.distill.teacher={teacher}")
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")
    (teacher / "model.safetensors").write_bytes(b"")  # the checkpoint check model.source gets (test_readers_trust)
    cfg = smoke_config(tmp_path, f"stages.ppo.distill.teacher={teacher}", "stages.ppo.algorithm=grpo",
                       "stages.ppo.rewards.rule_weight=0", "stages.ppo.rewards.model_weight=0")
    assert cfg.stages.ppo.distill.teacher == teacher and cfg.stages.ppo.distill.weight == 1.0
    without = cfg.stages.ppo.model_copy(update={"distill": None})
    assert cfg.stages.ppo.cpus_needed() == without.cpus_needed() + 1  # the teacher's rank is reserved too
    import stages.ppo as ppo

    assert teacher / "config.json" in ppo.raw_inputs(cfg)  # the teacher's files key the stage
    import stages.tune as tune

    swept = smoke_config(tmp_path, f"stages.ppo.distill.teacher={teacher}", "stages.ppo.algorithm=grpo",
                         'stages.tune={"target": "ppo", "metric": "distill_reverse_kl", "mode": "min", '
                         '"search_space": {"distill.weight": {"choice": [0.5, 1.0]}}}')
    assert teacher / "config.json" in tune.raw_inputs(swept)  # and a sweep over ppo
    assert tune.raw_inputs(cfg) == []
    with pytest.raises(ConfigError, match="distill: a teacher scores single-turn samples"):
        smoke_config(tmp_path, f"stages.ppo.distill.teacher={teacher}", "stages.ppo.environment.name=calculator")


def test_a_teacher_may_be_a_run_or_a_stage_artifact_and_resolves_to_its_checkpoint(tmp_path):
    """`distill.teacher` takes what `pipeline compare` takes (files only): a run directory's newest policy,
    DIR:STAGE, or a stage's artifact directory, each resolved to the checkpoint; a run without a finished
    policy, or a policy without its files, is refused naming what is missing."""
    from conftest import smoke_config
    from helpers.runs import fake_run
    from pipeline.errors import ConfigError

    run = fake_run(tmp_path / "teacher_run", {"sft": "2026-11-28T10:00", "ppo": "2026-11-28T11:00"}, ["a"])
    ppo, sft = run / "artifacts/ppo/ppokey/model", run / "artifacts/sft/sftkey/model"
    with pytest.raises(ConfigError, match=r"its policy .*ppokey/model has no config.json"):
        smoke_config(tmp_path, f"stages.ppo.distill.teacher={run}")  # the manifest, but not the model's files
    for model in (ppo, sft):
        (model / "config.json").write_text("{}")
        (model / "model.safetensors").write_bytes(b"")
    resolve = lambda given: smoke_config(tmp_path, f"stages.ppo.distill.teacher={given}").stages.ppo.distill.teacher  # noqa: E731
    assert resolve(run) == ppo  # the newest policy
    assert resolve(f"{run}:sft") == sft
    assert resolve(run / "artifacts/sft/sftkey") == sft
    assert resolve(sft) == sft
    with pytest.raises(ConfigError, match=r"nor a run's policy .*no finished dpo stage"):
        smoke_config(tmp_path, f"stages.ppo.distill.teacher={run}:dpo")


def test_the_teachers_reward_joins_each_tokens_advantage():
    from stages.ppo.config import PPOConfig

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    distill = rl.distill_advantages(torch.zeros(2, 3), torch.tensor([[-1.0, 0.5, 7.0], [0.0, -2.0, 1.0]]), mask)
    grpo = PPOConfig(algorithm="grpo", sampling={"n": 2})
    adv, _, _ = rl.advantages(grpo, torch.tensor([1.0, 0.0]), torch.zeros(2, 3), mask, 0.0, distill=distill)
    plain, _, _ = rl.advantages(grpo, torch.tensor([1.0, 0.0]), torch.zeros(2, 3), mask, 0.0)
    torch.testing.assert_close(adv - plain, torch.tensor([[-1.0, 0.5, 0.0], [0.0, -2.0, 1.0]]))
    rpp = PPOConfig(algorithm="reinforce_pp", sampling={"n": 2})
    with_teacher, _, _ = rl.advantages(rpp, torch.zeros(2), torch.zeros(2, 3), mask, 0.0, distill=distill)
    assert with_teacher.abs().sum() > 0  # zero scores, yet the teacher's per-token rewards give a signal


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    from helpers.tiny_llama import tiny_model_dir
    from pipeline.errors import UserError
    from stages.ppo.roles import check_teacher

    tiny_model_dir(tmp_path / "student")
    tiny_model_dir(tmp_path / "teacher")
    check_teacher(tmp_path / "teacher", tmp_path / "student")  # the same vocabulary: fine
    other = tiny_model_dir(tmp_path / "other")
    other.add_tokens(["<think>"])
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(UserError, match=r"distill.teacher: .*other has another tokenizer than the student"):
        check_teacher(tmp_path / "other", tmp_path / "student")
