"""vLLM rollout engines as Ray actors: weight sync through the object store, restart of a dead engine."""

from __future__ import annotations

from pathlib import Path

import pytest

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"vllm_engines": 4}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The built-in model with large random weights, so greedy outputs are not one repeated token."""
    from helpers.weights import redraw
    from stages.common import models, tasks

    cfg = models.BuiltinModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                                    num_heads=2, num_kv_heads=1, max_position_embeddings=128)
    return redraw(models.build_base_model(tmp_path_factory.mktemp("model"), cfg,
                                          tasks.corpus(tasks.TaskConfig(), 0), 0))


def _prompts(model_dir) -> list[list[int]]:
    from stages.common.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in ("What is 1 + 2?", "Compute 35 + 7.", "12 + 30 = ?", "What is 9 - 4?")]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n argmax steps of the HF model (no EOS handling: `generate`'s min_new_tokens would ban EOS,
    which vLLM's ignore_eos does not)."""
    import torch

    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            for _ in range(n):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        out.append(ids[0, len(p):].tolist())
    return out


def _logprob_mismatch(engine, model, prompts: list[list[int]]) -> dict[str, float]:
    """Sample at T=1 with the sampled tokens' log-probs, score the same tokens with the HF model."""
    import ray
    import torch

    from stages.ppo import rl
    from stages.ppo.rl import make_batch, pad_rows

    samples = ray.get(engine.generate.remote(prompts, {"n": 2, "temperature": 1.0, "max_tokens": 8, "seed": 7,
                                                       "logprobs": 0}))
    flat = [s for group in samples for s in group]
    batch = make_batch([p for p in prompts for _ in range(2)], [s["ids"] for s in flat], pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    p = batch["prompt_width"]
    trainer = rl.logprobs_from_logits(logits[:, p - 1 : -1], batch["response_ids"])
    engine_lp = pad_rows([s["logprobs"] for s in flat], trainer.shape[1])
    return rl.logprob_mismatch(trainer, engine_lp, batch["response_mask"])


@pytest.mark.tier("faults", covers=("stages/common/engines.py", "stages/ppo/roles.py", "stages/ppo/weight_chunks.py",
                                    "stages/common/followed.py"))
def test_weight_sync_reaches_every_engine_and_survives_a_restart(ray_local, model_dir):
    import copy

    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common.engines import EnginePool, EngineSpec, weights_to_numpy

    prompts, n = _prompts(model_dir), 8
    greedy = {"temperature": 0.0, "max_tokens": n, "ignore_eos": True}
    pool = EnginePool(str(model_dir), EngineSpec(max_model_len=128, seed=0), num_engines=2)
    try:
        def engine_tokens() -> list[list[list[int]]]:
            outs = ray.get([e.generate.remote(prompts, greedy) for e in pool.engines])
            return [[s[0]["ids"] for s in per_engine] for per_engine in outs]

        before = engine_tokens()
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        assert before[0] == before[1] == _hf_greedy(model, prompts, n)  # same start on both engines

        from stages.common.engines import tcmalloc

        if tcmalloc():  # installed by scripts/setup.sh: the engines' processes run with it preloaded
            pid = ray.get(pool.engines[0].ping.remote())
            assert "libtcmalloc" in Path(f"/proc/{pid}/maps").read_text()

        # A "policy update": new weights in the trainer, then one put and a sync.
        torch.manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.add_(torch.randn_like(p) * 0.3)
        expected = _hf_greedy(model, prompts, n)
        seconds = pool.sync(ray.put(weights_to_numpy(model.state_dict())))
        after = engine_tokens()
        assert seconds > 0
        assert after[0] == expected and after[1] == expected  # every engine generates with the new weights
        assert after[0] != before[0]  # and not with the old ones

        # The engines' log-probs of the tokens they sample equal the trainer's under the same (synced,
        # fp32) weights: the mismatch the ppo stage logs every iteration is ~0, and grows with a stale engine.
        mismatch, stale = _logprob_mismatch(pool.engines[0], model, prompts), None
        assert mismatch["logprob_mismatch_max"] < 1e-3, mismatch
        assert mismatch["logprob_mismatch_mean"] < 1e-4, mismatch
        stale = _logprob_mismatch(pool.engines[0], AutoModelForCausalLM.from_pretrained(model_dir).eval(), prompts)
        assert stale["logprob_mismatch_mean"] > 100 * max(mismatch["logprob_mismatch_mean"], 1e-6), (stale, mismatch)

        # A LoRA policy syncs its merged weights (base + adapter), here a piece per chunk as a colocated rank
        # hands them over (stages/ppo/weight_chunks.py: one layerwise reload fed many chunks, a fused vLLM layer
        # such as qkv_proj spanning several): the engines then generate exactly what the trainer's PEFT model does.
        from stages.common import lora
        from stages.ppo.weight_chunks import weight_chunks

        policy = lora.wrap(copy.deepcopy(model), lora.LoraSection(r=4, alpha=8), "causal")
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.3)
        with_adapter = _hf_greedy(policy, prompts, n)
        assert with_adapter != expected  # the adapter changes the greedy answers
        chunks = [weights_to_numpy(c) for c in weight_chunks(policy, zero3=False, budget=1)]
        assert len(chunks) > 10
        ray.get([e.load_weights.remote(chunks) for e in pool.engines])
        assert engine_tokens() == [with_adapter, with_adapter]
        pool.sync(ray.put(weights_to_numpy(model.state_dict())))  # back to the plain update for what follows

        # An engine dies: revive() restarts it and brings it to the synced weights, not the checkpoint's.
        pool.kill(0)
        assert pool.revive() == [0] and pool.restarts == 1
        assert engine_tokens() == [expected, expected]

        # An engine that dies before a sync is restarted by the sync itself and gets the new weights.
        pool.kill(1)
        seconds = pool.sync(ray.put(weights_to_numpy(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())))
        assert pool.restarts == 2 and engine_tokens() == [before[0], before[0]]  # back to the checkpoint's
    finally:
        pool.shutdown()


def test_weights_to_numpy_is_zero_copy_and_keeps_bf16():
    import torch

    from stages.common.engines import numpy_to_tensors, weights_to_numpy

    emb = torch.randn(4, 3)
    state = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.randn(3, dtype=torch.bfloat16)}
    arrays = weights_to_numpy(state)
    assert set(arrays) == {"embed.weight", "norm.weight__bf16__"}  # tied copy sent once
    back = dict(numpy_to_tensors(arrays))
    assert back["norm.weight"].dtype == torch.bfloat16 and torch.equal(back["norm.weight"], state["norm.weight"])
    assert torch.equal(back["embed.weight"], emb)
    assert back["embed.weight"].data_ptr() == arrays["embed.weight"].ctypes.data  # no copy on the way back
