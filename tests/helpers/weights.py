"""Checkpoints for tests that need a model whose greedy answers differ from prompt to prompt."""

from __future__ import annotations

from pathlib import Path


def redraw(model_dir: Path, std: float = 0.4, seed: int = 1) -> Path:
    """Redraw every weight matrix of the checkpoint in `model_dir` from N(0, std), in place.

    The smoke models answer every prompt with one repeated token; with larger random weights a tiny
    model's greedy answers vary, so comparing two generators on them means something."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.save_pretrained(model_dir)
    return model_dir
