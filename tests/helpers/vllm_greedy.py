"""Greedy tokens of vLLM and of HF `generate` for the same local model (run as a script).

    python tests/helpers/vllm_greedy.py MODEL_DIR   ->  prints {"vllm": [[...]], "hf": [[...]]}

A script, not a test body: vLLM starts workers by spawn and needs the __main__ guard
(docs/architecture.md, fact 2); running it in its own process also keeps its memory out of pytest's.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(model_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 1 + 2?", "Compute 35 + 7.", "12 + 30 = ?")]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]

    llm = LLM(model=model_dir, dtype="float32", gpu_memory_utilization=0.3, max_model_len=128,
              distributed_executor_backend="uni", enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params)
    got = [list(o.outputs[0].token_ids) for o in outs]

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    hf = []
    for i in ids:
        out = model.generate(torch.tensor([i]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        hf.append(out[0, len(i):].tolist())
    print("RESULT " + json.dumps({"vllm": got, "hf": hf}))


if __name__ == "__main__":
    main(sys.argv[1])
