"""`python -m pipeline serve [CONFIG] [--model URI] [--adapter NAME=DIR ...]`: a registered (or local) model
behind the OpenAI-compatible API until Ctrl-C, with the engine and endpoint of `stages.serve`.

A command the serve stage's code provides beside the stage (`pipeline.registry.COMMANDS`); the
batch-infer command takes its default model, its model fetching and its console from here too.
Its console is `run`'s (the command is registered `routed`): our lines, one per event, and the
replicas' progress; Ray's, Serve's, vLLM's and MLflow's output goes to `<run_dir>/logs/serve-command.log`
(`serve.log` is the serve stage's), live too with `--verbose`.
"""

from __future__ import annotations

import time
from pathlib import Path

LOG = "serve-command"  # <run_dir>/logs/serve-command.log: the serve stage's own log is serve.log


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="models:/NAME@ALIAS, models:/NAME/VERSION or a local model directory "
                        "(default: models:/<stages.serve.registry.model_name>@<alias>)")
    parser.add_argument("--adapter", action="append", default=[], metavar="[NAME=]DIR",
                        help="a LoRA adapter directory (PEFT, safetensors) trained on --model, served beside it as "
                        "<model_id>:NAME (NAME defaults to the directory's name); repeatable")
    parser.add_argument("--verbose", action="store_true", help="also show library output (Ray, Serve, vLLM, MLflow) "
                        f"live; it always goes to <run_dir>/logs/{LOG}.log")


def default_model(cfg) -> str:
    """The registry URI the serve stage moves its alias to: models:/<registry.model_name>@<alias>."""
    from stages.common.model_registry import model_uri
    from stages.serve import settings

    registry = settings(cfg).registry
    return model_uri(registry.model_name, registry.alias)


def quiet_downloads() -> None:
    """MLflow's download bar off: a command fetches its model before it opens its log (a model that is not
    there is refused with nothing written), so the bar would be library output on the console."""
    import os

    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"


def logger(name: str, console):
    """Progress lines of a command: time, command, message."""
    return lambda m: console.print(f"  [dim]{time.strftime('%H:%M:%S')}[/] {name}: {m}")


def progress(name: str):
    """`advance(done, total, unit, note)` of a command: its progress on the console (`pipeline.events`)."""
    from pipeline import events

    return lambda done, total, unit="step", note="": events.advance(name, done, total, unit, note)


def main(args, cfg, console) -> int:
    from pipeline import console as console_mod
    from pipeline.tracking import check_reachable
    from stages.common.model_registry import fetch
    from stages.serve import settings
    from stages.serve.app import named_adapters, serve_model

    check_reachable(cfg.tracking_uri)
    adapters = named_adapters(args.adapter)  # refused here, before anything is fetched, written or started
    model = args.model or default_model(cfg)
    quiet_downloads()
    model_dir = fetch(model, cfg.tracking_uri, cfg.run_dir / "registry_cache")
    log = logger("serve", console)
    with console_mod.command_log(cfg.run_dir, "serve", LOG) as log_path:
        if log_path:
            fetched = f" ({model_dir})" if Path(model).expanduser().absolute() != model_dir else ""
            log(f"{model}{fetched}; library output in {log_path}")
        serve_model(settings(cfg), model_dir, cfg.ray, log, adapters, progress("serve"))
    return 0
