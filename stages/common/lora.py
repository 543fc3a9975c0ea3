"""LoRA adapters (PEFT) for every training role: sft, reward, and PPO's policy and critic.

A role with a `lora:` section trains low-rank adapters on its linear layers instead of every
weight; a sequence classifier (reward model, critic) also trains its score head in full (PEFT's
`modules_to_save`: a head of one output per score head has no low-rank form worth having). What each stage does with
the adapter:

- sft / reward: checkpoints hold the adapter only (PEFT's safetensors, `adapter/`) and DeepSpeed's
  optimizer state, never a copy of the base; when the stage ends the adapter is merged into its base
  (`merge_into`), so downstream stages, the registry and serving get an ordinary HF model. The
  adapter is kept beside it (`<stage output>/adapter`) for base + adapter serving.
- ppo policy: the reference is the same model with the adapter switched off (`disable_adapter`):
  the SFT policy without a second copy of its weights. The rollout engines get the *merged*
  weights after each update through the zero-copy sync (`merged_state_dict`): see
  docs/architecture.md for why not a vLLM LoRA adapter.

Why PEFT rather than our own low-rank layers: it is what users' checkpoints and vLLM / Ray Serve
LLM's LoRA loading read, and its `all-linear` targeting knows each architecture's output layer.
ZeRO-3 is refused with LoRA: merging and the reference's disabled adapter read whole weights,
and with a frozen base ZeRO-2 already shards everything that grows (optimizer state, gradients).
"""

from __future__ import annotations

import re
from pathlib import Path

from stages.common.deepspeed import LoraSection, describe, zero3_problem  # noqa: F401  (the typed config)

ADAPTER_DIR = "adapter"  # where a checkpoint or a stage output keeps the adapter
SAFE_ADAPTER = "adapter_model.safetensors"
PICKLED_ADAPTERS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")


# --------------------------------------------------------------------------- wrapping


def wrap(model, lora: LoraSection, kind: str, activation_checkpointing: bool = False):
    """`model` with LoRA adapters (a PEFT model); `kind` 'causal' or 'sequence' (a classifier with an
    output per score head, whose score head trains in full)."""
    from peft import LoraConfig, TaskType, get_peft_model

    if activation_checkpointing:
        model.enable_input_require_grads()  # a frozen embedding would otherwise cut the recomputed graph
    task = TaskType.CAUSAL_LM if kind == "causal" else TaskType.SEQ_CLS
    return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=lora.target_modules, task_type=task))


def is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # a bare GPU machine without PEFT (scripts/gpu_parts.py): no model there has adapters
        return False
    return isinstance(model, PeftModel)


def _lora_layer() -> type:
    """PEFT's LoRA layer class; without PEFT installed a class no module is an instance of (as `is_peft`)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return type("NoLoraLayer", (), {})
    return LoraLayer


def base_of(model):
    """The HF model under a PEFT wrapper (with its adapters injected), or `model` itself."""
    return model.get_base_model() if is_peft(model) else model


def merged_state_dict(model) -> dict:
    """Full weights under HF names with the active adapter merged in, without changing `model`.

    Each adapted layer's weight is `base + delta` (PEFT's own `get_delta_weight`); a trained score
    head's copy replaces the original. Merging in place and unmerging after would leave `base`
    off by rounding at every sync, drifting over a run: this reads, it never writes. A plain
    (non-PEFT) model returns its own state dict."""
    if not is_peft(model):
        return model.state_dict()
    return {k: v for name, module in pieces(model) for k, v in piece_weights(name, module)}


def pieces(model) -> list[tuple[str, object]]:
    """The modules that hold the model's weights, in state-dict order: an adapted layer whole (its base
    weight and its adapter merge into one weight), else each module with parameters or persistent buffers
    of its own. PEFT's frozen copy of a trained head (`original_module`) is left out. The weight sync
    (stages/ppo/weight_chunks.py) gathers and merges them a few at a time instead of the whole model."""
    layer_type = _lora_layer()
    out: list[tuple[str, object]] = []
    inside = None  # the adapted layer whose submodules are already part of its piece
    for name, module in base_of(model).named_modules():
        if inside is not None and name.startswith(inside):
            continue
        inside = None
        if ".original_module" in f".{name}":
            continue
        if isinstance(module, layer_type):
            out.append((name, module))
            inside = f"{name}."
        elif any(p is not None for p in module._parameters.values()) or _persistent_buffers(module):
            out.append((name, module))
    return out


def piece_params(module) -> list:
    """The parameters one of `pieces` gives: an adapted layer's all (base and adapter), else the module's own
    (its children with weights are pieces of their own)."""
    return list(module.parameters(recurse=isinstance(module, _lora_layer())))


def piece_weights(name: str, module, seen: set[int] | None = None):
    """(HF name, tensor) for one of `pieces`: an adapted layer's weight as base + delta (a new tensor, this
    layer's only). With `seen`, a parameter already given (a tied head) is given once."""
    layer_type = _lora_layer()
    prefix = f"{name}." if name else ""
    if isinstance(module, layer_type):
        active = not module.disable_adapters and module.active_adapters
        delta = sum(module.get_delta_weight(a) for a in module.active_adapters) if active else None
        weight = _hf_name(f"{prefix}weight")
        for key, value in module.state_dict(prefix=prefix).items():
            if ".lora_" in key:
                continue
            hf = _hf_name(key)
            yield hf, value + delta.to(value.dtype) if delta is not None and hf == weight else value
        return
    for key, param in module._parameters.items():
        if param is None or (seen is not None and id(param) in seen):
            continue
        if seen is not None:
            seen.add(id(param))
        yield _hf_name(prefix + key), param.detach()
    for key, buffer in _persistent_buffers(module):
        yield _hf_name(prefix + key), buffer.detach()


def _persistent_buffers(module) -> list:
    return [(k, b) for k, b in module._buffers.items() if b is not None and k not in module._non_persistent_buffers_set]


def _hf_name(key: str) -> str:
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", key.replace(".base_layer.", "."))


# --------------------------------------------------------------------------- adapter files


def save_adapter(model, directory: Path) -> None:
    """The adapter (and a trained score head) as safetensors, with PEFT's adapter_config.json."""
    model.save_pretrained(str(directory), safe_serialization=True)


def adapter_problem(directory: Path) -> str | None:
    """Why `directory` is not an adapter we load (None if it is): safetensors only."""
    if not (directory / "adapter_config.json").is_file():
        return f"{directory} has no adapter_config.json: not a PEFT adapter directory"
    if not (directory / SAFE_ADAPTER).is_file():
        pickled = [n for n in PICKLED_ADAPTERS if (directory / n).is_file()]
        if pickled:
            return (f"{directory} holds its adapter as {pickled[0]}, a pickle file, which can run code when loaded; "
                    f"only {SAFE_ADAPTER} is read. Convert it once with PEFT: "
                    "PeftModel.from_pretrained(base, dir).save_pretrained(dir, safe_serialization=True)")
        return f"{directory} has no {SAFE_ADAPTER}"
    return None


def load_adapter(model, directory: Path) -> None:
    """Load a saved adapter's weights into a PEFT model of the same shape (resuming)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    problem = adapter_problem(directory)
    if problem:
        raise ValueError(problem)
    set_peft_model_state_dict(model, load_file(str(directory / SAFE_ADAPTER)))


def merge_into(base_dir: str | Path, adapter_dir: Path, kind: str, out: Path, pad_id: int | None = None,
               num_labels: int = 1) -> Path:
    """Base + adapter merged into one ordinary HF model at `out` (safetensors); `num_labels` is a sequence
    classifier's outputs (the adapter's trained score head has that many rows)."""
    from peft import PeftModel

    problem = adapter_problem(adapter_dir)
    if problem:
        raise ValueError(problem)
    from stages.common.models import load_model

    model = PeftModel.from_pretrained(load_model(base_dir, kind, pad_id, num_labels), str(adapter_dir),
                                      is_trainable=False)
    model.merge_and_unload().save_pretrained(out, safe_serialization=True)
    return out


def trainable_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def exclude_tied_frozen_weights(engine) -> None:
    """Make DeepSpeed's `exclude_frozen_parameters` also drop frozen *tied* weights.

    DeepSpeed removes the names `named_parameters()` lists, which lists a tied weight once: the
    output layer tied to the frozen input embeddings stayed in every LoRA checkpoint, a full copy of
    the embedding matrix (113 MB for SmolLM2-135M). Patched on the engine instance, not the class."""
    if getattr(engine, "_frozen_tied_excluded", False):
        return
    original = type(engine).module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters=False, **kwargs):
        state = original(engine, *args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name, p in engine.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    state.pop(name, None)
        return state

    engine.module_state_dict = module_state_dict
    engine._frozen_tied_excluded = True
