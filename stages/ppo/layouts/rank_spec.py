"""What a rank of a role sets up with (`PPOWorker.setup`), in either layout: its model, DeepSpeed config and LoRA."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from pathlib import Path

# cfg is a PPOConfig throughout; it is not imported here, not even for annotations: config.py asks the
# layouts (a light class method) at validation, and an import back would close a circle of imports.


def role_spec(layout, name: str, role, kind: str, model_dir: Path, cfg, trainable: bool, gpu: bool,
              pad_id: int, seed: int, run_storage) -> dict:
    """What a rank of `role` sets up with (`PPOWorker.setup`) in `layout`: its model, DeepSpeed config and LoRA."""
    from stages.common.deepspeed import engine_config, use_bf16

    bf16 = use_bf16(role.deepspeed, gpu)
    ds_config = engine_config(role.deepspeed, cfg.micro_batch_size, role.num_ranks, bf16, cfg.mini_batch_size,
                              role.lr, role.weight_decay, role.grad_clip) if trainable \
        else engine_config(role.deepspeed, cfg.micro_batch_size, role.num_ranks, bf16)  # no optimizer
    # the policy's ranks also hold the frozen reference (reference.colocate, or the colocated layout; not LoRA's)
    in_rank = name == "policy" and layout.reference_in_ranks(cfg)
    return {"role": name, "kind": kind, "model_dir": str(model_dir), "trainable": trainable, "pad_id": pad_id,
            "seed": seed, "storage": run_storage, "activation_checkpointing": role.deepspeed.activation_checkpointing,
            "zero_head": kind == "value" and cfg.critic_zero_init, "ds_config": ds_config,
            "lora": role.lora.model_dump(mode="json") if trainable and role.lora else None,
            "reference_dir": str(model_dir) if in_rank else None}
