"""A tiny Llama for the oracle tests against TRL (tests/test_dpo_oracle.py, tests/test_grpo_oracle.py): a
character-level tokenizer and a random 2-layer fp32 model saved to a directory, so TRL's trainers can load it
by path; no network."""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PERTURB = 0.05  # std of the noise added to the policy's weights after the reference is made


def tiny_model_dir(path):
    """A character-level tokenizer (pad, eos, no bos) and a random 2-layer fp32 Llama, saved to `path`."""
    chars = list("abcdefghijklmnopqrstuvwxyz .,?!0123456789")
    vocab = {tok: i for i, tok in enumerate(["<pad>", "</s>", "<unk>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, attn_implementation="eager"))
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return tokenizer


def load(path):
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def perturb(model) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * PERTURB)


def loss_and_grads(model, compute):
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


