"""Pure parts of the data stage: split, assistant-span masks, packing."""

from stages.common import tasks
from stages.data import loss_mask, pack_rows, render_with_spans, split_of


def test_split_is_stable_and_close_to_the_fraction():
    keys = [f"prompt {i}" for i in range(4000)]
    splits = [split_of(k, 0, 0.1) for k in keys]
    assert splits == [split_of(k, 0, 0.1) for k in keys]
    assert 0.08 < splits.count("eval") / len(keys) < 0.12
    assert splits != [split_of(k, 1, 0.1) for k in keys]  # the seed matters


def _masked_text(tok, messages):
    text, spans = render_with_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = loss_mask(enc["offset_mapping"], spans)
    return tok.decode([t for t, m in zip(enc["input_ids"], mask) if m], skip_special_tokens=True), enc, mask


def test_mask_covers_exactly_the_assistant_replies(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4"},
        {"role": "user", "content": "And 3 + 4?"},
        {"role": "assistant", "content": "3 + 4 = 7"},
    ]
    decoded, enc, mask = _masked_text(tokenizer, messages)
    assert decoded == "2 + 2 = 43 + 4 = 7"
    # Each reply's end-of-turn token is trained too, so the model learns to stop.
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    trained_eos = [t for t, m in zip(enc["input_ids"], mask) if m and t == eos]
    assert len(trained_eos) == 2


def test_mask_on_generated_conversations(tokenizer):
    for row in tasks.sft_rows(50, 0, tasks.TaskConfig()):
        decoded, _, _ = _masked_text(tokenizer, row["messages"])
        assert decoded == row["messages"][1]["content"]


def test_packing_keeps_every_token_and_restarts_positions():
    rows = [([1] * n, [0] * (n - 2) + [1, 1]) for n in (5, 7, 3, 9, 4)]
    packed = pack_rows(rows, max_len=12)
    assert all(len(p["input_ids"]) <= 12 for p in packed)
    assert sum(len(p["input_ids"]) for p in packed) == sum(len(r[0]) for r in rows)
    assert sum(sum(p["loss_mask"]) for p in packed) == 2 * len(rows)
    assert packed[0]["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
