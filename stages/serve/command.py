"""`python -m pipeline serve [CONFIG] [--model URI] [--adapter NAME=DIR ...]`: a registered (or local) model
behind the OpenAI-compatible API until Ctrl-C, with the engine and endpoint of `stages.serve`.

A command the serve stage's code provides beside the stage (`pipeline.registry.COMMANDS`); the
batch-infer command takes its default model from here too.
"""

from __future__ import annotations

import time


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="models:/NAME@ALIAS, models:/NAME/VERSION or a local model directory "
                        "(default: models:/<stages.serve.registry.model_name>@<alias>)")
    parser.add_argument("--adapter", action="append", default=[], metavar="[NAME=]DIR",
                        help="a LoRA adapter directory (PEFT, safetensors) trained on --model, served beside it as "
                        "<model_id>:NAME (NAME defaults to the directory's name); repeatable")


def default_model(cfg) -> str:
    """The registry URI the serve stage moves its alias to: models:/<registry.model_name>@<alias>."""
    from stages.common.model_registry import model_uri
    from stages.serve import settings

    registry = settings(cfg).registry
    return model_uri(registry.model_name, registry.alias)


def logger(name: str, console):
    """Progress lines of a command: time, command, message."""
    return lambda m: console.print(f"  [dim]{time.strftime('%H:%M:%S')}[/] {name}: {m}")


def main(args, cfg, console) -> int:
    from pipeline.tracking import check_reachable
    from stages.serve import settings
    from stages.serve.app import serve_model

    check_reachable(cfg.tracking_uri)
    serve_model(settings(cfg), args.model or default_model(cfg), cfg.tracking_uri, cfg.run_dir / "registry_cache",
                cfg.ray, logger("serve", console), args.adapter)
    return 0
