"""Packed SFT rows (`stages.data.pack`): each conversation in a row sees only itself.

The model is the project's tiny LLaMA (`models.build_model`, random weights, fp32) on conversations of
the generated task, tokenized and masked as the data stage does and packed by its `pack_rows`. The
reference is each conversation run alone, unpadded, through the model.
"""

import numpy as np
import pytest
import torch

from stages.common import models, tasks
from stages.data.steps import loss_mask, pack_rows, render_with_spans
from stages.sft import _eval_loss, collate, forward

TOL = 1e-5


def _conversations(tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of `n` generated conversations, as the data stage's `Tokenize` makes them."""
    out = []
    for row in tasks.sft_rows(n, 0, tasks.TaskConfig(max_digits=2)):
        text, spans = render_with_spans(tokenizer, row["messages"])
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        out.append((enc["input_ids"], loss_mask(enc["offset_mapping"], spans)))
    return out


def _model(tokenizer, attn: str):
    cfg = models.BuiltinModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                    num_kv_heads=2, max_position_embeddings=256)
    model = models.build_model(cfg, tokenizer, seed=0).float().eval()
    model.set_attn_implementation(attn)
    return model


def _rows(packed: list[dict]) -> dict:
    """Packed rows as the training loop reads them from Parquet (numpy object columns)."""
    return {k: np.array([np.array(p[k]) for p in packed], dtype=object)
            for k in ("input_ids", "loss_mask", "position_ids")}


def _packed_batch(convs, max_len: int):
    packed = pack_rows(convs, max_len)
    assert len(packed) >= 2 and max(p["position_ids"].count(0) for p in packed) >= 3  # several per row
    assert len({len(p["input_ids"]) for p in packed}) > 1  # rows of different lengths: padding at the end
    return packed, _rows(packed)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_conversations_do_not_attend_to_each_other(tokenizer, attn):
    """The logits of a packed row equal, to 1e-5, the logits of each of its conversations run alone;
    padding at the end of a shorter row changes nothing and gives no NaN."""
    model = _model(tokenizer, attn)
    convs = _conversations(tokenizer, 8)
    packed, rows = _packed_batch(convs, max_len=96)
    batch = collate(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = forward(model, batch).logits
        plain = model(**batch).logits  # what SFT did before: a 2-D mask, so one causal mask over the whole row
    assert torch.isfinite(logits).all()
    k, worst, crossed = 0, 0.0, 0.0
    for r, p in enumerate(packed):
        starts = [i for i, pos in enumerate(p["position_ids"]) if pos == 0] + [len(p["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            ids = convs[k][0]
            assert p["input_ids"][a:b] == ids
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([ids])).logits[0]
            worst = max(worst, (logits[r, a:b] - alone).abs().max().item())
            crossed = max(crossed, (plain[r, a:b] - alone).abs().max().item())
            k += 1
    assert k == len(convs)
    assert worst < TOL, f"packed conversations see each other: max |logit difference| {worst:.2e}"
    assert crossed > 1e-2  # the test can tell: without the block mask the later conversations differ


def test_packed_loss_is_the_loss_of_the_conversations_alone(tokenizer):
    """No target crosses a boundary: the packed batch's loss is the token-weighted mean of each
    conversation's own loss, also for a conversation whose first token is in its loss mask (a reply
    first), which would otherwise be predicted from the previous conversation's last token."""
    model = _model(tokenizer, "sdpa")
    convs = _conversations(tokenizer, 8)
    convs[3] = (convs[3][0], [1] + convs[3][1][1:])  # first token trained: a boundary label if not dropped
    packed, rows = _packed_batch(convs, max_len=96)
    batch = collate(rows, tokenizer.pad_token_id)
    first = batch["position_ids"] == 0
    assert (batch["labels"][first] == -100).all()
    assert int(batch["attention_mask"].sum()) == sum(len(ids) for ids, _ in convs)  # tokens/s counts real tokens
    total = count = 0.0
    with torch.no_grad():
        for ids, mask in convs:
            alone = collate({"input_ids": [np.array(ids)], "loss_mask": [np.array(mask)]}, tokenizer.pad_token_id)
            n = float((alone["labels"][:, 1:] != -100).sum())
            total, count = total + float(forward(model, alone).loss) * n, count + n
        packed_loss = float(forward(model, batch).loss)
        assert float((batch["labels"] != -100).sum()) == count
        assert packed_loss == pytest.approx(total / count, abs=TOL)
        # The eval loop of the sft stage goes through the same forward pass.
        assert _eval_loss(model, [batch]) == pytest.approx(total / count, abs=TOL)


def test_collate_of_packed_rows_keeps_positions_and_drops_boundary_targets():
    rows = {"input_ids": np.array([np.array([5, 6, 7, 8, 9]), np.array([3, 4])], dtype=object),
            "loss_mask": np.array([np.array([1, 1, 1, 1, 1]), np.array([0, 1])], dtype=object),
            "position_ids": np.array([np.array([0, 1, 2, 0, 1]), np.array([0, 1])], dtype=object)}
    out = collate(rows, pad_id=0)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]]  # padding: sequences of one token
    assert out["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 4, -100, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
