"""PPO stage without Ray: config validation, batch layout, the sign test, rule rewards."""

from __future__ import annotations

import pytest

from conftest import smoke_config
from pipeline.errors import ConfigError, UserError


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["stages.ppo.algorithm=grpo", "stages.ppo.sampling.n=1"],
         "sampling.n: grpo compares samples of the same prompt and needs n >= 2"),
        (["stages.ppo.prompts_per_iteration=5", "stages.ppo.sampling.n=3", "stages.ppo.mini_batch_size=4"],
         "mini_batch_size (4) must divide prompts_per_iteration x sampling.n (5 x 3 = 15)"),
        (["stages.ppo.policy.num_ranks=3"], "must be a multiple of micro_batch_size x policy.num_ranks"),
        (["stages.ppo.rollout.num_engines=12", "ray.num_cpus=8"],
         "stages.ppo.rollout.num_engines: the roles and 12 engines need"),
        (["stages.ppo.reward.cpus_per_rank=5", "stages.ppo.rewards.model_weight=0.5", "ray.num_cpus=8"],
         "need 11 logical CPUs but the local Ray has 8"),
        (["stages.ppo.kl.estimator=k4"], "stages.ppo.kl.estimator: input should be 'k1', 'k2' or 'k3'"),
        (["stages.ppo.rewards.rule=nonsense"],
         "stages.ppo.rewards.rule: must be 'verifier', 'code_tests' or 'module:function'"),
        (["stages.ppo.rewards.rule_weight=0", "stages.ppo.rewards.model_weight=0"], "nothing would reward the policy"),
        (["stages.ppo.policy.deepspeed.zero_stage=4"],
         "stages.ppo.policy.deepspeed.zero_stage: input should be 0, 1, 2 or 3"),
        (["stages.ppo.reference.colocate=true", "stages.ppo.reference.deepspeed.zero_stage=3"],
         "stages.ppo.reference: colocate: a colocated reference is a plain copy in each policy rank"),
        (["stages.ppo.rollout.asynchronous=true"], "stages.ppo.rollout.asynchronous"),
        (["stages.ppo.algorithm=ppo", "stages.ppo.dynamic_sampling.enabled=true"],
         "dynamic_sampling: ppo has no group baseline"),
        (["stages.ppo.overlong.cache=100000"], "overlong.cache (100000) exceeds the response limit"),
        (["stages.ppo.loss_type=gspo"], "stages.ppo.loss_type: input should be 'grpo', 'bnpo', 'dr_grpo', 'dapo' or "
                                        "'cispo'"),
        (["stages.ppo.importance_sampling=response"], "stages.ppo.importance_sampling: input should be 'token' or "
                                                      "'sequence'"),
    ],
)
def test_bad_ppo_settings_name_the_key(tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as exc:
        smoke_config(tmp_path, *overrides)
    assert expected in str(exc.value)


def test_async_rollouts_and_a_colocated_reference_change_what_the_stage_reserves(tmp_path):
    base = smoke_config(tmp_path).stages.ppo
    cfg = smoke_config(tmp_path, "stages.ppo.rollout.async=true", "stages.ppo.reference.colocate=true").stages.ppo
    assert (base.rollout.max_staleness(), cfg.rollout.max_staleness()) == (0, 1)  # `async` is the YAML key
    assert base.cpus_needed() - cfg.cpus_needed() == base.reference.num_ranks * base.reference.cpus_per_rank


def test_engines_are_not_checked_against_a_local_count_when_joining_a_cluster(tmp_path):
    cfg = smoke_config(tmp_path, "stages.ppo.rollout.num_engines=12", "ray.num_cpus=8", "ray.address=auto")
    assert cfg.stages.ppo.rollout.num_engines == 12  # checked against the cluster's resources at run time


def test_a_role_is_placed_with_its_cpus_per_rank(tmp_path, monkeypatch):
    import stages.ppo.groups as groups
    from stages.ppo.layouts.separate import start_role

    placed = {}

    class Recorder:
        def __init__(self, name, actor_cls, num_ranks, cpus_per_rank, gpu, *args, **kwargs):
            placed[name] = (num_ranks, cpus_per_rank)

        def run(self, *args, **kwargs):
            return []

    monkeypatch.setattr(groups, "ModelGroup", Recorder)
    cfg = smoke_config(tmp_path, "stages.ppo.reward.cpus_per_rank=2").stages.ppo
    start_role("reward", cfg.reward, "reward", tmp_path, cfg, False, False, 0, 0, None)
    start_role("policy", cfg.policy, "causal", tmp_path, cfg, True, False, 0, 0, None)
    assert placed == {"reward": (1, 2), "policy": (cfg.policy.num_ranks, 1)}


def test_make_batch_aligns_every_response_at_one_column():
    from stages.ppo.rl import make_batch

    b = make_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0)
    assert b["prompt_width"] == 3
    assert b["input_ids"].tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b["response_ids"].tolist() == [[1, 2, 0], [3, 4, 9]]
    assert b["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_sign_test_p():
    from stages.ppo.scoring import sign_test_p

    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 5) == 1.0
    # 10 improved, 0 worsened: 2 * 0.5**10
    assert sign_test_p(10, 0) == pytest.approx(2 / 1024)
    # 8 vs 2: 2 * (1 + 10 + 45) / 1024
    assert sign_test_p(2, 8) == pytest.approx(2 * 56 / 1024)



def test_compare_pairs_prompts_before_and_after():
    from stages.ppo.scoring import compare

    before = {"accuracy": [0, 0, 1, 1, 0], "reward": [0.5, 0.2, 1.0, 0.9, 0.1]}
    after = {"accuracy": [1, 1, 1, 0, 1], "reward": [0.7, 0.2, 1.0, 1.2, 0.3]}
    m = compare(before, after)
    assert (m["eval_accuracy_before"], m["eval_accuracy"]) == (pytest.approx(0.4), pytest.approx(0.8))
    assert (m["eval_accuracy_improved"], m["eval_accuracy_worsened"]) == (3, 1)  # ties (prompt 3) do not count
    assert m["eval_accuracy_sign_test_p"] == pytest.approx(2 * 5 / 16)  # P(<=1 of 4) = 5/16, two-sided
    assert (m["eval_reward_improved"], m["eval_reward_worsened"]) == (3, 0)

def test_rule_rewards():
    from stages.ppo.scoring import rule_reward

    verifier = rule_reward("verifier")
    assert verifier("What is 2 + 3?", "2 + 3 = 5", "5") == 1.0
    assert verifier("What is 2 + 3?", "2 + 3 = 6", "5") == 0.0
    assert rule_reward("helpers.toy_rewards:digits")("", "7a77", "") == 0.75
    with pytest.raises(UserError, match="stages.ppo.rewards.rule: cannot load 'no_such_module:f'"):
        rule_reward("no_such_module:f")


def test_shard_batch_keeps_every_row_in_order():
    import torch

    from stages.ppo.groups import shard
    from stages.ppo.worker import shard_batch

    assert shard(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    batch = {"input_ids": torch.arange(7)[:, None], "prompt_width": 1}
    parts = shard_batch(batch, 3)
    assert [p["input_ids"].flatten().tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert all(p["prompt_width"] == 1 for p in parts)


def test_advantages_dispatch_per_algorithm():
    import torch

    from stages.ppo import PPOConfig
    from stages.ppo.rl import advantages

    scores, mask = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    kl = torch.zeros(4, 2)

    def run(alg):
        cfg = PPOConfig(algorithm=alg, sampling={"n": 2}, prompts_per_iteration=2, mini_batch_size=4,
                        micro_batch_size=2,
                        policy={"num_ranks": 1})
        return advantages(cfg, scores, kl, mask, 0.1, values=torch.zeros(4, 2))

    adv, returns, kl_loss = run("rloo")  # groups [1, 0] and [0, 0]: leave-one-out -> 1, -1, 0, 0 on every real token
    assert torch.equal(adv, torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    assert returns is None and kl_loss == 0.1  # the group estimators pay the KL in the loss
    adv, _, _ = run("dr_grpo")  # minus the group mean 0.5 -> 0.5, -0.5
    assert torch.equal(adv[:2], torch.tensor([[0.5, 0.5], [-0.5, 0.0]]))
    adv, returns, kl_loss = run("reinforce_pp")  # KL in the reward: nothing in the loss
    assert returns is None and kl_loss == 0.0 and adv[0, 0] > 0 > adv[1, 0]
    adv, returns, kl_loss = run("ppo")
    # lambda-returns of the score with V = 0 and the default lam 0.95: 0.95 x 1, then 1
    assert kl_loss == 0.0 and torch.allclose(returns[0], torch.tensor([0.95, 1.0]))


def test_slope_and_pad_rows():
    from stages.ppo.rl import pad_rows
    from stages.ppo.scoring import slope

    assert slope([0.0, 1.0, 2.0]) == 1.0 and slope([0.5, 0.5, 0.5]) == 0.0 and slope([1.0]) == 0.0
    assert slope([0.2, 0.1, 0.4, 0.3]) == pytest.approx(0.06)  # least squares: sum((i-1.5)(y-0.25)) / 5
    assert pad_rows([[1.0], [2.0, 3.0]], 3).tolist() == [[1.0, 0.0, 0.0], [2.0, 3.0, 0.0]]


def test_dynamic_sampling_replaces_groups_without_a_signal_and_keeps_the_batch_size(monkeypatch):
    """`rollouts.fill`: groups whose samples all scored the same are replaced by refill rounds' kept groups, up to
    max_refills; still short, the batch is topped up with dropped groups; the scores travel with their rows."""
    import types

    from stages.ppo import rollouts, scoring
    from stages.ppo.config import PPOConfig

    n = 2
    rounds = {0: [1, 1, 0, 1, 0, 0, 1, 0], 1: [0, 0, 1, 0, 0.5, 0.5, 0, 0.25], 2: [3, 3, 3, 3, 3, 3, 3, 3]}

    def request(refill):  # 4 prompts named by their round, 2 samples each
        rows = [{"prompt": f"r{refill}p{g}"} for g in range(4) for _ in range(n)]
        generated = [[{"ids": [refill, g, i]} for i in range(n)] for g in range(4)]
        return rollouts.Rollouts(0, rows, {}, [], generated=generated)

    def rewards(texts, rows, flat, *_args, **_kw):
        refill = flat[0]["ids"][0]
        return list(map(float, rounds[refill])), [0.0] * len(flat), [], []

    monkeypatch.setattr(scoring, "training_rewards", rewards)
    monkeypatch.setattr(scoring, "answers_of", lambda tok, flat: ["" for _ in flat])
    monkeypatch.setattr(rollouts, "request", lambda s, cfg, seed, it, fault, refill=0: request(refill))
    monkeypatch.setattr(rollouts, "collect", lambda s, req, n, console: req)
    session = types.SimpleNamespace(tok=None, rule=None, moments=None, role=lambda name: None)

    def fill(max_refills):
        cfg = PPOConfig(algorithm="grpo", prompts_per_iteration=4, mini_batch_size=8, micro_batch_size=4,
                        sampling={"n": n}, dynamic_sampling={"enabled": True, "max_refills": max_refills})
        return rollouts.fill(session, cfg, 0, request(0), print)

    req = fill(max_refills=2)  # round 0 keeps p1 and p3; round 1 (the first refill) p1 and p3: full
    assert [r["prompt"] for r in req.rows[::n]] == ["r0p1", "r0p3", "r1p1", "r1p3"]
    assert req.scored[0] == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.25]  # each group's own scores
    assert [x["ids"][:2] for g in req.generated for x in g] == [[0, 1], [0, 1], [0, 3], [0, 3], [1, 1], [1, 1],
                                                                [1, 3], [1, 3]]
    assert req.dynamic == {"dynamic_kept_share": 0.5, "dynamic_refills": 1.0}

    rounds[1] = [0, 0, 1, 1, 0, 0, 1, 1]  # round 1 keeps nothing: topped up with round 0's dropped groups
    req = fill(max_refills=1)
    assert [r["prompt"] for r in req.rows[::n]] == ["r0p1", "r0p3", "r0p0", "r0p2"]
    assert req.scored[0] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0] and len(req.rows) == 8
    assert req.dynamic == {"dynamic_kept_share": 0.5, "dynamic_refills": 1.0}
    req = fill(max_refills=2)  # the second refill keeps nothing either: the bound holds, same top-up
    assert [r["prompt"] for r in req.rows[::n]] == ["r0p1", "r0p3", "r0p0", "r0p2"]
    assert req.dynamic == {"dynamic_kept_share": 0.5, "dynamic_refills": 2.0}


def test_rank_zero_holds_the_rendezvous_port_from_the_moment_it_names_it():
    """The port a group's ranks meet on is bound by rank 0's store before anyone is told it: a port found free
    and bound later could be taken in between (two roles starting at once: EADDRINUSE, 2026-12-01)."""
    import socket

    from stages.ppo.groups import Workhorse

    rank0 = Workhorse("g", 0, 2, {})
    address, port = rank0.master_address()
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind((address, port))
    finally:
        del rank0._store
