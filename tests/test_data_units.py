"""Pure parts of the data stage: split, assistant-span masks, packing."""

import json
import os

from stages.common import tasks
from stages.data.steps import loss_mask, pack_rows, render_with_spans, split_of


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


# A Qwen-style template: injects a default system turn and ends turns with "<|im_end|>\n".
OTHER_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_mask_with_a_template_that_adds_a_default_system_turn(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = OTHER_TEMPLATE
    messages = [{"role": "user", "content": "What is 5 + 5?"}, {"role": "assistant", "content": "5 + 5 = 10"},
                {"role": "user", "content": "And 6 + 1?"}, {"role": "assistant", "content": "6 + 1 = 7"}]
    decoded, enc, _ = _masked_text(tok, messages)
    assert "You are a helpful assistant." in tok.decode(enc["input_ids"])
    assert decoded == "5 + 5 = 106 + 1 = 7"


def test_empty_splits_are_errors_naming_the_fix():
    import pytest

    from pipeline.errors import DataError
    from stages.data import _check_not_empty

    counts = {"sft_train_rows": 5, "sft_eval_rows": 0, "sft_rows_bad": 0, "sft_rows_duplicate": 0,
              "sft_rows_too_long": 0}
    with pytest.raises(DataError, match="no sft rows left in the eval split.*eval_fraction"):
        _check_not_empty("sft", counts, had_input=True)
    _check_not_empty("sft", counts, had_input=False)  # a kind nobody asked for may be empty


def test_parquet_footer_readers_are_capped_at_the_file_count(tmp_path, monkeypatch):
    import ray.data

    from stages.common import parquet

    (tmp_path / "d" / "part=1").mkdir(parents=True)
    for name in ("a.parquet", "b.parquet", "part=1/c.parquet", "notes.txt"):
        (tmp_path / "d" / name).touch()
    assert parquet.footer_readers(tmp_path / "d") == 3
    assert parquet.footer_readers(tmp_path / "d" / "a.parquet") == 1
    assert parquet.footer_readers(tmp_path / "empty") == 1
    assert parquet.footer_readers("s3://bucket/data") is None

    seen = []  # what Ray's reader sees at planning time, and that the caller's environment is restored
    monkeypatch.setattr(ray.data, "read_parquet", lambda path: seen.append((path, os.environ.get(parquet.ENV))))
    monkeypatch.delenv(parquet.ENV, raising=False)
    parquet.read_parquet(tmp_path / "d")
    assert seen[-1] == (str(tmp_path / "d"), "3") and parquet.ENV not in os.environ
    monkeypatch.setenv(parquet.ENV, "7")  # the user's own setting wins
    parquet.read_parquet(tmp_path / "d")
    assert seen[-1][1] == "7" and os.environ[parquet.ENV] == "7"


def test_an_unpaired_row_is_one_conversation_with_its_absent_side_masked_out(tokenizer, tmp_path):
    """What the dpo stage's KTO reads (and the reward stage and the paired losses refuse): both sides hold the
    conversation, the desirable row's answer masked on the chosen side only, the undesirable's on the rejected."""
    from stages.data.steps import Tokenize

    tokenizer.save_pretrained(tmp_path)
    tok = Tokenize(str(tmp_path), 256, None)
    good, fits = tok._row("preference", {"prompt": "1 + 1?", "chosen": "2", "rejected": "", "label": True})
    bad, _ = tok._row("preference", {"prompt": "1 + 1?", "chosen": "", "rejected": "3", "label": False})
    assert fits and good["chosen_input_ids"] == good["rejected_input_ids"]
    assert any(good["chosen_loss_mask"]) and not any(good["rejected_loss_mask"])
    assert any(bad["rejected_loss_mask"]) and not any(bad["chosen_loss_mask"])
    answer = [t for t, m in zip(bad["rejected_input_ids"], bad["rejected_loss_mask"]) if m]
    assert tok.tok.decode(answer).startswith("3")


def test_tool_calls_need_a_template_that_renders_them(tokenizer, tmp_path):
    """A conversation with `tool_calls` is kept only where the model's chat template renders them: plain ChatML
    does not, so such a row is refused with its reason, never trained with the call dropped; the built-in
    template renders them (Hermes form) and trains the call as the assistant's."""
    import pytest

    from stages.data.steps import Tokenize
    from stages.data.formats import RowError

    tokenizer.save_pretrained(tmp_path)
    tok = Tokenize(str(tmp_path), 256, None)
    builtin = tok.tok.chat_template
    tok.tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # plain ChatML
    call = [{"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "calc", "arguments": {"expr": "2 + 2"}}}]},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(RowError, match="does not render tool_calls") as exc:
        tok._conversation(call)
    assert exc.value.code == "template_ignores_tools"
    # a template that renders tool calls keeps them, with the call's tokens trained as the assistant's
    tok.tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                             "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>{% endfor %}"
                             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids, mask = tok._conversation(call)
    trained = tok.tok.decode([t for t, m in zip(ids, mask) if m])
    assert "<call>calc</call>" in trained and "2 + 2?" not in trained
    tok.tok.chat_template = builtin
    ids, mask = tok._conversation(call)
    trained = tok.tok.decode([t for t, m in zip(ids, mask) if m])
    assert '<tool_call>{"name": "calc", "arguments": {"expr": "2 + 2"}}</tool_call>' in trained and \
        "2 + 2?" not in trained


def test_first_of_each_keeps_one_row_per_key_in_key_order():
    """The driver's dedupe (`stages.data._unique` on a small dataset): sorted by the keys, the first row of
    each distinct key kept, the other columns carried along, as Ray Data's groupby + `first_row` gives."""
    import pyarrow as pa

    from stages.data.steps import first_of_each

    t = pa.table({"kind": ["sft", "sft", "prompts", "sft", "prompts"], "order": ["b", "a", "c", "b", "c"],
                  "payload": ["x", "y", "z", "x", "w"], "source": ["1", "2", "3", "4", "5"]})
    out = first_of_each(t, ["kind", "order", "payload"]).to_pylist()
    assert [(r["kind"], r["order"], r["payload"]) for r in out] == [
        ("prompts", "c", "w"), ("prompts", "c", "z"), ("sft", "a", "y"), ("sft", "b", "x")]
    assert out[-1]["source"] in ("1", "4")  # one of the two equal rows, the other dropped
    assert first_of_each(t.slice(0, 1), ["kind"]).num_rows == 1 and first_of_each(t.slice(0, 0), ["kind"]).num_rows == 0


def test_a_tokenizing_process_loads_its_tokenizer_once_and_anew_when_the_model_changes(tokenizer, tmp_path,
                                                                                        monkeypatch):
    """`tokenize_batch` runs as Ray Data tasks: each process makes one `Tokenize` per model directory and
    keeps it for its later batches; a directory rewritten since (a forced model rerun) is loaded again."""
    import os

    import pyarrow as pa

    from stages.data import steps

    tokenizer.save_pretrained(tmp_path)
    made = []
    real = steps.Tokenize

    class Counted(real):
        def __init__(self, *args, **kwargs):
            made.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(steps, "Tokenize", Counted)
    monkeypatch.setattr(steps, "_TOKENIZERS", {})
    batch = pa.table({"kind": ["prompts"], "split": ["train"], "order": ["a"],
                      "payload": [json.dumps({"prompt": "1 + 1?", "answer": "2", "key": "1 + 1?"})]})
    first = steps.tokenize_batch(batch, str(tmp_path), 64, None)
    again = steps.tokenize_batch(batch, str(tmp_path), 64, None)
    assert len(made) == 1 and first.to_pylist() == again.to_pylist() and first["prompt_ids"][0].as_py()
    os.utime(tmp_path, ns=(0, os.stat(tmp_path).st_mtime_ns + 10**9))
    steps.tokenize_batch(batch, str(tmp_path), 64, None)
    assert len(made) == 2
