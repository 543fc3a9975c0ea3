"""PPO's generation requests: an iteration's prompts, sampled (seeded per iteration, so a resumed run sees
the same ones), sent to the engines through the policy ranks (`request`, which returns at once), and
waited for (`collect`, which restarts a dead engine and sends the request again). With `rollout.async`
the loop launches the next iteration's request before this one trains. `fill` is DAPO's dynamic
sampling: groups without a signal are replaced by fresh prompts' groups.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stages.ppo.config import PPOConfig

if TYPE_CHECKING:  # annotations only
    from stages.ppo.roles import Session


@dataclass
class Rollouts:
    """One iteration's generation request: launched on the engines (through the policy ranks),
    collected later; with `rollout.async` the next iteration's is launched before this one trains."""

    it: int
    rows: list[dict]  # one row per rollout; a prompt's samples adjacent
    sampling: dict
    refs: list  # one ref per policy rank
    launched: float = field(default_factory=time.time)
    restarts: int = 0  # the pool's engine restarts when it was launched: one restarted since gets it sent again
    generated: list[list[dict]] | None = None  # per prompt, its samples (once collected)
    wait_s: float = 0.0  # how long the loop waited for them
    scored: tuple | None = None  # scoring.training_rewards' columns, when dynamic sampling scored them already
    dynamic: dict = field(default_factory=dict)  # dynamic sampling's (and distillation's) metrics


def _sampling(cfg: PPOConfig, seed: int, it: int, refill: int = 0) -> dict:
    return {"n": cfg.sampling.n, "temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
            "max_tokens": cfg.sampling.max_new_tokens, "logprobs": 0,  # the sampled tokens' log-probs
            # vLLM seeds sample i of a request with seed + i: draw far-apart seeds per iteration (and refill)
            "seed": random.Random(f"ppo-sampling-{seed}-{it}" + (f"-{refill}" if refill else "")).randrange(2**31)}


def request(s: Session, cfg: PPOConfig, seed: int, it: int, fault_at: int, refill: int = 0) -> Rollouts:
    """Sample iteration `it`'s prompts (seeded per iteration and dynamic sampling's refill round, so a resumed
    run sees the same ones) and launch their generation with the weights the engines hold now."""
    n = cfg.sampling.n
    key = f"ppo-{seed}-{it}" + (f"-refill{refill}" if refill else "")
    rows = random.Random(key).sample(s.train_rows, cfg.prompts_per_iteration)
    rows = [r for r in rows for _ in range(n)]
    if it == fault_at and not refill:
        s.layout.kill_engine(0)
    sampling = _sampling(cfg, seed, it, refill)
    return Rollouts(it, rows, sampling, s.layout.rollouts(rows[::n], sampling, s.episode), restarts=s.layout.restarts)


def collect(s: Session, req: Rollouts, n: int, console) -> Rollouts:
    """Wait for a request's samples; a dead engine, or one the environment stalled, is restarted (with the
    last synced weights) and the request sent again (stages/ppo/episodes.py `retrying`)."""
    import ray

    from stages.ppo.episodes import retrying

    if req.generated is not None:
        return req
    t0 = time.time()
    sent = [req.refs]

    def once() -> list[list[dict]]:
        if not sent:  # a retry: the engines were restarted
            req.refs = s.layout.rollouts(req.rows[::n], req.sampling, s.episode)
        sent.clear()
        return [g for part in ray.get(req.refs) for g in part]

    # With rollout.async the request went out before the last weight sync, which may have restarted an engine
    # it was sent to (one killed after the previous request): `since` makes that a reason to send it again.
    req.generated = retrying(s.layout, once, s.episode, console, since=req.restarts)
    req.wait_s = time.time() - t0
    return req


def fill(s: Session, cfg: PPOConfig, seed: int, req: Rollouts, console) -> Rollouts:
    """DAPO's dynamic sampling: score the collected groups, and replace those whose samples all scored the same
    (no signal under a group baseline) by fresh prompts' groups, in up to `max_refills` rounds; still short,
    the batch is topped up with dropped groups. The request's rows and samples become the kept ones, with
    their scores (`req.scored`), so the batch keeps its size and nothing is scored twice."""
    import torch

    from stages.ppo.rl import dynamic_keep
    from stages.ppo.scoring import answers_of, joined_groups, keep_groups, training_rewards

    n, want = cfg.sampling.n, cfg.prompts_per_iteration
    kept: list = []
    dropped: list = []
    part, refills, share = req, 0, None
    while True:
        flat = [x for group in part.generated for x in group]
        scored = training_rewards(answers_of(s.tok, flat), part.rows, flat, s.role("reward"), cfg, s.rule,
                                  s.moments)
        keep = dynamic_keep(torch.tensor(scored[0]), n).tolist()
        share = sum(keep) / len(keep) if share is None else share  # of the iteration's own prompts
        keep_groups(part.generated, part.rows, scored, keep, n, kept, dropped)
        if len(kept) >= want or refills == cfg.dynamic_sampling.max_refills:
            break
        refills += 1
        part = collect(s, request(s, cfg, seed, req.it, -1, refill=refills), n, console)
    req.rows, req.generated, req.scored = joined_groups((kept + dropped)[:want])
    req.dynamic = {"dynamic_kept_share": share, "dynamic_refills": float(refills)}
    return req
