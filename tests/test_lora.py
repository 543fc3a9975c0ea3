"""LoRA's pure parts (stages/common/lora.py): merged weights, adapter files, the reference, config; and the weight
sync's chunks (stages/ppo/weight_chunks.py): together the merged weights, each gathered alone."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from conftest import smoke_config
from pipeline.errors import ConfigError
from stages.common import lora, models
from stages.common.engines import distinct
from stages.ppo import weight_chunks


def _tiny(kind: str, heads: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0, num_labels=heads)
    return LlamaForCausalLM(cfg) if kind == "causal" else LlamaForSequenceClassification(cfg)


def _trained(model, kind: str):
    """`model` with LoRA adapters moved away from their zero start (as training would)."""
    peft = lora.wrap(model, lora.LoraSection(r=4, alpha=8), kind)
    with torch.no_grad():
        for p in peft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return peft


@pytest.mark.parametrize("kind", ["causal", "sequence"])
def test_merged_weights_equal_peft_merge_and_leave_the_model_unchanged(kind):
    model = _trained(_tiny(kind), kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = lora.merged_state_dict(model)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(expected)  # HF names, no lora_* or wrapper keys
    assert all(torch.equal(merged[k], expected[k]) for k in expected)
    assert any(not torch.equal(merged[k], before[f"base_model.model.{k.replace('.weight', '.base_layer.weight')}"])
               for k in merged if "q_proj" in k)  # the adapter changed the weights it adapts
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # read, not merged in place
    if kind == "sequence":  # the trained copy of the score head, not the original
        assert torch.equal(merged["score.weight"], model.base_model.model.score.modules_to_save["default"].weight)


@pytest.mark.parametrize("kind, heads", [("causal", 1), ("sequence", 1), ("sequence", 3)])
def test_a_saved_adapter_merges_into_its_base_as_the_trained_model(tmp_path, kind, heads):
    """Heads 3: a reward-model ensemble (stages.reward.heads), its trained score rows merged too."""
    model = _tiny(kind, heads)
    model.save_pretrained(tmp_path / "base")
    peft = _trained(model, kind)
    lora.save_adapter(peft, tmp_path / "adapter")
    assert (tmp_path / "adapter" / lora.SAFE_ADAPTER).is_file()
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert not files & {"model.safetensors", *lora.PICKLED_ADAPTERS}  # the adapter only, as safetensors
    out = lora.merge_into(tmp_path / "base", tmp_path / "adapter", kind, tmp_path / "merged", pad_id=0,
                          num_labels=heads)
    x = torch.randint(1, 300, (2, 7))
    with torch.no_grad():
        merged = models.load_model(out, kind, 0, models.saved_heads(out))(input_ids=x).logits
        torch.testing.assert_close(merged, peft(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(models.load_model(tmp_path / "base", kind, 0, heads)(input_ids=x).logits,
                                  peft(input_ids=x).logits)


def test_the_policy_with_its_adapter_off_is_the_model_it_started_from():
    """PPO's LoRA reference: the SFT policy, from the policy's own weights (no second copy)."""
    sft = _tiny("causal")
    x = torch.randint(1, 300, (2, 9))
    with torch.no_grad():
        expected = sft(input_ids=x).logits.clone()
        policy = _trained(sft, "causal")
        assert not torch.allclose(policy(input_ids=x).logits, expected)
        with policy.disable_adapter():
            assert torch.equal(policy(input_ids=x).logits, expected)


def test_a_pickled_adapter_is_refused_naming_the_file(tmp_path):
    peft = _trained(_tiny("causal"), "causal")
    lora.save_adapter(peft, tmp_path)
    (tmp_path / lora.SAFE_ADAPTER).rename(tmp_path / "adapter_model.bin")
    with pytest.raises(ValueError, match="adapter_model.bin, a pickle file"):
        lora.load_adapter(peft, tmp_path)
    with pytest.raises(ValueError, match="adapter_model.bin"):
        lora.merge_into(tmp_path, tmp_path, "causal", tmp_path / "out")


def test_a_checkpoint_adapter_loads_back_into_a_fresh_wrap(tmp_path):
    trained = _trained(_tiny("causal"), "causal")
    lora.save_adapter(trained, tmp_path)
    fresh = lora.wrap(_tiny("causal"), lora.LoraSection(r=4, alpha=8), "causal")
    lora.load_adapter(fresh, tmp_path)
    x = torch.randint(1, 300, (1, 5))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=x).logits, trained(input_ids=x).logits)


def test_lora_config_in_every_training_role(tmp_path):
    cfg = smoke_config(tmp_path, "stages.sft.lora.r=8", "stages.reward.lora.target_modules=[q_proj,v_proj]",
                       "stages.ppo.policy.lora.alpha=16", "stages.ppo.critic.lora.dropout=0.1")
    assert cfg.stages.sft.lora.r == 8 and cfg.stages.sft.lora.target_modules == "all-linear"
    assert cfg.stages.reward.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.stages.ppo.policy.lora.alpha == 16 and cfg.stages.ppo.critic.lora.dropout == 0.1
    # a LoRA policy is its own reference: the reference's ranks are not reserved
    full = smoke_config(tmp_path)
    assert full.stages.ppo.cpus_needed() - cfg.stages.ppo.cpus_needed() == full.stages.ppo.reference.num_ranks
    assert full.stages.sft.lora is None


@pytest.mark.parametrize("override, expected", [
    ("stages.sft.lora.r=0", "stages.sft.lora.r: input should be greater than or equal to 1"),
    ("stages.reward.lora.target_modules=[]", "an empty list adapts nothing"),
    ("stages.ppo.policy.lora.rank=8", "stages.ppo.policy.lora.rank: unknown key"),
])
def test_lora_mistakes_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError) as exc:
        smoke_config(tmp_path, override)
    assert expected in str(exc.value)


def test_lora_with_zero3_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError) as exc:
        smoke_config(tmp_path, "stages.sft.lora.r=8", "stages.sft.deepspeed.zero_stage=3")
    assert "stages.sft" in str(exc.value) and "use zero_stage 2" in str(exc.value)


# --------------------------------------------------------------------------- the weight sync's chunks


def _joined(chunks) -> dict:
    out: dict = {}
    for chunk in chunks:
        assert not set(chunk) & set(out), "a weight given twice"
        out.update(chunk)
    return out


def test_groups_close_once_they_reach_the_budget_so_a_group_holds_less_than_budget_plus_one_piece():
    assert weight_chunks.groups([3, 3, 3, 10, 1], budget=5) == [[0, 1], [2, 3], [4]]
    assert weight_chunks.groups([10, 1], budget=5) == [[0], [1]]
    assert weight_chunks.groups([1, 1, 1], budget=100) == [[0, 1, 2]]
    assert weight_chunks.groups([], budget=5) == []


@pytest.mark.parametrize("lora_kind", [None, "causal", "sequence"])
def test_chunks_together_are_the_merged_weights_with_a_tied_weight_once(lora_kind):
    model = _tiny(lora_kind or "causal")
    model = _trained(model, lora_kind) if lora_kind else model
    whole = distinct(lora.merged_state_dict(model))  # what the whole-model sync sent
    chunks = list(weight_chunks.weight_chunks(model, zero3=False, budget=1))  # budget 1 byte: one piece per chunk
    assert len(chunks) == len(lora.pieces(model)) - (lora_kind != "sequence")  # lm_head: tied, given with embed
    joined = _joined(chunks)
    assert list(joined) == list(whole)  # same names, same order
    assert all(torch.equal(joined[k], whole[k]) for k in whole)
    assert "lm_head.weight" not in joined and "model.embed_tokens.weight" in joined
    assert not any(".lora_" in k or "base_layer" in k or "modules_to_save" in k for k in joined)
    if lora_kind:  # the adapted weights differ from the base's: merged, not the base alone
        base = lora.base_of(model).model.layers[0].self_attn.q_proj.base_layer.weight
        assert not torch.equal(joined["model.layers.0.self_attn.q_proj.weight"], base)
    one = list(weight_chunks.weight_chunks(model, zero3=False))  # the default budget: this tiny model in one chunk
    assert len(one) == 1 and list(one[0]) == list(whole)


class _OwnAndChildren(torch.nn.Module):
    """An attention with a weight of its own beside its projections' (as GPT-OSS's `sinks`)."""

    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(4))
        self.q_proj, self.k_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.attn = _OwnAndChildren()
        self.register_buffer("scale", torch.ones(4))


@pytest.mark.parametrize("kind", ["lora", "own_and_children"])
@pytest.mark.parametrize("budget", [1, 40_000])
def test_under_zero3_each_chunk_is_gathered_alone_and_whole_while_handed_over(monkeypatch, kind, budget):
    """A stand-in for DeepSpeed's GatheredParameters that partitions as ZeRO-3 does (a parameter is empty until
    gathered, and empty again after): every chunk is handed over whole while its gather is open, every parameter
    is gathered exactly once, and a gather holds less than the budget plus one piece."""
    import deepspeed

    torch.manual_seed(0)
    model = _trained(_tiny("causal"), "causal") if kind == "lora" else _Net()
    expected = {k: v.clone() for k, v in distinct(lora.merged_state_dict(model)).items()}
    params = {id(p): p for p in model.parameters()}
    full = {i: p.data for i, p in params.items()}
    sizes = {i: p.numel() * p.element_size() for i, p in params.items()}
    largest = max(weight_chunks.piece_bytes(m) for _, m in lora.pieces(model))
    calls = []

    @contextlib.contextmanager
    def gathered(group, modifier_rank=None, enabled=True):
        assert enabled and modifier_rank is None
        calls.append([id(p) for p in group])
        for p in group:
            p.data = full[id(p)]
        try:
            yield
        finally:
            for p in group:
                p.data = torch.empty(0)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", gathered)
    for p in params.values():
        p.ds_numel, p.data = p.numel(), torch.empty(0)  # the full size ZeRO-3 records, and this rank's partition
    joined = {}
    try:
        for chunk in weight_chunks.weight_chunks(model, zero3=True, budget=budget):
            joined.update({k: v.clone() for k, v in chunk.items()})  # as the engine loads it: while gathered
    finally:
        for i, p in params.items():
            p.data = full[i]
            del p.ds_numel
    assert list(joined) == list(expected)
    assert all(torch.equal(joined[k], expected[k]) for k in expected)  # whole, not released partitions
    assert len(calls) > 2 if budget == 1 or kind == "lora" else len(calls) == 1  # in chunks, unless it all fits one
    flat = [i for call in calls for i in call]
    assert sorted(flat) == sorted(sizes)  # each parameter once (the tied embedding too), none left out
    assert all(sum(sizes[i] for i in call) < budget + largest for call in calls)


def test_an_engine_loads_chunks_in_one_layerwise_reload():
    """RolloutEngine.load_weights: a whole dict is one call; chunks are begin, one call each, finish."""
    from stages.common.engines import RolloutEngine

    class FakeLLM:
        def __init__(self):
            self.calls = []

        def collective_rpc(self, method, args=()):
            self.calls.append((method, tuple(len(a) for a in args)))

        def reset_prefix_cache(self):
            self.calls.append(("reset_prefix_cache", ()))

    engine = object.__new__(RolloutEngine)
    engine.llm, engine.version = FakeLLM(), 0
    engine.load_weights({"a": 1, "b": 2}, version=1)
    assert engine.llm.calls == [("load_synced_weights", (2,)), ("reset_prefix_cache", ())] and engine.version == 1
    engine.llm.calls.clear()
    engine.load_weights(iter([{"a": 1}, {"b": 2, "c": 3}]), version=2)
    assert engine.llm.calls == [("begin_weight_sync", ()), ("load_weight_chunk", (1,)), ("load_weight_chunk", (2,)),
                                ("finish_weight_sync", ()), ("reset_prefix_cache", ())]
    assert engine.version == 2
    engine.llm.calls.clear()

    def failing():
        yield {"a": 1}
        raise RuntimeError("a rank died mid-sync")

    with pytest.raises(RuntimeError, match="mid-sync"):
        engine.load_weights(failing(), version=3)
    assert engine.llm.calls[-1] == ("finish_weight_sync", ()) and engine.version == 2  # reload closed, not tagged
