"""What a response scores, and whether PPO helped: the rule reward, the reward mix (with the reward
model's scores normalised and clipped if asked), the held-out evaluation before and after
training, the gold win-rate, and the statistics that compare them.

`score` is used every iteration and by `evaluate`; `compare` turns two evaluations into the
paired figures MLflow and `bench/learning.py` report (means, prompts up / down, sign test);
`gold_win_rate` judges the trained policy's sampled answers against the SFT policy's with the
task's gold preference (`task.preference.gold`), which no stage trains on.
"""

from __future__ import annotations

import math

from stages.common.evaluation import compare, sign_test_p  # noqa: F401  (shared with the dpo stage)
from stages.ppo.config import PPOConfig


def rule_reward(spec: str, verifier: str = "number", rewards=None, log=print):
    """The rule reward (`stages.ppo.rewards.rule`) as a `RuleReward`: `.scores(texts, rows)` for a batch,
    callable as (prompt, response, answer) -> float for one; `verifier` is the task's (`task.verifier`)."""
    from stages.ppo.rewards import RuleReward

    if rewards is None:
        return RuleReward(spec, verifier, log=log)
    return RuleReward(spec, verifier, rewards.workers, rewards.timeout_s, rewards.timeout_score, log=log,
                      max_error_share=rewards.max_error_share)


class RunningMoments:
    """Running mean and standard deviation of the reward model's scores (Chan et al.'s parallel update),
    for `rewards.normalize`: the scores are standardised by the statistics of every training batch so far
    (OpenRLHF's and TRL's reward normalisation). Evaluation uses them without updating them."""

    def __init__(self, count: float = 0.0, mean: float = 0.0, m2: float = 0.0):
        self.count, self.mean, self.m2 = count, mean, m2

    def update(self, xs: list[float]) -> None:
        n = len(xs)
        if not n:
            return
        mean = sum(xs) / n
        m2 = sum((x - mean) ** 2 for x in xs)
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0

    def state(self) -> list[float]:
        return [self.count, self.mean, self.m2]


def shape_model_scores(xs: list[float], moments: RunningMoments | None, clip: float | None) -> list[float]:
    """The reward model's scores as the policy sees them: standardised by `moments` (if normalising) and
    clipped to [-clip, clip] (if clipping). Both bound how far a policy can push a proxy it exploits."""
    if moments is not None:
        std = max(moments.std, 1e-6)
        xs = [(x - moments.mean) / std for x in xs]
    if clip is not None:
        xs = [min(max(x, -clip), clip) for x in xs]
    return xs


def request_model_scores(texts: list[str], rows: list[dict], reward_group, cfg: PPOConfig) -> list | None:
    """Start the reward model on the responses (one ref per rank; None without a reward model), so the
    caller can issue its other passes before waiting."""
    from stages.ppo.groups import shard

    if reward_group is None:
        return None
    pairs = [(r["prompt"], t) for t, r in zip(texts, rows)]
    return reward_group.run_each("scores", shard(pairs, len(reward_group)), micro=cfg.micro_batch_size)


def score(texts: list[str], rows: list[dict], reward_group, cfg: PPOConfig, rule, model_refs: list | None = None,
          moments: RunningMoments | None = None, update: bool = False
          ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(mixed score, verifier-style rule reward, the reward model's raw score, and its heads' spread) per
    response; the last two are [] without a reward model, the spread [] with one head. An ensemble's heads
    make one raw score by `rewards.ensemble`. `model_refs` from `request_model_scores` if the reward model
    was started already. With `rewards.normalize`, `moments` standardises the model's scores (`update`:
    first fold these scores in, as the training loop does)."""
    import ray

    from stages.common.training import ensemble_score, head_spread

    rule_scores = ([float(x) for x in rule.scores(texts, rows)] if hasattr(rule, "scores")  # a RuleReward
                   else [float(rule(r["prompt"], t, r.get("answer") or "")) for t, r in zip(texts, rows)])
    scores = [cfg.rewards.rule_weight * s for s in rule_scores]
    raw: list[float] = []
    spread: list[float] = []
    if reward_group is not None:
        parts = ray.get(model_refs or request_model_scores(texts, rows, reward_group, cfg))
        heads = [h for p in parts for h in p]
        raw = [ensemble_score(h, cfg.rewards.ensemble, cfg.rewards.ensemble_coef) for h in heads]
        spread = [head_spread(h) for h in heads] if heads and len(heads[0]) > 1 else []
        if moments is not None and update:
            moments.update(raw)
        shaped = shape_model_scores(raw, moments, cfg.rewards.clip)
        scores = [s + cfg.rewards.model_weight * m for s, m in zip(scores, shaped)]
    return scores, rule_scores, raw, spread


def accuracy_of(verify, texts: list[str], rows: list[dict]) -> list[float]:
    """Per response, 1.0 if the task's verifier accepts it: a built-in verifier called here, a user's one
    (a RuleReward) on its workers, timed and counted."""
    if hasattr(verify, "scores"):
        return [float(x) for x in verify.scores(texts, rows)]
    return [float(verify(t, r.get("answer") or "")) for t, r in zip(texts, rows)]


def failures_note(metrics: dict) -> str:
    """The progress line's account of failed calls of the user's code this iteration ("" when none)."""
    parts = [f"{metrics[k]:.0f} {label}" for k, label in (("rule_errors", "reward errors"),
                                                           ("rule_timeouts", "reward timeouts"),
                                                           ("env_errors", "environment errors")) if metrics.get(k)]
    return (" | " + ", ".join(parts)) if parts else ""


def generate(layout, rows: list[dict], sampling: dict, episode=None, say=print) -> list[dict]:
    """Every sample of every row's prompt from the engines' current weights, prompts spread over the
    engines (`layout.generate`); a prompt's `sampling['n']` samples adjacent. With `episode`, multi-turn
    episodes (followed: an engine stalled by the environment is killed, restarted and the request sent again)."""
    from stages.ppo.episodes import retrying

    return [s for group in retrying(layout, lambda: layout.generate(rows, sampling, episode, say), episode, say)
            for s in group]


def answers_of(tok, flat: list[dict]) -> list[str]:
    """The text each sample answers with: a multi-turn sample's last model turn (tool calls and outputs
    before it are how it got there), else the whole response."""
    return tok.batch_decode([x["ids"][slice(*x["final"])] if "final" in x else x["ids"] for x in flat],
                            skip_special_tokens=True)


def rollout_batch(rows: list[dict], flat: list[dict], pad_id: int) -> dict:
    """`rl.make_batch` of the samples, with a multi-turn sample's environment tokens masked out of
    `response_mask` (so out of the loss, the advantages, the KL and the log-prob mismatch)."""
    from stages.ppo.rl import make_batch, pad_rows

    batch = make_batch([r["prompt_ids"] for r in rows], [x["ids"] for x in flat], pad_id)
    if flat and "mask" in flat[0]:
        batch["response_mask"] = batch["response_mask"] * pad_rows([x["mask"] for x in flat],
                                                                   batch["response_mask"].shape[1])
    return batch


def episode_stats(flat: list[dict]) -> dict[str, float]:
    """Per-iteration tool metrics of multi-turn samples (empty for single-turn ones)."""
    if not flat or "turns" not in flat[0]:
        return {}
    n = len(flat)
    return {"turns_per_sample": sum(x["turns"] for x in flat) / n,
            "tool_calls_per_sample": sum(x["tool_calls"] for x in flat) / n,
            "tool_errors": float(sum(x["tool_errors"] for x in flat)),
            "tool_s": sum(x["tool_s"] for x in flat), "env_reward_mean": sum(x["env_reward"] for x in flat) / n,
            "env_errors": float(sum(bool(x.get("env_error")) for x in flat))}


def trajectories(rows: list[dict], flat: list[dict], scores: list[float], k: int, n: int) -> list[dict]:
    """The first sample of the first `k` prompts as whole conversations, for a person to read in MLflow."""
    return [{"prompt": rows[i]["prompt"], "answer": rows[i].get("answer"), "messages": flat[i]["messages"],
             "reward": round(scores[i], 4), "turns": flat[i]["turns"], "tool_errors": flat[i]["tool_errors"],
             "truncated": not flat[i]["finished"]} for i in range(0, min(k * n, len(flat)), n)]


def evaluate(layout, rows: list[dict], tok, reward_group, cfg: PPOConfig, rule, gold=None,
             moments: RunningMoments | None = None, verify=None, episode=None, budget=None, say=print
             ) -> tuple[dict[str, list[float]], list[list[float]] | None]:
    """Per held-out prompt: greedy answer's score and rule reward, and the means over `eval_samples` samples;
    `truncated` / `sampled_truncated`: the share of answers cut off by `sampling.max_new_tokens` (scored
    as given: counted and reported, so a length limit that cuts answers short shows). With a `gold`
    preference also `gold` / `sampled_gold`, and, second, every sampled answer's gold score per prompt
    (for `gold_win_rate`); else None.

    The engines answer with their current weights; sampling uses a fixed seed, so the SFT policy
    (before) and the trained one (after) draw from the same random stream.
    """

    def answers(sampling: dict, k: int) -> tuple[dict[str, list[float]], list[list[float]] | None]:
        flat = generate(layout, rows, sampling, episode, say)
        texts = answers_of(tok, flat)
        reps = [r for r in rows for _ in range(k)]
        if budget is not None:  # an environment that broke its protocol on too many episodes stops the stage
            budget.check_episodes(flat, rows)
        scores, correct, *_ = score(texts, reps, reward_group, cfg, rule, moments=moments)
        scores = with_env_reward(scores, flat, cfg)
        if verify is not None and verify is not rule:  # accuracy by the task's verifier, whatever the rule reward is
            correct = accuracy_of(verify, texts, reps)
        cut = [float(not s["finished"]) for s in flat]  # stopped by max_new_tokens, not by the model
        per = lambda xs: [xs[i * k:(i + 1) * k] for i in range(len(rows))]  # noqa: E731
        mean = lambda xs: [sum(p) / k for p in per(xs)]  # noqa: E731
        out = {"reward": mean(scores), "accuracy": mean(correct), "truncated": mean(cut)}
        if episode is not None:
            out["tool_calls"] = mean([float(s["tool_calls"]) for s in flat])
        if gold is None:
            return out, None
        golds = [float(gold(r["prompt"], t)) for t, r in zip(texts, reps)]
        return out | {"gold": mean(golds)}, per(golds)

    greedy = {"temperature": 0.0, "max_tokens": cfg.sampling.max_new_tokens}
    # with an environment the samples are episodes (`episode`) and `tool_calls` counts their calls
    out, each = answers(greedy, 1)
    if cfg.eval_samples:
        sampling = {"n": cfg.eval_samples, "temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
                    "max_tokens": cfg.sampling.max_new_tokens, "seed": 12345}
        sampled, each = answers(sampling, cfg.eval_samples)
        out |= {f"sampled_{k}": v for k, v in sampled.items()}
    return out, each


def with_env_reward(scores: list[float], flat: list[dict], cfg: PPOConfig) -> list[float]:
    """The scores plus `environment.reward_weight` x each episode's environment reward."""
    if cfg.environment is None or not cfg.environment.reward_weight:
        return scores
    return [s + cfg.environment.reward_weight * x["env_reward"] for s, x in zip(scores, flat)]


def with_overlong(scores: list[float], flat: list[dict], cfg: PPOConfig) -> list[float]:
    """The scores plus `overlong.penalty` x DAPO's soft overlong punishment of each response's length (all its
    tokens, an episode's environment tokens too: what `response_tokens()` bounds). Training rewards only."""
    from stages.ppo.rl import overlong_penalty

    if cfg.overlong.cache is None:
        return scores
    ramp = overlong_penalty([len(x["ids"]) for x in flat], cfg.response_tokens(), cfg.overlong.cache)
    return [s + cfg.overlong.penalty * r for s, r in zip(scores, ramp)]


def training_rewards(texts: list[str], rows: list[dict], flat: list[dict], reward_group, cfg: PPOConfig, rule,
                     moments: RunningMoments | None, model_refs: list | None = None
                     ) -> tuple[list[float], list[float], list[float], list[float]]:
    """`score` as the training loop uses it (the reward model's moments updated), plus the environment's
    reward and the overlong penalty: (reward, rule reward, reward model's raw score, heads' spread)."""
    scores, rule_scores, raw, spread = score(texts, rows, reward_group, cfg, rule, model_refs, moments, update=True)
    return with_overlong(with_env_reward(scores, flat, cfg), flat, cfg), rule_scores, raw, spread


def keep_groups(generated: list[list[dict]], rows: list[dict], scored: tuple, keep: list[bool], n: int,
                kept: list, dropped: list) -> None:
    """Dynamic sampling's sorting: each prompt's group (its n rows, samples and scored columns) into `kept` or
    `dropped` by `keep` (rl.dynamic_keep). A column without values (no reward model) stays empty."""
    for g, flag in enumerate(keep):
        columns = tuple(col[g * n:(g + 1) * n] for col in scored)
        (kept if flag else dropped).append((rows[g * n:(g + 1) * n], generated[g], columns))


def joined_groups(groups: list) -> tuple[list[dict], list[list[dict]], tuple]:
    """`keep_groups`' groups back into one request's rows, samples per prompt and scored columns."""
    rows = [r for g in groups for r in g[0]]
    generated = [g[1] for g in groups]
    scored = tuple([v for g in groups for v in g[2][i]] for i in range(len(groups[0][2])))
    return rows, generated, scored


def win_rate(before: list[float], after: list[float]) -> float:
    """How often an answer drawn from `after` beats one drawn from `before` by the gold scores: every pair
    compared, a tie counts a half (AlpacaFarm's win-rate)."""
    if not before or not after:
        return 0.5
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in after for b in before)
    return wins / (len(after) * len(before))


def gold_win_rate(before: list[list[float]], after: list[list[float]]) -> dict[str, float]:
    """The trained policy against the SFT policy on the held-out prompts, judged by the gold preference:
    `gold_winrate` (the mean over prompts of `win_rate`), the prompts where the trained policy wins (> 0.5)
    and loses (< 0.5), and the two-sided sign test over them (`gold_winrate_p`)."""
    rates = [win_rate(b, a) for b, a in zip(before, after)]
    wins, losses = sum(r > 0.5 for r in rates), sum(r < 0.5 for r in rates)
    return {"gold_winrate": sum(rates) / max(len(rates), 1), "gold_winrate_wins": wins,
            "gold_winrate_losses": losses, "gold_winrate_p": sign_test_p(wins, losses)}


def slope(values: list[float]) -> float:
    """Least-squares slope of a series against its index (the trend of the reward per iteration)."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def samples(rows: list[dict], texts: list[str], scores: list[float], correct: list[float], k: int, n: int) -> list:
    """The first sample of the first `k` prompts of an iteration, for a person to read in MLflow."""
    return [{"prompt": rows[i]["prompt"], "answer": rows[i].get("answer"), "response": texts[i],
             "reward": round(scores[i], 4), "rule_reward": correct[i]} for i in range(0, min(k * n, len(rows)), n)]


def plot_curve(points: list[dict], path) -> None:
    """The over-optimisation plot (Gao et al. 2022, figure 1): the held-out gold score and the reward
    model's score (the proxy) against the KL to the reference, one point per `eval_every`. Where gold
    turns down while the proxy still rises, the policy exploits the reward model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl = [p["kl"] for p in points]
    fig, gold_ax = plt.subplots(figsize=(6, 4))
    if any(p.get("gold") is not None for p in points):
        gold_ax.plot(kl, [p.get("gold") for p in points], "o-", color="tab:green", label="gold")
    gold_ax.set_xlabel("KL to the reference (nats per response)")
    gold_ax.set_ylabel("held-out gold score")
    if any(p.get("proxy") is not None for p in points):
        proxy_ax = gold_ax.twinx()
        proxy_ax.plot(kl, [p.get("proxy") for p in points], "s--", color="tab:blue", label="proxy (reward model)")
        proxy_ax.set_ylabel("held-out reward-model score")
        proxy_ax.legend(loc="lower right")
    gold_ax.legend(loc="upper left")
    for p in points:
        gold_ax.annotate(str(p["iteration"]), (p["kl"], p.get("gold") or 0), fontsize=7, alpha=0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curve_ends(curve: list[dict]) -> dict[str, float]:
    """The eval_every curve's first and last points as `curve_<measure>_first` / `_last` (accuracy, reward,
    response length, gold, proxy, KL): the run summary's "first -> last" of the held-out curve."""
    first, last = curve[0], curve[-1]
    return {f"curve_{k}_{end}": float(p[k]) for k in ("accuracy", "reward", "length", "gold", "proxy", "kl")
            for end, p in (("first", first), ("last", last)) if p.get(k) is not None}
