"""What a response scores, and whether PPO helped: the rule reward, the reward mix, the held-out
evaluation before and after training, and the statistics that compare them.

`score` is used every iteration and by `evaluate`; `compare` turns two evaluations into the
paired figures MLflow and `bench/learning.py` report (means, prompts up / down, sign test).
"""

from __future__ import annotations

import importlib
import math

from pipeline.errors import UserError
from stages.ppo.config import PPOConfig


def rule_reward(spec: str):
    """The rule reward as a function (prompt, response, answer) -> float."""
    if spec == "verifier":
        from stages.common.tasks import verify

        return lambda prompt, response, answer: float(verify(response, answer))
    module, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"stages.ppo.rewards.rule: cannot load {spec!r} ({exc}); give 'verifier' or an importable "
                        "'module:function'") from None
    return fn


def request_model_scores(texts: list[str], rows: list[dict], reward_group, cfg: PPOConfig) -> list | None:
    """Start the reward model on the responses (one ref per rank; None without a reward model), so the
    caller can issue its other passes before waiting."""
    from stages.ppo.groups import shard

    if reward_group is None:
        return None
    pairs = [(r["prompt"], t) for t, r in zip(texts, rows)]
    return reward_group.run_each("scores", shard(pairs, len(reward_group)), micro=cfg.micro_batch_size)


def score(texts: list[str], rows: list[dict], reward_group, cfg: PPOConfig, rule,
          model_refs: list | None = None) -> tuple[list[float], list[float]]:
    """(mixed score, verifier-style rule reward) per response; `model_refs` from `request_model_scores`
    if the reward model was started already."""
    import ray

    rule_scores = [float(rule(r["prompt"], t, r.get("answer") or "")) for t, r in zip(texts, rows)]
    scores = [cfg.rewards.rule_weight * s for s in rule_scores]
    if reward_group is not None:
        parts = ray.get(model_refs or request_model_scores(texts, rows, reward_group, cfg))
        scores = [s + cfg.rewards.model_weight * m for s, m in zip(scores, [x for p in parts for x in p])]
    return scores, rule_scores


def evaluate(pool, rows: list[dict], tok, reward_group, cfg: PPOConfig, rule) -> dict[str, list[float]]:
    """Per held-out prompt: greedy answer's score and rule reward, and the means over `eval_samples` samples;
    `truncated` / `sampled_truncated`: the share of answers cut off by `sampling.max_new_tokens` (scored
    as given: counted and reported, so a length limit that cuts answers short shows).

    The engines answer with their current weights; sampling uses a fixed seed, so the SFT policy
    (before) and the trained one (after) draw from the same random stream.
    """
    import ray

    from stages.ppo.groups import shard

    def answers(sampling: dict, k: int) -> tuple[list[float], list[float], list[float]]:
        parts = shard([r["prompt_ids"] for r in rows], len(pool.engines))
        outs = ray.get([e.generate.remote(p, sampling) for e, p in zip(pool.engines, parts) if p])
        flat = [s for part in outs for group in part for s in group]
        texts = tok.batch_decode([s["ids"] for s in flat], skip_special_tokens=True)
        scores, correct = score(texts, [r for r in rows for _ in range(k)], reward_group, cfg, rule)
        cut = [float(not s["finished"]) for s in flat]  # stopped by max_new_tokens, not by the model
        mean = lambda xs: [sum(xs[i * k:(i + 1) * k]) / k for i in range(len(rows))]  # noqa: E731
        return mean(scores), mean(correct), mean(cut)

    greedy = {"temperature": 0.0, "max_tokens": cfg.sampling.max_new_tokens}
    out = dict(zip(("reward", "accuracy", "truncated"), answers(greedy, 1)))
    if cfg.eval_samples:
        k = cfg.eval_samples
        sampling = {"n": k, "temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
                    "max_tokens": cfg.sampling.max_new_tokens, "seed": 12345}
        out["sampled_reward"], out["sampled_accuracy"], out["sampled_truncated"] = answers(sampling, k)
    return out


def slope(values: list[float]) -> float:
    """Least-squares slope of a series against its index (the trend of the reward per iteration)."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def sign_test_p(improved: int, worsened: int) -> float:
    """Two-sided exact sign test: how likely this split of changed answers is under 'no effect'."""
    n = improved + worsened
    if n == 0:
        return 1.0
    k = min(improved, worsened)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, float]:
    """Held-out metrics before/after PPO, with a paired sign test per measure over the prompts.

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


def samples(rows: list[dict], texts: list[str], scores: list[float], correct: list[float], k: int, n: int) -> list:
    """The first sample of the first `k` prompts of an iteration, for a person to read in MLflow."""
    return [{"prompt": rows[i]["prompt"], "answer": rows[i].get("answer"), "response": texts[i],
             "reward": round(scores[i], 4), "rule_reward": correct[i]} for i in range(0, min(k * n, len(rows)), n)]
