"""Multi-turn rollouts on real vLLM engines: what the environment adds is masked, the engine's log-probs are
the trainer's on the model's tokens, tools that raise, hang or flood never stall an iteration, and GRPO with an
environment learns (stages/ppo/episodes.py; the pure parts are in tests/test_tools_units.py)."""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from conftest import SMOKE, TRAINED, smoke_config
from pipeline.runner import run_pipeline

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 1, "vllm_engines": 5}

pytestmark = [pytest.mark.slow, pytest.mark.tier("e2e", covers=("stages/ppo/", "stages/common/engines.py",
                                                                "stages/common/followed.py"))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The built-in model (tokenizer with the calculator's tool-call pieces) with large random weights, so its
    samples vary and its log-probs are far from uniform."""
    from helpers.weights import redraw
    from stages.common import models, tasks

    cfg = models.BuiltinModelConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=2,
                                    num_heads=2, num_kv_heads=1, max_position_embeddings=256)
    corpus = tasks.corpus(tasks.TaskConfig(calculator=0.5), 0, 400)
    return redraw(models.build_base_model(tmp_path_factory.mktemp("model"), cfg, corpus, 0))


def _prompts(tok, questions):
    return [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"] for q in questions]


def test_episodes_mask_the_environment_match_the_trainer_and_survive_tools_that_raise_hang_or_flood(ray_local,
                                                                                                     model_dir):
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common.engines import EnginePool, EngineSpec, weights_to_numpy
    from stages.common.models import load_tokenizer
    from stages.ppo import rl
    from stages.common.followed import EngineStalled
    from stages.ppo.episodes import STALL_GRACE_S, AgentEngine, EpisodeSpec, run_episodes
    from stages.ppo.rewards import import_root
    from stages.ppo.scoring import rollout_batch

    tok = load_tokenizer(model_dir)
    pool = EnginePool(str(model_dir), EngineSpec(max_model_len=256, seed=0), num_engines=1, engine_cls=AgentEngine)
    try:
        # A policy update reaches the engine first: its episodes must come from the synced weights.
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        torch.manual_seed(3)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.add_(torch.randn_like(p) * 0.2)
        pool.sync(ray.put(weights_to_numpy(model.state_dict())), version=1)

        kinds = ["raise", "hang", "flood", "answer"]
        rows = [{"prompt": q, "kind": k} for q, k in zip(("What is 3 * 4?", "Compute 12 * 7.", "5 * 5 = ?",
                                                           "Calculate 9 * 8."), kinds)]
        prompts = _prompts(tok, [r["prompt"] for r in rows])
        spec = EpisodeSpec("helpers.environments:Misbehaving", max_turns=3, max_tokens=200, tool_timeout_s=3,
                           max_output_chars=64, path=import_root("helpers.environments:Misbehaving"))
        # Random weights rarely sample the end-of-turn token: half the vocabulary ends a turn here (vLLM's
        # stop_token_ids, finish_reason "stop"), so every turn is a finished one and reaches the environment.
        sampling = {"n": 2, "temperature": 1.0, "max_tokens": 16, "seed": 5, "logprobs": 0,
                    "stop_token_ids": list(range(3, len(tok), 2))}
        t0, said = time.time(), []
        groups = run_episodes(pool.engines, [prompts], [rows], sampling, spec, log=said.append)
        took = time.time() - t0
        assert took < 40, took  # the hung tool (60 s) was abandoned at tool_timeout_s, not waited for
        # ... but its thread still sleeps in the engine: the engine was replaced after its answer (issue 48, item 6)
        assert said == ["rollout engine replaced after this call: 2 call(s) of the environment "
                        "helpers.environments:Misbehaving still running after tool_timeout_s=3 s"], said
        assert pool.revive() == [0]
        by_kind = dict(zip(kinds, groups))
        for kind, group in by_kind.items():
            assert len(group) == 2
            for s in group:
                assert s["version"] == 1 and len(s["ids"]) == len(s["mask"]) == len(s["logprobs"]) <= 200
                told = [m["content"] for m in s["messages"] if m["role"] == "tool"]
                if kind == "raise":
                    assert told == ["error: ZeroDivisionError: division by zero"] and s["tool_errors"] == 1
                elif kind == "hang":
                    assert told == ["error: the tool did not answer within 3 s"] and s["tool_errors"] == 1
                    assert s["tool_s"] >= 3
                elif kind == "flood":  # 5 MB cut to 64 characters before it reaches the context
                    assert told == ["x" * 64 + "... [4999936 characters cut]"] and s["tool_errors"] == 1
                else:
                    assert told == ["42"] and s["env_reward"] == 1.0 and s["turns"] == 2 and s["finished"]

        # Token for token: the environment's tokens are its rendered messages (mask 0), the rest the model's.
        flat = [s for g in groups for s in g]
        reps = [{"prompt_ids": p} for p in prompts for _ in range(2)]
        for s in flat:
            env_ids = [t for t, m in zip(s["ids"], s["mask"]) if not m]
            env_text = tok.decode(env_ids)
            assert "<|im_start|>tool\n" in env_text and env_text.endswith("<|im_start|>assistant\n"), env_text
            assert s["mask"][0] == 1 and 0 in s["mask"]
        # The engine's log-probs equal the trainer's on the model's tokens of every multi-turn sample.
        batch = rollout_batch(reps, flat, tok.pad_token_id)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits
        p = batch["prompt_width"]
        trainer = rl.logprobs_from_logits(logits[:, p - 1: -1], batch["response_ids"])
        engine = rl.pad_rows([s["logprobs"] for s in flat], trainer.shape[1])
        mask = batch["response_mask"]
        assert mask.sum() >= 16 and (mask == 0).logical_and(batch["attention_mask"][:, p:] == 1).any()
        mismatch = rl.logprob_mismatch(trainer, engine, mask)
        assert mismatch["logprob_mismatch_max"] < 1e-3, mismatch
        # ... and not on the environment's tokens, which the engine never sampled (their log-probs are 0 there)
        env = (mask == 0) & (batch["attention_mask"][:, p:] == 1)
        assert (trainer[env] - engine[env]).abs().max() > 0.1

        # A step holding the interpreter (no thread can stop it, and the engine's own loop stops with it): the
        # follower kills the engine soon after the call's timeout; restarted, it answers with the synced weights.
        spec = EpisodeSpec("helpers.environments:Misbehaving", max_turns=2, max_tokens=200, tool_timeout_s=2,
                           path=spec.path)
        held = [{**rows[0], "kind": "hold"}, rows[3]]
        t0 = time.time()
        with pytest.raises(EngineStalled, match="while the environment helpers.environments:Misbehaving ran"):
            run_episodes(pool.engines, [prompts[::3]], [held], sampling, spec)
        assert time.time() - t0 < 2 + STALL_GRACE_S + 15, time.time() - t0
        assert pool.revive() == [0]
        groups = run_episodes(pool.engines, [prompts[3:]], [rows[3:]], sampling, spec)
        assert [s["version"] for s in groups[0]] == [1, 1] and groups[0][0]["env_reward"] == 1.0
    finally:
        pool.shutdown()


def test_grpo_with_an_environment_raises_its_reward_and_logs_the_episodes(ray_local, smoke_trained, tmp_path,
                                                                          tracking_uri):
    """The smoke policy, GRPO with `rollout.async`, every rollout two turns (the user asks again; the second
    answer is rewarded by the environment alone): the environment's reward rises, and every iteration logs
    the episode metrics and a trajectory. The barely trained smoke model rarely ends a turn by itself: its
    turns are cut at sampling.max_new_tokens (8) and still go to the environment, as a chat API's would."""
    import json

    from mlflow.tracking import MlflowClient

    cfg = smoke_config(smoke_trained(tmp_path), f"mlflow.tracking_uri={tracking_uri}", *TRAINED,
                       "stages.ppo.algorithm=grpo", "stages.ppo.rollout.async=true",
                       "stages.ppo.rewards.model_weight=0",
                       "stages.ppo.rewards.rule_weight=0", "stages.ppo.environment.name=helpers.environments:TwoTurns",
                       "stages.ppo.environment.max_tokens=48", "stages.ppo.kl.coef=0.0", "stages.ppo.policy.lr=0.001",
                       "stages.ppo.iterations=14", "stages.ppo.ppo_epochs=2", "stages.ppo.checkpoint_every=14",
                       "stages.ppo.eval_prompts=8", "stages.ppo.eval_samples=0")
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True), to="ppo")
    client, run_id = MlflowClient(tracking_uri), summary["run_ids"]["ppo"]
    history = lambda key: {m.step: m.value for m in client.get_metric_history(run_id, key)}  # noqa: E731
    reward = history("env_reward_mean")
    assert sorted(reward) == list(range(1, 15))
    first, last = sum(reward[i] for i in (1, 2, 3)) / 3, sum(reward[i] for i in (12, 13, 14)) / 3
    assert last > first + 0.1, reward
    # the rule reward's weight is 0: the environment's is the score
    assert history("reward_mean") == pytest.approx(reward)
    assert all(v == 2 for v in history("turns_per_sample").values())  # 8 + ~12 + 8 tokens fit the budget of 48
    for key in ("tool_calls_per_sample", "tool_errors", "tool_s", "truncated_frac", "staleness"):
        assert len(history(key)) == 14, key
    [traj] = [a.path for a in client.list_artifacts(run_id, "trajectories") if a.path.endswith("iter_0014.json")]
    first_sample = json.loads(open(client.download_artifacts(run_id, traj)).read())[0]
    assert [m["role"] for m in first_sample["messages"]][:3] == ["user", "assistant", "user"]
    assert first_sample["messages"][2]["content"] == "And again?"
