"""PPO's held-out evaluation beyond the one before training: the over-optimisation curve every
`eval_every` iterations (`curve_point`), and at the end the exported policy scored against the SFT
policy's answers (`finish`: paired sign tests, gold win-rate, the curve as a plot).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stages.ppo.config import PPOConfig

if TYPE_CHECKING:  # annotations only
    from pipeline.stage import StageContext
    from stages.ppo.roles import Session


def curve_point(s: Session, cfg: PPOConfig, ref, ref_call: str, it: int, trend: dict, ctx: StageContext) -> None:
    """One point of the over-optimisation curve, on the first `curve_prompts` held-out prompts with
    `curve_samples` samples each from the engines' current weights: the reward model's mean score
    (the proxy), the mean training reward, the mean gold score and the KL to the reference per
    response (k1 summed over the response, from the engines' and the reference's log-probs of the
    sampled tokens). Logged as heldout_* at step `it` and kept in `trend['curve']` (checkpointed)."""
    import ray
    import torch

    from stages.ppo.rl import pad_rows
    from stages.ppo.scoring import accuracy_of, answers_of, generate, rollout_batch, score, with_env_reward
    from stages.ppo.worker import shard_batch

    rows = s.eval_rows[: cfg.curve_prompts]
    if not rows or any(p["iteration"] == it for p in trend["curve"]):
        return
    k = cfg.curve_samples
    sampling = {"n": k, "temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
                "max_tokens": cfg.sampling.max_new_tokens, "logprobs": 0, "seed": 54321}
    flat = generate(s.layout, rows, sampling, s.episode, ctx.progress)
    reps = [r for r in rows for _ in range(k)]
    texts = answers_of(s.tok, flat)
    batch = rollout_batch(reps, flat, s.tok.pad_token_id)
    ref_refs = ref.run_each(ref_call, shard_batch(batch, len(ref)), micro=cfg.micro_batch_size)
    scores, _, raw, spread = score(texts, reps, s.role("reward"), cfg, s.rule, moments=s.moments)
    scores = with_env_reward(scores, flat, cfg)
    mask = batch["response_mask"]
    policy_lp = pad_rows([x["logprobs"] for x in flat], mask.shape[1])
    ref_lp = torch.cat(ray.get(ref_refs))
    kl = float(((policy_lp - ref_lp) * mask).sum(1).mean())
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    point = {"iteration": it, "kl": kl, "reward": mean(scores), "proxy": mean(raw) if raw else None,
             "gold": mean([float(s.gold(r["prompt"], t)) for t, r in zip(texts, reps)]) if s.gold else None,
             "rm_spread": mean(spread) if spread else None,
             "accuracy": mean(accuracy_of(s.verify, texts, reps)) if s.verify and any(r.get("answer") for r in rows)
             else None,
             "length": mean([float(len(x["ids"])) for x in flat])}
    trend["curve"].append(point)
    ctx.log_metrics({f"heldout_{k}": v for k, v in point.items() if k != "iteration" and v is not None}, step=it)
    ctx.progress(f"held-out curve at iteration {it}: kl {kl:.3f}, reward {point['reward']:.3f}"
                 + (f", accuracy {point['accuracy']:.3f}" if point["accuracy"] is not None else "")
                 + f", length {point['length']:.1f}"
                 + (f", proxy {point['proxy']:.3f}" if raw else "") + (f", gold {point['gold']:.3f}" if s.gold else ""))


# --------------------------------------------------------------------------- the end: export and evaluate


def finish(s: Session, cfg: PPOConfig, ctx: StageContext, before: dict | None, metrics: dict,
            trend: dict) -> tuple[Path, dict]:
    """Export the trained policy as an HF model, and score it on the held-out prompts against `before`."""
    import ray

    from stages.ppo.scoring import compare, curve_ends, evaluate, gold_win_rate, plot_curve, slope

    out = ctx.out_dir / "model"
    ray.get(s.role("policy").run("save_hf", str(out)))
    ctx.storage.pull_path(out)  # with an object store: rank 0 may have written it on another node
    s.tok.save_pretrained(out)
    if cfg.policy.lora:  # the adapter too, on the SFT model as its base: served as base + adapter
        from stages.common.lora import ADAPTER_DIR

        ray.get(s.role("policy").run("save_adapter", str(ctx.out_dir / ADAPTER_DIR)))
        ctx.storage.pull_path(ctx.out_dir / ADAPTER_DIR)
        s.tok.save_pretrained(ctx.out_dir / ADAPTER_DIR)
    final = dict(metrics)
    if trend["reward"]:  # the run's learning curve in two numbers (over every iteration, resumed ones too)
        final.update(reward_slope=slope(trend["reward"]), kl_max=max(trend["kl"]))
    if trend["curve"]:  # the over-optimisation curve as one picture on the stage's run
        final.update(curve_ends(trend["curve"]))
        plot = ctx.out_dir / "overoptimisation.png"
        plot_curve(trend["curve"], plot)
        ctx.log_artifact(plot)
        ctx.log_dict(trend["curve"], "overoptimisation.json")
    if before is not None:
        before, before_gold = before
        after, after_gold = evaluate(s.layout, s.eval_rows, s.tok, s.role("reward"), cfg, s.rule, s.gold, s.moments,
                                     s.verify,
                                     s.episode, s.env_budget, ctx.progress)
        final.update(eval_prompts=len(s.eval_rows), **compare(before, after))
        if before_gold is not None and after_gold is not None:  # sampled answers, judged by the gold preference
            final.update(gold_win_rate(before_gold, after_gold))
            ctx.progress(f"held-out gold win-rate against the SFT policy ({len(s.eval_rows)} prompts, "
                         f"{cfg.eval_samples} samples each): {final['gold_winrate']:.3f} ({final['gold_winrate_wins']} "
                         f"prompts won, {final['gold_winrate_losses']} lost, sign test p "
                         f"{final['gold_winrate_p']:.2g})")
        for key in (k for k in before if not k.endswith("truncated")):
            ctx.progress(f"held-out {key.replace('_', ' ')} ({len(s.eval_rows)} prompts): "
                         f"{final[f'eval_{key}_before']:.3f} -> {final[f'eval_{key}']:.3f} "
                         f"({final[f'eval_{key}_improved']} prompts up, {final[f'eval_{key}_worsened']} down, "
                         f"sign test p {final[f'eval_{key}_sign_test_p']:.2g})")
        cut = {k: (final[f"eval_{k}_before"], final[f"eval_{k}"]) for k in ("truncated", "sampled_truncated")
               if k in before}
        if any(v for pair in cut.values() for v in pair):
            ctx.progress("held-out answers cut off at sampling.max_new_tokens="
                         f"{cfg.sampling.max_new_tokens} (scored as given): " + ", ".join(
                             f"{k.replace('_', ' ')} {b:.1%} -> {a:.1%}" for k, (b, a) in cut.items()))
    final["engine_restarts"] = s.layout.restarts
    final.update(s.rule.totals() if hasattr(s.rule, "totals") else {})  # failed calls of your code, if any
    if s.env_budget is not None and s.env_budget.failed:
        final["env_errors_total"] = s.env_budget.failed
    return out, final
