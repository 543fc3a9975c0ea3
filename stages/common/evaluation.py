"""Held-out evaluation shared by the stages that train a policy (sft, dpo, ppo): answers from vLLM
engine actors, and the paired sign test that says whether training changed them.

    outs = engine_answers([start_dir, tuned_dir], prompt_ids, [greedy, sampled], seed)
    outs[model][sampling][prompt] -> (texts, cut off)      # one text per sample
    compare({"accuracy": before}, {"accuracy": after})  -> eval_accuracy_before, eval_accuracy, ..._sign_test_p

The engine is the ppo stage's rollout actor (`stages.common.engines`), reused as is: the same
settings (fp32, whole-prompt prefill, safetensors only) as PPO's held-out evaluation, so the
stages' accuracies come from the same kind of engine.
"""

from __future__ import annotations

import math
from pathlib import Path


def engine_answers(model_dirs: list[Path], prompt_ids: list[list[int]], samplings: list[dict], seed: int,
                   storage=None, own_prompt_ids: list[list[list[int]]] | None = None
                   ) -> list[list[list[tuple[list[str], list[bool]]]]]:
    """Each model's answers to every prompt under each sampling (vLLM `SamplingParams` fields: `n`,
    `temperature`, `max_tokens`, `seed`, ...): per model, per sampling, per prompt (texts, cut off by
    `max_tokens`), each model's decoded by its own tokenizer. One engine actor per model; they start and
    answer concurrently, as many at a time as the cluster holds (`engines_at_once`), and are shut down
    before this returns, also on failure. `own_prompt_ids`: per model, the prompts as its own tokenizer
    encodes them (models of different runs), else `prompt_ids`."""
    import ray

    from stages.common.devices import cluster_gpus
    from stages.common.engines import EngineSpec, RolloutEngine
    from stages.common.models import load_tokenizer

    per_model = [[list(p) for p in ids] for ids in (own_prompt_ids or [prompt_ids] * len(model_dirs))]
    longest = max(s["max_tokens"] for s in samplings)
    gpu = cluster_gpus() > 0  # the cluster's GPUs, not this driver's (stages/common/devices.py)
    spec = EngineSpec(max_model_len=max(len(p) for ids in per_model for p in ids) + longest, seed=seed, gpu=gpu,
                      dtype="bfloat16" if gpu else "float32",  # vLLM's GPU attention backends: fp16/bf16
                      gpu_memory_utilization=0.9 if gpu else 0.3, storage=storage)  # on a GPU it has to itself
    actor = ray.remote(RolloutEngine).options(num_cpus=spec.num_cpus, num_gpus=1 if spec.gpu else 0,
                                              runtime_env=spec.runtime_env())
    outs: list = []
    # As many engines at once as the cluster can place: a third engine on two CPUs waited for a slot that
    # the other two, alive until every answer was in, never gave back (the caller hung on its answers).
    wave = engines_at_once(ray.cluster_resources() if ray.is_initialized() else {}, spec.num_cpus, spec.gpu)
    for start in range(0, len(model_dirs), wave):
        engines = [actor.remote(str(d), spec, 0) for d in model_dirs[start:start + wave]]
        try:
            pending = [[e.generate.remote(ids, s) for s in samplings]
                       for e, ids in zip(engines, per_model[start:start + wave])]
            outs += [ray.get(refs) for refs in pending]
        finally:
            for e in engines:
                ray.kill(e)

    def decode(tok, groups):
        return [(tok.batch_decode([g["ids"] for g in group], skip_special_tokens=True),
                 [not g["finished"] for g in group]) for group in groups]

    toks = {str(d): load_tokenizer(d) for d in model_dirs}
    return [[decode(toks[str(d)], groups) for groups in per_sampling] for d, per_sampling in zip(model_dirs, outs)]


def engines_at_once(resources: dict[str, float], num_cpus: float, gpu: bool) -> int:
    """How many engine actors the cluster's `resources` (`ray.cluster_resources()`; none known: one at a
    time) hold side by side: at least one, so that an engine asking for more than there is fails in Ray's
    own words, not here."""
    if not resources:
        return 1
    per = [resources.get("CPU", 0.0) / num_cpus] if num_cpus else []
    if gpu:
        per.append(resources.get("GPU", 0.0))
    return max(1, int(min(per))) if per else 1


def per_prompt_accuracy(answers: list[tuple[list[str], list[bool]]], rows: list[dict], verifier: str) -> list[float]:
    """Per prompt row (`answer`), the share of its answers the task verifier (`task.verifier`) accepts."""
    from stages.common.verifiers import verifier_function

    verify = verifier_function(verifier)
    return [sum(float(verify(t, r.get("answer") or "")) for t in texts) / max(len(texts), 1)
            for (texts, _), r in zip(answers, rows)]


def sign_test_p(improved: int, worsened: int) -> float:
    """Two-sided exact sign test: how likely this split of changed answers is under 'no effect'."""
    n = improved + worsened
    if n == 0:
        return 1.0
    k = min(improved, worsened)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Two policies' per-prompt values of one metric on the same prompts: their means, the difference b - a,
    the prompts where b is higher (`won`) and lower (`lost`), and the sign test over those (ties drop out)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired values need the same prompts: got {len(a)} and {len(b)}")
    won, lost = sum(y > x for x, y in zip(a, b)), sum(y < x for x, y in zip(a, b))
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    return {"a": mean_a, "b": mean_b, "diff": mean_b - mean_a, "won": float(won), "lost": float(lost),
            "p": sign_test_p(won, lost)}


def compare(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, float]:
    """Held-out metrics before/after training, with a paired sign test per measure over the prompts.

    For each measure M: `eval_M_before`, `eval_M` (means over prompts), `eval_M_improved` /
    `eval_M_worsened` (prompts whose value rose / fell) and `eval_M_sign_test_p`.
    """
    out: dict[str, float] = {}
    for key, b in before.items():
        a = after[key]
        up, down = sum(x < y for x, y in zip(b, a)), sum(x > y for x, y in zip(b, a))
        out.update({f"eval_{key}_before": sum(b) / len(b), f"eval_{key}": sum(a) / len(a),
                    f"eval_{key}_improved": up, f"eval_{key}_worsened": down,
                    f"eval_{key}_sign_test_p": sign_test_p(up, down)})
    return out
