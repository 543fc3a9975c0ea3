"""`python -m pipeline compare A B`: two trained policies answer the same held-out prompts, paired.

Each run's stages report a sign test against their own start; two runs (two configs, two methods) were
compared only by eye. Here both policies answer every held-out prompt of their (shared) data stage, greedy
and `samples` times with one fixed seed, so they draw from the same random stream. Per metric the pipeline
judges by (the task verifier's accuracy; the gold preference's score when the task has one; the reward
model's score with the reward model the runs trained against, or `--reward-model`), the command prints and logs
to MLflow: each policy's mean, the difference B - A, the prompts B won and lost, and the two-sided exact
sign test over the prompts that differ (`stages.common.evaluation.paired`).

A and B: a run directory (its newest finished policy: ppo, dpo or sft; `DIR:STAGE` picks the stage), a
stage's artifact directory (`<run_dir>/artifacts/<stage>/<key>`), or the MLflow run id of a pipeline run or of
one of its stage runs. A pair whose held-out prompts differ, whose task verifiers or gold preferences differ,
or a policy trained with an environment (multi-turn episodes: not compared here) is refused, naming why.

The two policies are found by stages/common/runs.py (files and MLflow only; a distillation teacher is found
the same way). Sections here: what the two share (prompts, task, reward model), answering (vLLM engines on Ray:
the held-out evaluation's `engine_answers`), scoring, and the command.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from stages.common.runs import Policy, find_policy

# --------------------------------------------------------------------------- what the two policies share


def shared_task(a: Policy, b: Policy) -> tuple[str, str | None]:
    """The task both policies are judged by: (verifier, gold preference or None); refused when they differ."""
    verifiers = {p.config.get("task.verifier", "number") for p in (a, b)}
    if len(verifiers) > 1:
        raise UserError(f"the runs' task verifiers differ ({a.given}: {a.config.get('task.verifier')}, {b.given}: "
                        f"{b.config.get('task.verifier')}): accuracy would mean two things; compare runs of one task")
    golds = {p.config["task.preference"].get("gold") for p in (a, b) if p.config.get("task.preference")} - {None}
    if len(golds) > 1:
        raise UserError(f"the runs' gold preferences differ ({', '.join(sorted(golds))}): the gold score would mean "
                        "two things; compare runs of one task")
    return verifiers.pop(), (golds.pop() if golds else None)


def shared_prompts(a: Policy, b: Policy) -> tuple[list[dict], list[dict]]:
    """The held-out prompt rows both policies answer, each side's own (its data stage tokenized them for its
    model: two runs' tokenizers may differ): the same prompts in the same order, or a refusal."""
    from stages.common.parquet import read_rows

    rows = {}
    for p in (a, b):
        if not p.data_key or not p.prompts_dir.is_dir():
            raise UserError(f"{p.given}: its held-out prompts ({p.prompts_dir}) are not on this machine; compare "
                            "where the run was made")
        rows[p.given] = read_rows(p.prompts_dir)
    ra, rb = rows[a.given], rows[b.given]
    if [r["prompt"] for r in ra] != [r["prompt"] for r in rb]:
        diff = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x["prompt"] != y["prompt"]), min(len(ra), len(rb)))
        raise UserError(
            f"the runs were evaluated on different held-out prompts: {a.given} has {len(ra)} (data {a.data_key}), "
            f"{b.given} has {len(rb)} (data {b.data_key}), first different at prompt {diff + 1}. A paired test needs "
            "the same prompts: compare runs made with the same stages.data settings and seed")
    if not ra:
        raise UserError(f"the runs' held-out prompt set ({a.prompts_dir}) is empty: nothing to compare on")
    return ra, rb


def shared_reward_model(a: Policy, b: Policy, given: str | None) -> Path | None:
    """The reward model both are scored by: --reward-model, else the one they trained against (one side's, if
    only one trained against one: a judge scores both alike), else None (two different ones: no common judge)."""
    if given:
        path = Path(given).expanduser().absolute()
        if not (path / "config.json").is_file():
            raise UserError(f"--reward-model {given}: not a model directory (no config.json)")
        return path
    from pipeline.storage import artifact_dir, output_paths

    found = {p.manifest["components"].get("upstream", {}).get("reward_model"): p.run_dir for p in (a, b)}
    found.pop(None, None)
    if len(found) != 1:
        return None
    [(key, run_dir)] = found.items()
    manifest = _read_reward_manifest(run_dir, key)
    return output_paths(manifest, artifact_dir(run_dir, "reward", key))["reward_model"] if manifest else None


def _read_reward_manifest(run_dir: Path, key: str) -> dict | None:
    try:
        return json.loads((run_dir / "artifacts" / "reward" / key / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- answering and scoring


def score_answers(answers, rows: list[dict], verifier: str, gold, reward) -> dict[str, list[float]]:
    """Per prompt, the mean of each metric over its answers (`engine_answers`' texts): `accuracy` by the task
    verifier, `gold` by the gold preference, `reward` by the reward model (a callable on (prompt, text) pairs)."""
    from stages.common.evaluation import per_prompt_accuracy

    out = {"accuracy": per_prompt_accuracy(answers, rows, verifier)}
    if gold is not None:
        out["gold"] = [sum(float(gold(r["prompt"], t)) for t in texts) / max(len(texts), 1)
                       for (texts, _), r in zip(answers, rows)]
    if reward is not None:
        scores = reward([(r["prompt"], t) for (texts, _), r in zip(answers, rows) for t in texts])
        out["reward"], i = [], 0
        for texts, _ in answers:
            out["reward"].append(sum(scores[i:i + len(texts)]) / max(len(texts), 1))
            i += len(texts)
    return out


def reward_scorer(reward_dir: Path):
    """The reward model in this process, scoring (prompt, response) pairs as in its training (an ensemble: its
    heads' mean); None without one."""
    from stages.common.models import load_model, load_tokenizer, saved_heads
    from stages.common.training import ensemble_score, reward_scores

    tok = load_tokenizer(reward_dir)
    model = load_model(reward_dir, "sequence", tok.pad_token_id, saved_heads(reward_dir)).eval()
    return lambda pairs: [ensemble_score(h) for h in reward_scores(model, tok, pairs, micro=64)]


# --------------------------------------------------------------------------- the command


def compare_runs(a_given: str | Policy, b_given: str | Policy, *, samples: int = 8, prompts: int | None = None,
                 max_tokens: int | None = None, temperature: float = 1.0, seed: int = 12345,
                 reward_model: str | None = None, tracking_uri: str | None = None, log_to: str | None = None,
                 experiment: str = "posttrain", ray_cfg=None, log=print) -> dict[str, Any]:
    """The whole comparison; returns {"a", "b", "prompts", "metrics": {name: paired stats}, "run_id"}.
    `tracking_uri`: where MLflow run ids are looked up; `log_to`: the store the comparison's run goes to
    (default: `tracking_uri`, else A's run directory's)."""
    from pipeline.cluster import ensure_ray, shutdown_ray
    from pipeline.config import RayConfig
    from stages.common.evaluation import engine_answers, paired
    from stages.common.tasks import gold_function

    # A or B as the user gave them, or as `find_policy` found them already (the command line: A's run directory
    # holds the comparison's log), so an MLflow run id is not looked up twice
    a, b = (p if isinstance(p, Policy) else find_policy(p, tracking_uri) for p in (a_given, b_given))
    for p in (a, b):
        if p.stage == "ppo" and p.config.get("stages.ppo", {}).get("environment"):
            raise UserError(f"{p.given}: its policy was trained with an environment (multi-turn episodes); compare "
                            "answers single-turn prompts only")
    if (a.stage, a.key, a.run_dir) == (b.stage, b.key, b.run_dir):
        raise UserError(f"{a.given} and {b.given} are the same policy ({a.stage} {a.key}): nothing to compare")
    verifier, gold_spec = shared_task(a, b)
    rows, rows_b = (side[:prompts] for side in shared_prompts(a, b))
    reward_dir = shared_reward_model(a, b, reward_model)
    # one limit for both (a paired test), the longer of their training settings: neither is cut short
    tokens = max_tokens or max(_max_tokens(a) or 0, _max_tokens(b) or 0) or 64
    log(f"A = {a.describe()}")
    log(f"B = {b.describe()}")
    log(f"{len(rows)} held-out prompts, greedy and {samples} samples each (temperature {temperature}, seed {seed}, "
        f"at most {tokens} tokens); metrics: accuracy ({verifier})" + (f", gold ({gold_spec})" if gold_spec else "")
        + (f", reward ({reward_dir})" if reward_dir else ", no reward (no reward model common to both runs; "
                                                         "--reward-model DIR)"))
    samplings = [{"temperature": 0.0, "max_tokens": tokens},
                 {"n": samples, "temperature": temperature, "top_p": 1.0, "max_tokens": tokens, "seed": seed}]
    started = ensure_ray(ray_cfg or RayConfig())
    t0 = time.time()
    try:  # both policies at once, an engine each
        answers = engine_answers([a.model_dir, b.model_dir], [], samplings[:1 + bool(samples)], seed,
                                 own_prompt_ids=[[r["prompt_ids"] for r in side] for side in (rows, rows_b)])
    finally:
        if started:
            shutdown_ray()
    log(f"answered in {time.time() - t0:.0f}s; scoring")
    gold = gold_function(gold_spec) if gold_spec else None
    reward = reward_scorer(reward_dir) if reward_dir else None
    metrics: dict[str, dict] = {}
    for side_answers, prefix in zip(zip(*answers), ("", "sampled_")):
        sa, sb = (score_answers(x, rows, verifier, gold, reward) for x in side_answers)
        metrics |= {prefix + name: paired(sa[name], sb[name]) for name in sa}
    result = {"a": a.describe(), "b": b.describe(), "prompts": len(rows), "metrics": metrics}
    store = log_to or tracking_uri or f"sqlite:///{a.run_dir / 'mlflow.db'}"
    result["run_id"] = _log_to_mlflow(a, b, result, store, experiment, {
        "samples": samples, "max_tokens": tokens, "temperature": temperature, "seed": seed})
    return result


def _max_tokens(p: Policy) -> int | None:
    if p.stage == "ppo":
        return p.config.get("stages.ppo", {}).get("sampling", {}).get("max_new_tokens")
    return p.config.get(f"stages.{p.stage}", {}).get("max_new_tokens")


def _log_to_mlflow(a: Policy, b: Policy, result: dict, tracking_uri: str, experiment: str, params: dict) -> str:
    """One MLflow run named `compare`: the two policies as tags, every paired statistic as a metric."""
    from pipeline.tracking import Tracker, log_params

    tracker = Tracker(tracking_uri, experiment, a.run_dir, run_name="compare",
                      tags={"compare_a": result["a"], "compare_b": result["b"], "kind": "compare"})
    log_params(tracker.client, tracker.parent_id, {**params, "prompts": result["prompts"]})
    tracker.log_metrics(tracker.parent_id, {f"{name}_{stat}": value for name, stats in result["metrics"].items()
                                            for stat, value in stats.items()})
    tracker.log_dict(tracker.parent_id, result, "compare.json")
    tracker.end(tracker.parent_id)
    return tracker.parent_id


def print_comparison(result: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"B vs A on {result['prompts']} held-out prompts (paired sign test)")
    for col in ("metric", "A", "B", "B - A", "B won", "B lost", "p"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for name, s in result["metrics"].items():
        table.add_row(name, f"{s['a']:.4f}", f"{s['b']:.4f}", f"{s['diff']:+.4f}", f"{s['won']:.0f}",
                      f"{s['lost']:.0f}", f"{s['p']:.3g}")
    console.print(table)


# --------------------------------------------------------------------------- the command

DESCRIPTION = ("Both policies answer every held-out prompt of their shared data stage (greedy, and --samples samples "
               "from one seed). A and B: a run directory (its newest ppo, dpo or sft policy; DIR:STAGE picks one), a "
               "stage's artifact directory (<run_dir>/artifacts/<stage>/<key>), or an MLflow run id.")


def add_arguments(parser) -> None:
    """`python -m pipeline compare A B [--config YAML] [--samples N] ...`."""
    parser.add_argument("a", metavar="A", help="the first policy (the baseline)")
    parser.add_argument("b", metavar="B", help="the second policy (what the differences are of: B - A)")
    parser.add_argument("--config", type=Path, help="a pipeline YAML whose mlflow and ray settings to use (default: "
                        "MLFLOW_TRACKING_URI, else A's run directory's store; a local Ray)")
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per prompt besides the greedy one "
                        "(default 8; 0: greedy only)")
    parser.add_argument("--prompts", type=int, help="compare on the first N held-out prompts only (default: all)")
    parser.add_argument("--max-tokens", type=int, help="tokens per answer at most, for both (default: the longer of "
                        "their training settings)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--seed", type=int, default=12345, help="the sampling seed both policies share (default 12345)")
    parser.add_argument("--reward-model", help="a reward model directory to score both with (default: the one both "
                        "runs trained against, if they share one)")
    parser.add_argument("--tracking-uri", help="the MLflow store of run ids and of the comparison's run")
    parser.add_argument("--json", dest="json_out", action="store_true",
                        help="print the result as JSON on stdout (progress on stderr)")
    parser.add_argument("--verbose", action="store_true", help="also show library output (Ray, vLLM, MLflow) live; "
                        "it always goes to A's <run_dir>/logs/compare.log")


def main(args, cfg, console) -> int:
    """The command: `cfg` is None (it takes no pipeline config argument; `--config` names one)."""
    import os
    import sys

    from pipeline import console as console_mod

    for flag, value, low in (("--samples", args.samples, 0), ("--prompts", args.prompts, 1),
                             ("--max-tokens", args.max_tokens, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} {value}: must be at least {low}")
    if args.config is not None:
        from pipeline.config import load_config

        cfg = load_config(args.config, [])
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (cfg.tracking_uri if cfg else None)
    if args.json_out:
        from rich.console import Console

        router = console_mod.current()
        console = Console(file=router.err if router else sys.stderr, highlight=False, soft_wrap=True)
    # Ray's and vLLM's output goes to A's run directory's logs/compare.log, as a run's stages' does
    a = find_policy(args.a, uri)
    with console_mod.command_log(a.run_dir, "compare") as log_path:
        if log_path:
            console.print(f"compare: library output in {log_path}")
        result = compare_runs(a, args.b, samples=args.samples, prompts=args.prompts, max_tokens=args.max_tokens,
                              temperature=args.temperature, seed=args.seed, reward_model=args.reward_model,
                              tracking_uri=uri, log_to=cfg.tracking_uri if cfg else None,
                              experiment=cfg.mlflow.experiment if cfg else "posttrain",
                              ray_cfg=cfg.ray if cfg else None, log=lambda m: console.print(f"compare: {m}"))
    if args.json_out:
        router = console_mod.current()
        print(json.dumps(result, indent=2), file=router.out if router else sys.stdout)
    else:
        print_comparison(result, console)
        console.print(f"logged to MLflow run {result['run_id']}")
    return 0
