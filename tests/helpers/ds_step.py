"""A few DeepSpeed ZeRO steps on a tiny causal LM in one process (run as a script).

    python tests/helpers/ds_step.py MODEL_DIR STAGE   ->  prints RESULT {"losses": [...]}
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                  LOCAL_RANK="0", WORLD_SIZE="1")


def main(model_dir: str, stage: int) -> None:
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
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batch = torch.randint(5, model.config.vocab_size, (4, 24))
    losses = []
    for _ in range(8):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    print("RESULT " + json.dumps({"losses": losses}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
