"""A few DeepSpeed ZeRO steps on a tiny causal LM in one process (run as a script), then a
checkpoint round trip through the pipeline's engine set-up (`training.init_engine`): the saved
checkpoint loads back, and the same checkpoint with a code-running pickle in place of its
optimizer states is refused without running that code.

    python tests/helpers/ds_step.py MODEL_DIR STAGE CKPT_DIR  ->  prints RESULT {"losses": [...], ...}
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                  LOCAL_RANK="0", WORLD_SIZE="1")


class _Planted:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def main(model_dir: str, stage: int, ckpt_dir: str) -> None:
    from stages.common.deepspeed import isolate_jit_builds

    isolate_jit_builds()  # the ops the pipeline's workers use (built at setup), not a second build
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
    }
    from stages.common.training import init_engine

    engine = init_engine(model, config)
    batch = torch.randint(5, model.config.vocab_size, (4, 24))
    losses = []
    for _ in range(8):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(ckpt_dir, tag="ds")
    engine.load_checkpoint(ckpt_dir, tag="ds", load_optimizer_states=True)
    resumed = engine(input_ids=batch, labels=batch).loss.item()

    from pathlib import Path

    marker = Path(ckpt_dir) / "planted-code-ran"
    for optim in Path(ckpt_dir, "ds").glob("*optim_states.pt"):
        torch.save({"optimizer_state_dict": _Planted(str(marker))}, optim)
    try:
        engine.load_checkpoint(ckpt_dir, tag="ds", load_optimizer_states=True)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    print("RESULT " + json.dumps({"losses": losses, "resumed_loss": resumed, "refused": refused,
                                  "planted_code_ran": marker.exists()}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
