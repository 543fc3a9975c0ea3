"""The policy's weights for the rollout engines, a few layers at a time.

A weight sync used to gather the whole model at once under ZeRO-3 and, with LoRA, to build a merged copy of
every adapted weight before the engines saw any: a full model's extra memory on the device at every sync.
TRL's colocate mode gathers one parameter at a time (`_sync_fsdp_params_to_vllm`/`GatheredParameters([p])`);
OpenRLHF broadcasts one at a time. Here the model's weight-holding modules (`lora.pieces`: an adapted layer
whole, so its merge stays local) are grouped up to `CHUNK_BYTES` and each group is gathered, merged and
handed on alone, so the extra memory is one chunk (plus its largest piece), not the model.

Why chunks rather than single parameters: each chunk is one call into vLLM's worker (`load_weight_chunk`)
and one ZeRO-3 collective; at ~one transformer layer per chunk the calls cost nothing next to the copy, and
a 135M model syncs in a handful of calls instead of hundreds.

Every rank runs the same loop: under ZeRO-3 each gather is a collective all ranks enter in the same order.
"""

from __future__ import annotations

from typing import Iterator

CHUNK_BYTES = 256 * 2**20  # a 7B model's layer in bf16 is ~0.4 GiB: about one layer per chunk at that size


def groups(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of consecutive `sizes` grouped greedily: a group closes once it holds `budget` bytes or more, so
    it holds less than `budget` plus its last piece."""
    out: list[list[int]] = []
    current, held = [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        held += size
        if held >= budget:
            out.append(current)
            current, held = [], 0
    if current:
        out.append(current)
    return out


def piece_bytes(module) -> int:
    """A piece's full size in bytes, also while ZeRO-3 holds only this rank's partition (`ds_numel`)."""
    from stages.common.lora import piece_params

    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in piece_params(module))


def weight_chunks(model, zero3: bool, budget: int = CHUNK_BYTES) -> Iterator[dict]:
    """{HF name: tensor} chunks that together are `lora.merged_state_dict(model)` with each tied weight once.

    A chunk is valid only until the next one is asked for: under ZeRO-3 its parameters are released then
    (the caller loads or copies it first, as `ColocatedRank.sync_engine` and `PPOWorker.export_weights` do)."""
    import deepspeed

    from stages.common.lora import piece_params, piece_weights, pieces

    parts = pieces(model)
    seen: set[int] = set()  # parameters already given: a tied head is sent once
    gathered: set[int] = set()  # ... and gathered once
    for group in groups([piece_bytes(m) for _, m in parts], budget):
        params = [p for i in group for p in piece_params(parts[i][1]) if id(p) not in gathered]
        params = list({id(p): p for p in params}.values())
        gathered.update(id(p) for p in params)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero3):
            chunk = {k: v for i in group for k, v in piece_weights(*parts[i], seen=seen)}
            if chunk:
                yield chunk
