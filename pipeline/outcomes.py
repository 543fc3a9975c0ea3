"""What a run achieved, in a few numbers per stage: the end-of-run table, `--json`, and the parent
MLflow run's own metrics (so runs compare in MLflow's table without expanding their stages).

Each stage lists its outcomes in the registry (`StageSpec.outcomes`) as format templates over its
manifest's metrics, e.g. "accuracy {eval_accuracy_before:.3f} -> {eval_accuracy:.3f}". A template
whose metrics a manifest lacks (a cached manifest from an older version, an evaluation turned
off) is left out, so a stage shows what it has. Pure functions: the runner and the CLI print and log.
"""

from __future__ import annotations

import string
from typing import Any


def fields(template: str) -> list[str]:
    """The metric names a template reads: "p={p:.3g} on {n:.0f}" -> ['p', 'n']."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _complete(template: str, metrics: dict[str, Any]) -> bool:
    return all(_number(metrics.get(n)) for n in fields(template))


def headline(templates: tuple[str, ...], metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a stage's complete templates show, in template order."""
    return {n: float(metrics[n]) for t in templates if _complete(t, metrics) for n in fields(t)}


def describe(templates: tuple[str, ...], metrics: dict[str, Any]) -> str:
    """One line a person reads: 'accuracy 0.250 -> 0.500 on 64 held-out prompts (sign test p=0.0039)'."""
    return ", ".join(t.format(**{n: float(metrics[n]) for n in fields(t)}) for t in templates
                     if _complete(t, metrics))


def rollup(stages: dict[str, tuple[tuple[str, ...], dict[str, Any]]]) -> dict[str, float]:
    """Every stage's headline metrics as `<stage>.<metric>` (stage -> (templates, metrics)): the
    parent MLflow run's metrics."""
    return {f"{stage}.{k}": v for stage, (templates, metrics) in stages.items()
            for k, v in headline(templates, metrics).items()}
