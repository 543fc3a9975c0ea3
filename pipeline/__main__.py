"""Command line: `python -m pipeline {run,plan,validate,ui,serve,batch-infer} CONFIG [key.path=value ...]`.

    python -m pipeline validate configs/full.yaml                 # check the YAML, start nothing
    python -m pipeline plan configs/full.yaml --from data         # stages, hit/miss and why
    python -m pipeline run configs/full.yaml stages.data.max_len=256
    python -m pipeline run configs/full.yaml --only data --force data
    python -m pipeline ui configs/full.yaml                       # MLflow UI on the run's store
    python -m pipeline serve configs/full.yaml --model models:/posttrain-policy@champion   # until Ctrl-C
    python -m pipeline batch-infer configs/full.yaml --prompts prompts.jsonl --output out/  # Parquet + summary

Exit codes: 0 done, 1 a stage failed (traceback shown), 2 a user error (message names the key,
file or stage and the fix; nothing written), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.errors import UserError


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a stage name, e.g. --only data")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline", description="Declarative LLM post-training pipeline on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(name: str, help_: str, optional: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("config", type=Path, nargs="?" if optional else None,
                        help="pipeline YAML, e.g. configs/full.yaml" + (" (optional: defaults, and the tracking "
                                                                        "store of MLFLOW_TRACKING_URI)" if optional else ""))
        sp.add_argument("overrides", nargs="*", metavar="key.path=value", help="override a config value")
        return sp

    common("validate", "validate a config and print the resolved result")
    for name, help_ in (("plan", "show stages in order with cache hit/miss and why"), ("run", "run the pipeline")):
        sp = common(name, help_)
        # One value per flag (repeat it, or use commas) so overrides after it stay overrides.
        sp.add_argument("--only", action="extend", type=_names, default=[], metavar="STAGE[,STAGE]",
                        help="run just these stages (repeatable, comma-separated)")
        sp.add_argument("--from", dest="from_", metavar="STAGE", help="run this stage and everything downstream")
        sp.add_argument("--to", metavar="STAGE", help="run everything up to and including this stage")
        sp.add_argument("--force", action="extend", type=_names, default=[], metavar="STAGE[,STAGE]",
                        help="recompute these stages even if cached ('all' for every one)")
    ui = common("ui", "open the MLflow UI on this run's tracking store (bound to 127.0.0.1)")
    ui.add_argument("--port", type=int, default=5000, help="port of the UI (default 5000)")
    sv = common("serve", "serve a registered model behind the OpenAI-compatible API until Ctrl-C "
                "(engine and endpoint from stages.serve)", optional=True)
    sv.add_argument("--model", help="models:/NAME@ALIAS, models:/NAME/VERSION or a local model directory "
                    "(default: models:/<stages.serve.registry.model_name>@<alias>)")
    bi = common("batch-infer", "generate completions for a prompts file with a registered model (settings from "
                "stages.batch_infer); Parquet results and a summary, tracked in MLflow")
    bi.add_argument("--model", help="models:/NAME@ALIAS or a local model directory (default: the serve stage's "
                    "registered model, models:/<stages.serve.registry.model_name>@<alias>)")
    bi.add_argument("--prompts", type=Path, help="a .jsonl or .parquet file of prompts (default: stages.batch_infer.prompts)")
    bi.add_argument("--output", type=Path, help="a new directory for the results (default: <run_dir>/batch_infer/<time>)")
    bi.add_argument("--reward-model", help="a reward model (registry URI or directory) to score completions with")
    return p


def _print_plan(plan, console) -> None:
    from rich.table import Table

    table = Table("#", "stage", "status", "key", "why")
    colour = {"hit": "green", "miss": "yellow", "skip": "dim"}
    for i, p in enumerate(plan, 1):
        why = p.reason if p.status != "skip" else f"not selected ({'done' if p.finished else 'not done'})"
        table.add_row(str(i), p.spec.name, f"[{colour[p.status]}]{p.status}[/]", p.key, why)
    console.print(table)


def _default_model(cfg) -> str:
    from stages.common.model_registry import model_uri

    return model_uri(cfg.stages.serve.registry.model_name, cfg.stages.serve.registry.alias)


def _serve(cfg, args, console) -> int:
    from pipeline.tracking import check_reachable
    from stages.serve import serve_model

    check_reachable(cfg.tracking_uri)
    serve_model(cfg.stages.serve, args.model or _default_model(cfg), cfg.tracking_uri, cfg.run_dir / "registry_cache",
                cfg.ray, lambda m: console.print(f"  [dim]{time.strftime('%H:%M:%S')}[/] serve: {m}"))
    return 0


def _batch_infer(cfg, args, console) -> int:
    """Batch inference outside the stage graph: any registered model, any prompts file, its own MLflow run."""
    from pipeline.cluster import ensure_ray, shutdown_ray
    from pipeline.config import flatten
    from pipeline.tracking import Tracker
    from stages.batch_infer import BatchInferConfig, infer
    from stages.common.model_registry import fetch

    section = cfg.stages.batch_infer or BatchInferConfig()
    if args.prompts is not None:
        section = BatchInferConfig.model_validate({**section.model_dump(), "prompts": args.prompts})
    if section.prompts is None:
        raise UserError("batch-infer: no prompts; pass --prompts FILE or set stages.batch_infer.prompts")
    output = (args.output or cfg.run_dir / "batch_infer" / time.strftime("%Y%m%d-%H%M%S")).absolute()
    if output.exists() and any(output.iterdir()):
        raise UserError(f"--output {output}: exists and is not empty; give a new directory (nothing is overwritten)")
    model = args.model or _default_model(cfg)
    cache = cfg.run_dir / "registry_cache"
    model_dir = fetch(model, cfg.tracking_uri, cache)
    reward_dir = fetch(args.reward_model, cfg.tracking_uri, cache) if args.reward_model else None
    if section.score.reward_model and reward_dir is None:
        raise UserError("stages.batch_infer.score.reward_model is on: pass --reward-model URI|DIR, or turn it off")
    log = lambda m: console.print(f"  [dim]{time.strftime('%H:%M:%S')}[/] batch-infer: {m}")  # noqa: E731
    tracker = Tracker(cfg.tracking_uri, cfg.mlflow.experiment, cfg.run_dir, run_name="batch-infer",
                      tags={"model_uri": model, "prompts": str(section.prompts), "output": str(output)})
    from pipeline.tracking import log_params

    log_params(tracker.client, tracker.parent_id, flatten(section.model_dump(mode="json")))
    started, status = ensure_ray(cfg.ray), "FAILED"
    tmp = output.with_name(f".{output.name}.partial")
    try:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        summary = infer(section, model_dir, section.prompts, tmp, log, reward_dir, cfg.seed)
        if output.exists():  # an empty directory the user made for it
            output.rmdir()
        tmp.rename(output)
        tracker.log_metrics(tracker.parent_id, summary)
        tracker.log_artifact(tracker.parent_id, output / "summary.json")
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.end(tracker.parent_id, status)
        if started:
            shutdown_ray()
    console.print(f"[bold green]done[/]: {summary['rows']} rows ({summary['rows_failed']} failed) in {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # Overrides may come after flags (`--only model key=value`); argparse leaves those unknown.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*args.overrides, *extra]
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        from pipeline.config import load_config

        if args.config is not None and "=" in str(args.config) and not args.config.exists():
            args.overrides, args.config = [str(args.config), *args.overrides], None  # `serve key=value --model ...`
        if args.config is None:  # only `serve` may omit it: built-in defaults, the environment's tracking store
            env_uri = os.environ.get("MLFLOW_TRACKING_URI")
            extra = [f"mlflow.tracking_uri={env_uri}"] if env_uri else []
            cfg = load_config(None, [*extra, *args.overrides])
        else:
            cfg = load_config(args.config, args.overrides)
        if args.command == "validate":
            import yaml

            console.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
            console.print(f"[green]{args.config}: valid[/]")
            return 0
        if args.command == "ui":
            if cfg.tracking_uri.startswith(("http://", "https://", "databricks")):
                console.print(f"this run tracks to a server: open {cfg.tracking_uri} in a browser")
                return 0
            cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", cfg.tracking_uri,
                   "--host", "127.0.0.1", "--port", str(args.port)]
            console.print(f"MLflow UI for {cfg.tracking_uri} at http://127.0.0.1:{args.port} (Ctrl-C stops it)")
            try:
                return subprocess.call(cmd)
            except KeyboardInterrupt:
                return 0

        if args.command == "serve":
            return _serve(cfg, args, console)
        if args.command == "batch-infer":
            return _batch_infer(cfg, args, console)
        from pipeline.runner import build_plan, run_pipeline

        selection = {"only": args.only, "from_": args.from_, "to": args.to, "force": args.force}
        plan = build_plan(cfg, **selection)  # reads only: user errors surface before anything is written
        if args.command == "plan":
            _print_plan(plan, console)
            return 0
        from pipeline.tracking import check_reachable

        check_reachable(cfg.tracking_uri)
        summary = run_pipeline(cfg, args.config, console, **selection)
        ran = sum(p.status == "miss" for p in summary["plan"])
        cached = sum(p.status == "hit" for p in summary["plan"])
        console.print(f"[bold green]done[/]: {ran} stages run, {cached} cached; Ray "
                      f"{'started' if summary['started_ray'] else 'not started'}; artifacts under {cfg.run_dir / 'artifacts'}")
        return 0
    except UserError as exc:
        from rich.markup import escape

        err.print(f"[bold red]error:[/] {escape(str(exc))}")
        return 2
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]: the running stage wrote no manifest and will rerun (resuming from its "
                  "last checkpoint, if it has one) next time")
        return 130


if __name__ == "__main__":
    sys.exit(main())
