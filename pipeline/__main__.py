"""Command line: `python -m pipeline {run,plan,validate,ui,serve,batch-infer,submit} CONFIG [key.path=value ...]`,
`python -m pipeline compare A B`.

    python -m pipeline validate configs/full.yaml                 # check the YAML, start nothing
    python -m pipeline plan configs/full.yaml --from data         # stages, hit/miss and why
    python -m pipeline run configs/full.yaml stages.data.max_len=256
    python -m pipeline run configs/full.yaml --only data --force data
    python -m pipeline ui configs/full.yaml                       # MLflow UI on the run's store
    python -m pipeline serve configs/full.yaml --model models:/posttrain-policy@champion   # until Ctrl-C
    python -m pipeline batch-infer configs/full.yaml --prompts prompts.jsonl --output out/  # Parquet + summary
    python -m pipeline submit configs/full.yaml --address http://HEAD:8265 --wait   # as a Ray Job
    python -m pipeline status|logs|stop JOB_ID
    python -m pipeline compare runs/full:sft runs/full     # two policies on the same held-out prompts, paired

Exit codes (for schedulers; `run --json` also prints a machine-readable summary on stdout):
    0   success
    1   a stage failed (traceback on stderr; the stage left no artifact, a rerun resumes it)
    2   configuration or usage error (the message names the key, file or stage and the fix;
        nothing was written)
    3   another run holds the run directory's lock (try again later)
    130 interrupted (Ctrl-C or SIGTERM)

This module reads the command line and dispatches it; what a run prints (tables, the --json summary)
is in `pipeline.reports`, the `ui` command's MLflow server in `pipeline.ui`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from pipeline.errors import StageError, UserError
from pipeline.registry import COMMANDS
from pipeline.reports import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_USER, json_summary, print_outcomes,
                              print_plan)


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a stage name, e.g. --only data")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline", description="Declarative LLM post-training pipeline on Ray.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 success, 1 a stage failed, 2 configuration or usage error, 3 another run holds the "
        "run directory's lock, 130 interrupted")
    sub = p.add_subparsers(dest="command", required=True)

    def common(name: str, help_: str, optional: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("config", type=Path, nargs="?" if optional else None,
                        help="pipeline YAML, e.g. configs/full.yaml" + (" (optional: defaults, and the tracking "
                                                                        "store of MLFLOW_TRACKING_URI)" if optional
                                                                        else ""))
        sp.add_argument("overrides", nargs="*", metavar="key.path=value", help="override a config value")
        return sp

    common("validate", "validate a config and print the resolved result")
    for name, help_ in (("plan", "show stages in order with cache hit/miss and why"), ("run", "run the pipeline"),
                        ("submit", "submit the run to a Ray cluster as a Ray Job and print its id")):
        sp = common(name, help_)
        # One value per flag (repeat it, or use commas) so overrides after it stay overrides.
        sp.add_argument("--only", action="extend", type=_names, default=[], metavar="STAGE[,STAGE]",
                        help="run just these stages (repeatable, comma-separated)")
        sp.add_argument("--from", dest="from_", metavar="STAGE", help="run this stage and everything downstream")
        sp.add_argument("--to", metavar="STAGE", help="run everything up to and including this stage")
        sp.add_argument("--force", action="extend", type=_names, default=[], metavar="STAGE[,STAGE]",
                        help="recompute these stages even if cached ('all' for every one)")
        if name == "submit":
            sp.add_argument("--address", help="the cluster's dashboard URL (default: RAY_API_SERVER_ADDRESS or an "
                            f"http RAY_ADDRESS, else {'http://127.0.0.1:8265'})")
            sp.add_argument("--wait", action="store_true", help="follow the job's log; exit with its outcome")
            sp.add_argument("--deadline", type=float, metavar="SECONDS",
                            help="with --wait: stop the job and exit 1 if it is still running after SECONDS")
        if name == "run":
            sp.add_argument("--json", action="store_true",
                            help="print a machine-readable summary on stdout (per stage: hit/miss, duration, "
                            "artifact path, MLflow run id); progress goes to stderr")
            sp.add_argument("--verbose", action="store_true",
                            help="also show library output (Ray, vLLM, DeepSpeed, MLflow) live; it always goes to "
                            "<run_dir>/logs/<stage>.log and the stage's MLflow run")
    for name, help_ in (("status", "show a submitted job's status"), ("logs", "print a submitted job's log"),
                        ("stop", "stop a submitted job (its running stage leaves no artifact and resumes next time)")):
        jp = sub.add_parser(name, help=help_, description=help_)
        jp.add_argument("job_id", help="the id `submit` printed")
        jp.add_argument("--address", help="the cluster's dashboard URL (default as for submit)")
        if name == "logs":
            jp.add_argument("--follow", action="store_true", help="keep printing until the job ends")
        if name == "stop":
            jp.add_argument("--timeout", type=float, default=60, metavar="SECONDS",
                            help="how long to wait for the job to end (default 60); exit 1 if it has not")
    ui = common("ui", "open the MLflow UI on this run's tracking store (bound to 127.0.0.1)")
    ui.add_argument("--port", type=int, default=5000, help="port of the UI (default 5000)")
    ui.add_argument("--workers", type=int, default=1, help="server worker processes (default 1: one person browsing)")
    for command in COMMANDS:  # the commands stages provide (pipeline.registry)
        module = importlib.import_module(command.module)
        if command.config == "none":
            cp = sub.add_parser(command.name, help=command.help,
                                description=getattr(module, "DESCRIPTION", command.help))
        else:
            cp = common(command.name, command.help, optional=command.config == "optional")
        module.add_arguments(cp)
    return p


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's commands, each with its own parser."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _closest_flag(parser: argparse.ArgumentParser, command: str, stray: list[str]) -> str:
    """'; did you mean --from?' for a mistyped flag of `command` (argparse 3.11 suggests none)."""
    import difflib

    sub = commands(parser)[command]
    flags = [f for f in sub._option_string_actions if f.startswith("--")]
    for word in stray:
        close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1) if word.startswith("-") else []
        if close:
            return f"; did you mean {close[0]}? (python -m pipeline {command} --help lists them)"
    return ""


def parse_args(argv: list[str] | None = None):
    """The command line as `main` reads it; anything else exits 2 with argparse's message."""
    parser = _parser()
    given = sys.argv[1:] if argv is None else argv
    names = commands(parser)
    if given and not given[0].startswith("-") and given[0] not in names:  # argparse 3.11 suggests none
        import difflib

        close = difflib.get_close_matches(given[0], list(names), n=1)
        parser.error(f"unknown command {given[0]!r}; " + (f"did you mean {close[0]!r}? " if close else "")
                     + f"commands are: {', '.join(names)}")
    # Overrides may come after flags (`--only model key=value`); argparse leaves those unknown.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}{_closest_flag(parser, args.command, stray)}")
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console

    as_json = getattr(args, "json", False)
    router = None
    routed = args.command == "run" or any(c.routed for c in COMMANDS if c.name == args.command)
    if routed:  # library output goes to log files; the consoles write to the original streams
        from pipeline.console import Router

        router = Router(verbose=getattr(args, "verbose", False))
    err = Console(file=router.err if router else sys.stderr, highlight=False, soft_wrap=True)
    # with --json, stdout is the summary
    console = err if as_json else Console(file=router.out if router else sys.stdout, highlight=False, soft_wrap=True)
    if router:
        from pipeline.console import install

        router.console = console
        install(router)  # the runner sends library output to <run_dir>/logs once the run dir is checked
    state: dict = {"cfg": None, "summary": {}}
    if as_json:
        import contextlib

        with contextlib.redirect_stdout(sys.stderr):  # stray prints (Ray's log monitor) must not break the JSON
            code, error = _main(args, console, err, state)
        import json

        print(json.dumps(json_summary(state["cfg"], state["summary"], code, error), indent=2),
              file=router.out if router else sys.stdout)
        return code
    return _main(args, console, err, state)[0]


def _main(args, console, err, state: dict) -> tuple[int, str | None]:
    """Run the command; (exit code, error message or None). `state` receives the config and run summary."""
    from rich.markup import escape

    from pipeline.errors import LockError

    try:
        return _command(args, console, state), None
    except LockError as exc:
        err.print(f"[bold yellow]locked:[/] {escape(str(exc))}")
        return EXIT_LOCKED, str(exc)
    except UserError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}")
        return EXIT_USER, str(exc)
    except KeyboardInterrupt:
        if state["summary"].get("running"):
            err.print("[bold red]interrupted[/]: the running stage wrote no manifest and will rerun (resuming from "
                      "its last checkpoint, if it has one) next time")
            _name_the_log(err, state, state["summary"]["running"])
        else:
            err.print(f"[bold red]interrupted[/]: {args.command} stopped")
        return EXIT_INTERRUPTED, "interrupted"
    except Exception as exc:  # a stage (or the code) failed: show where, exit 1
        import traceback

        if not isinstance(exc, StageError):  # a StageError's message says everything; a traceback would bury it
            traceback.print_exc(file=sys.stderr)
        stage = state["summary"].get("running")
        message = f"stage '{stage}' failed: {type(exc).__name__}: {exc}" if stage else f"{type(exc).__name__}: {exc}"
        err.print(f"[bold red]failed:[/] {escape(message)}")
        if stage:
            err.print("  it left no artifact; fix the cause and run again (it resumes from its last checkpoint)")
            _name_the_log(err, state, stage)
        return EXIT_FAILED, message


def _name_the_log(err, state: dict, stage: str) -> None:
    """The last console line of a failed or interrupted stage: where its library output went."""
    cfg = state.get("cfg")
    log = cfg.run_dir / "logs" / f"{stage}.log" if cfg is not None else None
    if log is not None and log.is_file():
        from rich.markup import escape

        err.print(f"  its log: {escape(str(log))}", soft_wrap=True)  # a long path stays one line


def _check_cluster_store(cfg, console) -> None:
    """`validate` of a config that joins a cluster: a local-file tracking store needs a one-node cluster."""
    from pipeline.cluster import count_nodes
    from pipeline.tracking import cluster_store_problem, is_local_store

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if not address or not is_local_store(cfg.tracking_uri):
        return
    try:
        nodes = count_nodes(address)
    except UserError as exc:  # the cluster is down: the config itself may still be right
        console.print(f"[yellow]could not ask the cluster how many nodes it has ({exc}); a cluster of more than "
                      "one node needs mlflow.tracking_uri set to a tracking server[/]")
        return
    problem = cluster_store_problem(cfg.tracking_uri, nodes)
    if problem:
        raise UserError(problem)


def _command(args, console, state: dict) -> int:
    from pipeline import jobs
    from pipeline.config import load_config

    if args.command == "status":
        return jobs.status(args.address, args.job_id, console)
    if args.command == "logs":
        return jobs.logs(args.address, args.job_id, args.follow)
    if args.command == "stop":
        return jobs.stop(args.address, args.job_id, console, args.timeout)
    command = next((c for c in COMMANDS if c.name == args.command), None)
    if command is not None and command.config == "none":
        return importlib.import_module(command.module).main(args, None, console)
    if args.command == "submit" and not any(o.startswith("ray.address=") for o in args.overrides):
        # The job's driver joins its cluster (RAY_ADDRESS is set for it); nor is this machine's CPU count
        # the limit to validate against.
        args.overrides = [*args.overrides, "ray.address=auto"]

    if args.config is not None and "=" in str(args.config) and not args.config.exists():
        args.overrides, args.config = [str(args.config), *args.overrides], None  # `serve key=value --model ...`
    if args.config is None:  # only `serve` may omit it: built-in defaults, the environment's tracking store
        env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        extra = [f"mlflow.tracking_uri={env_uri}"] if env_uri else []
        cfg = load_config(None, [*extra, *args.overrides])
    else:
        cfg = load_config(args.config, args.overrides)
    state["cfg"] = cfg
    if args.command == "validate":
        import yaml

        from pipeline.tracking import redact

        console.print(yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False), end="")
        _check_cluster_store(cfg, console)
        console.print(f"[green]{args.config}: valid[/]")
        return 0
    if args.command == "ui":
        from pipeline.ui import run_ui

        return run_ui(cfg, args.port, args.workers, console)
    if command is not None:
        return importlib.import_module(command.module).main(args, cfg, console)
    from pipeline.plan import build_plan
    from pipeline.plan import selection as validate_selection
    from pipeline.runner import run_pipeline

    selection = {"only": args.only, "from_": args.from_, "to": args.to, "force": args.force}
    validate_selection(cfg, **selection)  # a bad stage name fails here: nothing written, nothing submitted
    if args.command == "submit":
        if args.deadline is not None and (not args.wait or args.deadline <= 0):
            raise UserError("--deadline SECONDS needs --wait and a positive number of seconds")
        job_id = jobs.submit(cfg, args.config, args.address, selection, console)
        print(job_id)
        return jobs.wait(args.address, job_id, console, args.deadline) if args.wait else 0
    if args.command == "plan":
        print_plan(build_plan(cfg, **selection), console)  # reads only: writes and starts nothing
        return 0
    from pipeline.tracking import check_reachable

    check_reachable(cfg.tracking_uri)
    summary = run_pipeline(cfg, args.config, console, **selection, summary=state["summary"])  # plans once, locked
    ran = sum(p.status == "miss" for p in summary["plan"])
    cached = sum(p.status == "hit" for p in summary["plan"])
    print_outcomes(cfg, args.config, summary, console, args.overrides)
    console.print(f"[bold green]done[/]: {ran} stage{'s' * (ran != 1)} run, {cached} cached; Ray "
                  f"{'started' if summary['started_ray'] else 'not started'}; artifacts under "
                  f"{cfg.run_dir / 'artifacts'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
