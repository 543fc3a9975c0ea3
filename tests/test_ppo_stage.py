"""The ppo stage end to end on smoke data: real vLLM engines, DeepSpeed roles, weight sync every iteration
(slow); and one rank of a role on the session's Ray, placed with its cpus_per_rank (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from conftest import SMOKE, TRAINED, smoke_config
from pipeline import storage
from pipeline.runner import run_pipeline

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 4, "vllm_engines": 9}

# A reward the smoke policy can learn in a few iterations (share of digit characters), no KL brake,
# and a large learning rate: what is under test is that the loop improves the policy at all.
# (The reward role scores in the shared command-line run, conftest.smoke_cli, which keeps smoke.yaml's weight.)
LEARN = ["stages.ppo.rewards.rule=helpers.toy_rewards:digits", "stages.ppo.kl.coef=0.0",
         "stages.ppo.policy.lr=0.001", "stages.ppo.critic.lr=0.001", "stages.ppo.iterations=20",
         "stages.ppo.ppo_epochs=2", "stages.ppo.checkpoint_every=10"]


def run_ppo(run_dir, tracking_uri, *overrides):
    cfg = smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", *TRAINED, *overrides)
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True), to="ppo")
    manifest = summary["stages"]["ppo"]
    out = storage.output_paths(manifest, storage.artifact_dir(cfg.run_dir, "ppo", manifest["key"]))
    return manifest, summary["run_ids"]["ppo"], out["policy_model"]


def history(tracking_uri, run_id, key) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri).get_metric_history(run_id, key)}


@pytest.fixture(scope="module")
def run_dir(smoke_trained, tmp_path_factory):
    """One run directory for the module, holding the session's trained SFT and reward model (cache
    hits); each PPO variant has its own key."""
    return smoke_trained(tmp_path_factory.mktemp("ppo"))


@pytest.fixture(scope="module")
def ppo_run(ray_local, run_dir, tracking_uri, monkeypatch_module):
    """One PPO run in which rollout engine 0 is killed at iteration 3 (index 2); the reference sits in the
    policy ranks (`reference.colocate`)."""
    monkeypatch_module.setenv("PIPELINE_FAULT_KILL_ENGINE_AT", "2")
    try:
        return run_ppo(run_dir, tracking_uri, *LEARN, "stages.ppo.rewards.model_weight=0",
                       "stages.ppo.reference.colocate=true")
    finally:
        monkeypatch_module.delenv("PIPELINE_FAULT_KILL_ENGINE_AT")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.slow
def test_ppo_raises_the_reward(ppo_run, tracking_uri):
    _, run_id, _ = ppo_run
    reward = history(tracking_uri, run_id, "reward_mean")
    assert sorted(reward) == list(range(1, 21))
    first, last = sum(reward[i] for i in (1, 2, 3, 4)) / 4, sum(reward[i] for i in (17, 18, 19, 20)) / 4
    assert last > first + 0.1, reward  # the mean share of digits rose by more than 0.1
    # every iteration logged the PPO diagnostics and the time split
    for key in ("kl", "policy_loss", "value_loss", "clip_frac", "entropy", "response_length", "generate_s",
                "score_s", "train_s", "sync_s", "sync_mb", "gen_tokens_per_s", "truncated_frac"):
        assert len(history(tracking_uri, run_id, key)) >= 20, key


@pytest.mark.slow
def test_the_run_logs_samples_and_an_engine_trainer_mismatch_near_zero(ppo_run, tracking_uri):
    from mlflow.tracking import MlflowClient

    manifest, run_id, _ = ppo_run
    mismatch = history(tracking_uri, run_id, "logprob_mismatch_mean")
    assert len(mismatch) == 20 and max(mismatch.values()) < 1e-4  # fp32 weights synced every iteration
    assert set(history(tracking_uri, run_id, "staleness").values()) == {0}  # synchronous: the current policy's
    # The colocated reference is the SFT policy: before the first update the policy's KL to it is 0.
    assert history(tracking_uri, run_id, "kl")[1] < 1e-4
    assert max(history(tracking_uri, run_id, "kl").values()) > 1e-3  # and it then measures the policy moving away
    assert manifest["metrics"]["reward_slope"] > 0 and manifest["metrics"]["kl_max"] >= 0
    client = MlflowClient(tracking_uri)
    files = {a.path for a in client.list_artifacts(run_id, "samples")}
    assert {"samples/iter_0001.json", "samples/iter_0020.json"} <= files
    first = client.download_artifacts(run_id, "samples/iter_0001.json")
    import json

    rows = json.loads(open(first).read())
    assert len(rows) == 4 and {"prompt", "answer", "response", "reward"} <= rows[0].keys()


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/ppo/", "pipeline/bucket.py", "pipeline/run_storage.py", "pipeline/files.py"))
def test_async_grpo_learns_on_rollouts_at_most_one_update_old_and_resumes_from_the_object_store(
        ray_local, run_dir, tracking_uri, monkeypatch):
    """GRPO with `rollout.async` and DAPO's loss, clip-higher, dynamic sampling and overlong penalty: iteration
    i+1's rollouts are generated while iteration i trains. With
    `storage.uri` the ranks' DeepSpeed shards and the driver state go to the bucket; the run is interrupted
    after the checkpoint of iteration 8, and a rerun on a machine without the local checkpoints (wiped
    here) pulls them and continues after iteration 8. Learning is judged over the whole run (both halves)."""
    import shutil
    import time

    from mlflow.tracking import MlflowClient

    from helpers.s3 import S3Server

    with S3Server() as s3:
        # DAPO's pieces on the asynchronous path (docs/objectives.md): the loop's wiring of them is under test
        # here, their math in tests/test_grpo_oracle.py and tests/test_ppo_units.py
        dapo = ["stages.ppo.loss_type=dapo", "stages.ppo.clip_eps_high=0.28",
                "stages.ppo.dynamic_sampling.enabled=true",
                "stages.ppo.overlong.cache=2", "stages.ppo.overlong.penalty=0.05"]
        grpo = [*LEARN, *dapo, "stages.ppo.algorithm=grpo", "stages.ppo.rollout.async=true",
                "stages.ppo.rewards.model_weight=0",
                "stages.ppo.iterations=16", "stages.ppo.checkpoint_every=8", "stages.ppo.eval_prompts=0",
                f"storage.uri=s3://{s3.bucket}/ppo", f"storage.endpoint_url={s3.endpoint}"]
        started = int(time.time() * 1000)
        monkeypatch.setenv("PIPELINE_FAULT_AFTER_ITERATION", "8")
        with pytest.raises(Exception, match="injected fault after iteration 8"):
            run_ppo(run_dir, tracking_uri, *grpo)
        finished = set((run_dir / "artifacts" / "ppo").glob("*/manifest.json"))
        monkeypatch.delenv("PIPELINE_FAULT_AFTER_ITERATION")
        store = s3.store("ppo")
        [key] = {name.split("/")[0] for name in store.files("checkpoints/ppo")}
        remote = store.files(f"checkpoints/ppo/{key}")
        assert "latest.json" in remote and any(n.startswith("iter_00007/policy/") for n in remote), sorted(remote)
        shutil.rmtree(run_dir / "checkpoints" / "ppo" / key)  # resume on a machine that has only the bucket

        manifest, run_id, policy = run_ppo(run_dir, tracking_uri, *grpo)
    assert manifest["key"] == key
    assert run_dir / "artifacts" / "ppo" / manifest["key"] / "manifest.json" not in finished  # no manifest before
    assert (policy / "config.json").is_file()
    client = MlflowClient(tracking_uri)
    experiment = client.get_run(run_id).info.experiment_id
    [interrupted] = client.search_runs([experiment], f"tags.stage = 'ppo' and attributes.status = 'FAILED' and "
                                       f"attributes.start_time > {started}")
    runs = (interrupted.info.run_id, run_id)

    def whole(metric):  # the metric over the whole run: iterations 1-8 from the interrupted run, 9-16 resumed
        return {step: v for r in runs for step, v in history(tracking_uri, r, metric).items()}

    assert sorted(history(tracking_uri, runs[0], "reward_mean")) == list(range(1, 9))
    assert sorted(history(tracking_uri, run_id, "reward_mean")) == list(range(9, 17))  # continued after iteration 8
    reward = whole("reward_mean")
    first, last = sum(reward[i] for i in (1, 2, 3, 4)) / 4, sum(reward[i] for i in (13, 14, 15, 16)) / 4
    assert last > first + 0.1, reward
    # dynamic sampling ran every iteration; the overlong penalty lowered the reward below the rule's where
    # responses reached the token limit
    kept, refills = whole("dynamic_kept_share"), whole("dynamic_refills")
    assert sorted(kept) == sorted(refills) == list(range(1, 17)) and all(0 <= v <= 1 for v in kept.values())
    rule, cut = whole("rule_reward_mean"), whole("truncated_frac")
    assert any(cut[i] > 0 for i in cut) and all(reward[i] < rule[i] for i in cut if cut[i] > 0), (reward, rule, cut)
    assert not whole("value_loss")  # no critic
    # The engines tag their samples with the weights' version: the first batch comes from the SFT weights,
    # every later one from the weights one update before the policy that trains on it (the bound is 1).
    # A resumed run starts the same way: the engines get the checkpoint's weights before its first batch,
    # so iteration 9 is on-policy too (staleness 0), and at most 14 of the 16 iterations can be 1 update old.
    staleness = whole("staleness")
    # (Which of the next rollouts and the sync reaches an engine first is Ray's ordering, not ours; the rollouts
    # are sent long before the update ends, so nearly every iteration overlaps.)
    assert staleness[1] == 0 and staleness[9] == 0 and set(staleness.values()) <= {0, 1}, staleness
    assert sum(staleness.values()) >= 11, staleness
    # so the engines' log-probs are no longer the trainer's: the importance weights have something to correct
    assert max(whole("logprob_mismatch_mean").values()) > 1e-3


@pytest.mark.slow
@pytest.mark.tier("faults", covers=("stages/ppo/", "stages/common/engines.py", "stages/common/followed.py"))
def test_a_killed_engine_is_restarted_and_the_run_completes(ppo_run):
    import torch
    from transformers import AutoModelForCausalLM

    manifest, _, model_dir = ppo_run
    assert manifest["metrics"]["engine_restarts"] == 1
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # the trained policy, HF format
    out = model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)
    m = manifest["metrics"]
    for key in ("accuracy", "reward", "sampled_accuracy", "sampled_reward", "truncated", "sampled_truncated"):
        assert {f"eval_{key}_before", f"eval_{key}", f"eval_{key}_sign_test_p"} <= m.keys(), key
    assert 0 < m["eval_prompts"] <= 16  # smoke.yaml's eval_prompts, capped by the eval split
    assert m["eval_sampled_accuracy_improved"] + m["eval_sampled_accuracy_worsened"] <= m["eval_prompts"]


def _sft_model(run_dir):
    import json

    [made] = (run_dir / "artifacts" / "sft").glob("*/manifest.json")
    return storage.output_paths(json.loads(made.read_text()), made.parent)["sft_model"]


@pytest.fixture(scope="module")
def teacher(run_dir):
    """A teacher for the distillation tests: the session's SFT policy plus a random rank-8 update of every
    linear layer but the output layer (a LoRA adapter's shape, merged in), so a LoRA student can reach it as
    well as a fully trained one; same tokenizer. Smoke's tiny model has near-uniform next-token
    distributions (entropy 5.65 of at most 5.69 nats); this teacher is ~0.22 nats a token from them on
    held-out answers, over the vocabulary. (First tries, 2026-11-29: the base model with its tied output layer
    perturbed gave a sampled estimate noisier than its change; a 10x sharper SFT policy is out of a LoRA
    student's reach: the final RMSNorm bounds what its adapters can do to the logits' scale.)"""
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = run_dir.parent / "teacher"
    shutil.copytree(_sft_model(run_dir), path, dirs_exist_ok=True)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.merge_and_unload().save_pretrained(path)
    return path


def reverse_kl_to(teacher, *students, prompts: int = 32, tokens: int = 8) -> list[float]:
    """Each student's exact KL(student || teacher) over the vocabulary (losses.reverse_kl), averaged over the
    response positions of `prompts` held-out prompts answered by the first student (sampled, seeded): the
    same contexts for every student, and no sampling noise in the measure itself."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common.parquet import read_rows
    from stages.ppo import losses

    [eval_dir] = (Path(students[0]).parents[3] / "artifacts" / "data").glob("*/prompts/eval")
    rows = read_rows(eval_dir)[:prompts]
    load = lambda d: AutoModelForCausalLM.from_pretrained(d).eval()  # noqa: E731
    first, judge = load(students[0]), load(teacher)
    torch.manual_seed(0)
    with torch.no_grad():
        seqs = [first.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=tokens, do_sample=True, top_k=0)
                for r in rows]
        out = []
        for student in [first, *map(load, students[1:])]:
            kls = [losses.reverse_kl(student(seq).logits, judge(seq).logits)[0, len(r["prompt_ids"]) - 1:-1].mean()
                   for seq, r in zip(seqs, rows)]
            out.append(float(torch.stack(kls).mean()))
    return out


# GRPO whose only reward is the teacher's, per token (no verifier, no reward model, no KL to the reference).
# 12 iterations, cut from 30 to the measured margin: in 30 the exact KL fell 16x (0.224 -> 0.014) against the
# test's 0.6x; at that run's average rate (x0.91 an iteration) 12 leave it at about 0.33x.
DISTILL_ITERATIONS = 12
DISTILL = ("stages.ppo.algorithm=grpo", "stages.ppo.rewards.rule_weight=0", "stages.ppo.rewards.model_weight=0",
           "stages.ppo.kl.coef=0.0", f"stages.ppo.iterations={DISTILL_ITERATIONS}",
           f"stages.ppo.checkpoint_every={DISTILL_ITERATIONS}",
           "stages.ppo.eval_prompts=0")


def _distilled(run_dir, tracking_uri, teacher, policy, run_id) -> tuple[float, float]:
    """The logged sampled estimate every iteration, and the exact reverse KL to the teacher of the SFT
    policy (the start) and of the trained policy."""
    kl = history(tracking_uri, run_id, "distill_reverse_kl")
    assert sorted(kl) == list(range(1, DISTILL_ITERATIONS + 1)), kl
    return tuple(reverse_kl_to(teacher, _sft_model(run_dir), policy))


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("stages/ppo/", "stages/common/lora.py"))
def test_distillation_moves_a_lora_student_toward_its_teacher(ray_local, run_dir, tracking_uri, teacher):
    """GRPO whose only reward is the teacher's, per token, through a teacher role of its own: a LoRA student
    (its own reference: the adapter off) ends far nearer its teacher than it started, and the exported policy
    carries the trained adapter beside it. Its first run (2026-11-29): exact reverse KL 0.224 -> 0.014; a
    fully trained student with lr 1e-3, run then as a test of its own, 0.224 -> 0.021, while a PPO policy
    trained without a teacher in the same directory ended farther from it (0.250): the teacher moves it.
    One run: the full-weight student's path is the same but for the adapter (each e2e run costs ~50 s)."""
    from stages.common import lora

    manifest, run_id, policy = run_ppo(run_dir, tracking_uri, *DISTILL, f"stages.ppo.distill.teacher={teacher}",
                                       "stages.ppo.policy.lora.r=8", "stages.ppo.policy.lr=0.01")
    before, after = _distilled(run_dir, tracking_uri, teacher, policy, run_id)
    assert before > 0.02 and after < 0.6 * before, (before, after)
    assert lora.adapter_problem(policy.parent / lora.ADAPTER_DIR) is None


# --------------------------------------------------------------------------- a role's ranks on Ray


def _threads_worker():
    from stages.ppo.groups import Workhorse

    class Threads(Workhorse):
        """A rank that reports how many torch threads it computes with."""

        def threads(self) -> int:
            import torch

            return torch.get_num_threads()

    return Threads


def test_a_rank_reserves_its_cpus_per_rank_and_computes_with_that_many_threads(tmp_path, ray_local):
    from stages.ppo.groups import ModelGroup

    cfg = smoke_config(tmp_path, "stages.ppo.reward.cpus_per_rank=2", "stages.ppo.rewards.model_weight=0.5")
    one = smoke_config(tmp_path, "stages.ppo.rewards.model_weight=0.5")
    assert cfg.stages.ppo.cpus_needed() - one.stages.ppo.cpus_needed() == 1
    group = ModelGroup("threads", _threads_worker(), num_ranks=1, cpus_per_rank=3, gpu=False)
    try:
        assert group.get("threads") == [3]  # not the node's 2 cores, not Ray's default of 1
    finally:
        group.shutdown()
