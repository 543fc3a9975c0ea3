"""What packing SFT conversations (`stages.data.pack`) costs and saves: padding and training tokens/s.

    .venv/bin/python bench/packing_bench.py [--config configs/recipes/verifier.yaml] [--rows 4096] [--steps 30]

Builds the config's built-in model and tokenizer, generates its task's SFT conversations and
tokenizes, masks and truncates them as the data stage does (`Tokenize`), then packs them as the data
stage does (`pack_rows` per Ray Data batch of `stages.data.batch_size` rows). Both sets of rows are
collated into the sft stage's micro-batches (`stages.sft.micro_batch_size` rows) and trained on with
the sft stage's `collate` and `forward` in one process (fp32 AdamW; no Ray, no DeepSpeed: the same
model arithmetic, without their fixed costs). Unpacked and packed steps alternate in rounds, so
both see the same machine. A third mode trains unpacked micro-batches holding as many conversations
as the packed ones (micro_batch_size x conversations per packed row): it separates what packing saves
in padding and per-step overhead from what it gains by putting more conversations into each step.
Reports padding (share of the batch tensors' tokens that are padding), real tokens per second
(conversation tokens, padding excluded) and the ratios against unpacked.
Prints a markdown block for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rows_of(cfg, n: int, tokenizer_dir: str) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of `n` generated conversations, tokenized and truncated by the data stage's code."""
    from stages.common import tasks
    from stages.data.steps import Tokenize

    tok = Tokenize(tokenizer_dir, cfg.stages.data.max_len, cfg.stages.data.system_prompt)
    out = []
    for row in tasks.sft_rows(n, cfg.seed, cfg.task):
        r, fits = tok._row("sft", {**row, "key": ""})
        if fits:
            out.append((r["input_ids"], r["loss_mask"]))
    return out


def micro_batches(rows: list[dict], micro: int, pad_id: int) -> list[dict]:
    import numpy as np

    from stages.sft import collate

    out = []
    for i in range(0, len(rows) - len(rows) % micro, micro):
        chunk = rows[i : i + micro]
        out.append(collate({k: np.array([np.array(r[k]) for r in chunk], dtype=object) for k in chunk[0]}, pad_id))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/recipes/verifier.yaml")
    ap.add_argument("--rows", type=int, default=4096, help="generated conversations")
    ap.add_argument("--steps", type=int, default=30, help="measured micro-batches per mode (after 3 warm-up ones)")
    args = ap.parse_args()

    import torch

    from pipeline.config import load_config
    from stages.common import models, tasks
    from stages.data.steps import pack_rows
    from stages.sft import forward

    cfg = load_config(ROOT / args.config, [])
    torch.set_num_threads(os.cpu_count() or 1)
    data, sft = cfg.stages.data, cfg.stages.sft
    with tempfile.TemporaryDirectory() as d:
        tok = models.build_tokenizer(tasks.corpus(cfg.task, cfg.seed), cfg.model.builtin.vocab_size)
        tok.save_pretrained(d)
        tok = models.load_tokenizer(d)
        rows = rows_of(cfg, args.rows, d)
    plain = [{"input_ids": ids, "loss_mask": mask} for ids, mask in rows]
    packed = [p for i in range(0, len(rows), data.batch_size)
              for p in pack_rows(rows[i : i + data.batch_size], data.max_len)]
    per_row = round(len(plain) / len(packed))  # conversations per packed row
    modes = {"unpacked": micro_batches(plain, sft.micro_batch_size, tok.pad_token_id),
             "packed": micro_batches(packed, sft.micro_batch_size, tok.pad_token_id),
             # as many conversations per micro-batch as packed rows hold: what padding and masking cost alone
             f"unpacked, {per_row}x rows": micro_batches(plain, per_row * sft.micro_batch_size, tok.pad_token_id)}

    torch.manual_seed(cfg.seed)
    model = models.build_model(cfg.model.builtin, tok, cfg.seed).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr)

    def step(batch) -> float:
        t0 = time.perf_counter()
        loss = forward(model, batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    stats = {m: {"busy": 0.0, "tokens": 0, "slots": 0, "n": 0} for m in modes}
    for m, batches in modes.items():  # warm-up: allocations, oneDNN kernels for each shape
        for b in batches[:3]:
            step(b)
    rounds, per_round = 3, max(1, args.steps // 3)
    for r in range(rounds):
        for m, batches in modes.items():
            for b in batches[3 + r * per_round : 3 + (r + 1) * per_round]:
                s = stats[m]
                s["busy"] += step(b)
                s["tokens"] += int(b["attention_mask"].sum())
                s["slots"] += b["input_ids"].numel()
                s["n"] += 1
    out = {}
    for m, s in stats.items():
        batches = modes[m]
        out[m] = {"rows": len(packed if m == "packed" else plain), "micro": len(batches), "steps": s["n"],
                  "micro_rows": batches[0]["input_ids"].shape[0],
                  "tokens_per_s": s["tokens"] / s["busy"], "padding": 1 - s["tokens"] / s["slots"],
                  "width": sum(b["input_ids"].shape[1] for b in batches) / len(batches),
                  "tokens_per_micro": sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)}
    ratio = out["packed"]["tokens_per_s"] / out["unpacked"]["tokens_per_s"]
    n_params = models.count_parameters(model)
    lines = "\n".join(
        f"| {m} | {o['rows']} | {o['micro_rows']} | {o['width']:.0f} | {o['tokens_per_micro']:.0f} | "
        f"{o['padding']:.1%} | "
        f"{o['tokens_per_s']:.0f} | {o['tokens_per_s'] / out['unpacked']['tokens_per_s']:.2f}x |"
        for m, o in out.items())
    print(f"""
### SFT packing, {args.config}, {len(rows)} conversations, {n_params / 1e6:.2f}M-parameter LLaMA, \
{time.strftime('%Y-%m-%d')}

stages.sft.micro_batch_size {sft.micro_batch_size}, max_len {data.max_len}, {out['packed']['steps']} measured steps \
per mode

| rows | rows in all | rows per micro-batch | mean width | real tokens per micro-batch | padding | real tokens/s | \
vs unpacked |
| --- | --- | --- | --- | --- | --- | --- | --- |
{lines}

packed / unpacked real tokens/s: {ratio:.2f}x at {sft.micro_batch_size} rows per micro-batch; \
{out['packed']['tokens_per_s'] / out[f'unpacked, {per_row}x rows']['tokens_per_s']:.2f}x against unpacked \
micro-batches \
of {per_row * sft.micro_batch_size} rows (as many conversations)
""")


if __name__ == "__main__":
    import machine  # bench/machine.py: the machine's speed, printed before any figure

    machine.announce()
    main()
