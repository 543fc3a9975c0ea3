"""The colocated PPO layout (stages/ppo/layouts/colocated.py; issue 60, items 1, 2 and 8): one Ray actor per policy rank
holding every role and its own in-process vLLM engine.

Fast: what the layout refuses at validation, the engine arguments the device and layout decide (GPU keys
included, tested without a GPU), and how a role of the ranks is called. Tiered: one seed, both layouts, the same
first iteration (the trainer's and the engines' log-probs, the losses) to 1e-5, the process count of each from
the stage's `startup_processes`, and a killed rank restarted with the run resumed from its checkpoint."""

from __future__ import annotations

import pytest

from conftest import SMOKE, TRAINED, smoke_config

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance"):
# two ppo runs (the colocated one starts its ranks twice: once more after the killed rank).
STARTS = {"pipelines": 2, "vllm_engines": 6}


def _ppo(**over):
    from stages.ppo.config import PPOConfig

    return PPOConfig.model_validate(over)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("setting, named", [
    ({"rollout": {"async": True}}, "rollout.async"),
    ({"environment": {"name": "calculator"}}, "environment"),
    ({"rollout": {"num_engines": 3}}, "rollout.num_engines: 3"),
    ({"critic": {"num_ranks": 1}}, "critic.num_ranks: 1"),
    ({"reward": {"num_ranks": 3}, "rewards": {"model_weight": 1.0}}, "reward.num_ranks: 3"),
])
def test_colocated_refuses_what_it_cannot_do_naming_the_key_and_the_fix(setting, named):
    with pytest.raises(ValueError) as err:
        _ppo(layout="colocated", policy={"num_ranks": 2}, **setting)
    assert named in str(err.value) and "layout: separate" in str(err.value), str(err.value)


def test_colocated_takes_the_policys_ranks_for_every_role_and_reserves_only_those():
    cfg = _ppo(layout="colocated", policy={"num_ranks": 2, "cpus_per_rank": 1},
               critic={"num_ranks": 2}, rollout={"num_engines": 2})
    assert cfg.ranks(cfg.critic) == cfg.ranks(cfg.reward) == 2
    assert cfg.cpus_needed() == 2
    # separate: policy 2 + critic 1 + reference 1 + two engines (no reward role: rewards.model_weight is 0)
    assert _ppo(policy={"num_ranks": 2}, critic={"num_ranks": 1}).cpus_needed() == 6


def test_a_role_the_stage_does_not_start_keeps_its_rank_count_unread():
    """GRPO has no critic, a reward weight of 0 no reward model: their num_ranks, set in a recipe, do not refuse."""
    cfg = _ppo(layout="colocated", algorithm="grpo", policy={"num_ranks": 2}, critic={"num_ranks": 1},
               reward={"num_ranks": 1})
    assert cfg.cpus_needed() == 2


def test_sleep_mode_is_refused_without_a_trainer_to_give_the_memory_to():
    with pytest.raises(ValueError, match="rollout.sleep_mode.*layout: colocated"):
        _ppo(layout="separate", rollout={"sleep_mode": True})
    assert _ppo(layout="colocated", policy={"num_ranks": 1}, rollout={"sleep_mode": True}).rollout.sleep_mode


# --------------------------------------------------------------------------- what the device and layout decide


def _spec(**kw):
    from stages.common.engines import EngineSpec

    return EngineSpec(max_model_len=64, kv_cache_gb=0.5, gpu_memory_utilization=0.4, **kw)


def test_an_engine_inside_a_cpu_rank_sizes_its_kv_cache_in_bytes_and_joins_the_ranks_group():
    from stages.common.engines import llm_kwargs

    inside = llm_kwargs("m", _spec(backend="external_launcher"), 1)
    assert inside["distributed_executor_backend"] == "external_launcher"
    assert inside["kv_cache_memory_bytes"] == 2**29 and "enable_sleep_mode" not in inside
    assert inside["seed"] == 1 and inside["enforce_eager"] and not inside["enable_chunked_prefill"]
    # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE override the bytes: a rank's environment has none
    assert "VLLM_CPU_KVCACHE_SPACE" not in _spec(backend="external_launcher").runtime_env()["env_vars"]
    alone = llm_kwargs("m", _spec(), 0)
    assert alone["distributed_executor_backend"] == "uni" and "kv_cache_memory_bytes" not in alone
    assert _spec().runtime_env()["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


@pytest.mark.parametrize("sleep", [True, False])
def test_an_engine_inside_a_gpu_rank_takes_its_memory_share_and_sleeps_as_configured(sleep):
    from stages.common.engines import llm_kwargs

    kw = llm_kwargs("m", _spec(gpu=True, backend="external_launcher", sleep_mode=sleep), 0)
    assert kw["enable_sleep_mode"] is sleep and kw["gpu_memory_utilization"] == 0.4
    assert "kv_cache_memory_bytes" not in kw and not kw["enforce_eager"] and kw["enable_chunked_prefill"]
    assert "enable_sleep_mode" not in llm_kwargs("m", _spec(gpu=True, sleep_mode=sleep), 0)  # an engine of its own


def test_a_rank_on_a_gpu_reserves_one_device_its_engine_shares(monkeypatch):
    """The colocated ranks are one ModelGroup: one GPU per rank on a GPU machine, none on CPU; no engine actors."""
    import stages.ppo.groups as groups
    from stages.ppo.layouts import colocated_rank
    from stages.ppo.layouts.colocated import Colocated

    made = {}

    class Group:
        def __init__(self, name, cls, n, cpus, gpu, strategy, env=None, runtime_env=None, wait=True):
            made.update(name=name, cls=cls, n=n, cpus=cpus, gpu=gpu, env=runtime_env["env_vars"])
            self.actors, self.pg = [object()] * n, None

        def __len__(self):
            return len(self.actors)

        def run(self, method, *args):
            made["setup"] = (method, args)
            return []

    monkeypatch.setattr(groups, "ModelGroup", Group)
    cfg = _ppo(layout="colocated", policy={"num_ranks": 2, "cpus_per_rank": 2}, rollout={"sleep_mode": True})

    class S:
        groups, tok = {}, type("Tok", (), {"pad_token_id": 0})

    roles = [("policy", cfg.policy, "causal", "sft", True), ("critic", cfg.critic, "value", "rm", True)]
    layout = Colocated(cfg)
    layout.start(S, roles, _spec(gpu=True), True, 0, None)
    assert made["cls"] is colocated_rank.ColocatedRank and made["gpu"] and (made["n"], made["cpus"]) == (2, 2)
    assert made["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    method, (specs, model, engine) = made["setup"]
    assert engine.backend == "external_launcher" and engine.sleep_mode and engine.gpu
    assert specs["critic"]["ds_config"]["train_batch_size"] == cfg.mini_batch_size  # over the policy's 2 ranks
    assert specs["policy"]["reference_dir"] == "sft"  # the reference is a copy in each rank
    assert S.groups["policy"] is not S.groups["critic"] and len(S.groups["critic"]) == 2


def test_a_role_of_the_ranks_is_called_on_each_rank_with_its_share():
    from stages.ppo.layouts.colocated_rank import RoleView

    class Method:
        def __init__(self, rank):
            self.rank = rank

        def remote(self, *args, **kwargs):
            return (self.rank, args, kwargs)

    class Actor:
        def __init__(self, rank):
            self.call = Method(rank)

    class Ranks:
        actors = [Actor(0), Actor(1)]

        def __len__(self):
            return 2

    view = RoleView(Ranks(), "critic")
    assert view.run_each("values", ["a", "b"], micro=4) == [(0, ("critic", "values", "a"), {"micro": 4}),
                                                            (1, ("critic", "values", "b"), {"micro": 4})]
    with pytest.raises(ValueError, match="3 shards for 2 ranks"):
        view.run_each("values", [1, 2, 3])


# --------------------------------------------------------------------------- both layouts, one seed

# The same roles and shares in both: two policy ranks holding the reference, two critic and reward ranks, an engine
# per policy rank; the old policy's log-probs from the ranks, so the engines' are compared with them.
SAME = (*TRAINED, "stages.ppo.critic.num_ranks=2", "stages.ppo.rollout.num_engines=2",
        "stages.ppo.rollout.engine_logprobs=false")
FIRST = ("reward_mean", "rm_score_mean", "kl", "policy_loss", "value_loss", "clip_frac", "approx_kl", "entropy",
         "logprob_mismatch_mean", "response_length")


def _run(run_dir, tracking_uri, *overrides):
    from rich.console import Console

    from pipeline.runner import run_pipeline

    cfg = smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", *SAME, *overrides)
    return cfg, run_pipeline(cfg, SMOKE, Console(quiet=True), to="ppo")["run_ids"]["ppo"]


def _metrics(tracking_uri, run_id, key) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri).get_metric_history(run_id, key)}


@pytest.fixture(scope="module")
def layouts(smoke_trained, tmp_path_factory, ray_local, tracking_uri):
    """One ppo run per layout on the session's trained SFT and reward model. The colocated one runs three
    iterations, checkpointing each, with rank 0 killed when iteration 3's rollouts are requested."""
    run_dir = smoke_trained(tmp_path_factory.mktemp("layouts"))
    separate = _run(run_dir, tracking_uri, "stages.ppo.iterations=1", "stages.ppo.reward.num_ranks=2",
                    "stages.ppo.reference.colocate=true", "stages.ppo.eval_prompts=0")  # compared on iteration 1
    mp = pytest.MonkeyPatch()
    mp.setenv("PIPELINE_FAULT_KILL_ENGINE_AT", "2")
    try:
        colocated = _run(run_dir, tracking_uri, "stages.ppo.layout=colocated", "stages.ppo.iterations=3",
                         "stages.ppo.checkpoint_every=1", "stages.ppo.eval_prompts=4")  # the ranks' engines evaluate
    finally:
        mp.undo()
    return {"separate": separate, "colocated": colocated}


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/ppo/", "stages/common/engines.py", "stages/common/lora.py",
                                 "stages/common/followed.py"))
def test_both_layouts_give_the_same_first_iteration_on_one_seed(layouts, tracking_uri):
    (_, sep), (_, col) = layouts["separate"], layouts["colocated"]
    for key in FIRST:
        a, b = _metrics(tracking_uri, sep, key)[1], _metrics(tracking_uri, col, key)[1]
        assert b == pytest.approx(a, rel=1e-5, abs=1e-5), (key, a, b)
    # the engines sampled with the trainer's weights: their log-probs are the trainer's (teacher-forced)
    assert _metrics(tracking_uri, col, "logprob_mismatch_max")[1] < 1e-4


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/ppo/", "stages/common/engines.py", "stages/common/followed.py"))
def test_the_colocated_layout_starts_one_process_per_policy_rank(layouts, tracking_uri):
    for layout, (cfg, run_id) in layouts.items():
        ppo = cfg.stages.ppo
        expected = ppo.policy.num_ranks if layout == "colocated" else \
            ppo.policy.num_ranks + ppo.critic.num_ranks + ppo.reward.num_ranks + ppo.rollout.num_engines
        assert _metrics(tracking_uri, run_id, "startup_processes")[1] == expected, layout


@pytest.mark.slow
@pytest.mark.tier("faults", covers=("stages/ppo/", "stages/common/engines.py", "stages/common/followed.py"))
def test_a_killed_colocated_rank_is_started_again_and_the_run_resumes(layouts, tracking_uri):
    _, run_id = layouts["colocated"]
    assert list(_metrics(tracking_uri, run_id, "rank_restarts").values()) == [1.0]
    # every iteration logged: the second before rank 0 died (its checkpoint failed) and again after the resume
    assert sorted(_metrics(tracking_uri, run_id, "reward_mean")) == [1, 2, 3]
    assert _metrics(tracking_uri, run_id, "engine_restarts")  # the run finished (its final metrics)
    assert 0 <= _metrics(tracking_uri, run_id, "eval_accuracy")[3] <= 1  # held-out answers from the ranks' engines
