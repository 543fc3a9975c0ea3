"""What a run reports: the plan table, the end-of-run outcomes table, and the `run --json` summary.

`print_plan` is what `plan` prints; `print_outcomes` ends `run` (each stage, hit or miss, its time
and what it achieved, then where to look); `json_summary` is the document `run --json` prints on
stdout, with the command's exit code and its name (`EXIT_*`, the codes `pipeline.__main__` returns).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import outcomes
from pipeline.tracking import redact

# The command's exit codes (pipeline/__main__.py's docstring) and the status the --json summary names each by.
EXIT_OK, EXIT_FAILED, EXIT_USER, EXIT_LOCKED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
_OUTCOME = {EXIT_OK: "succeeded", EXIT_FAILED: "failed", EXIT_USER: "config_error", EXIT_LOCKED: "locked",
            EXIT_INTERRUPTED: "interrupted"}


def print_plan(plan, console) -> None:
    """`plan`'s table: each stage, hit, miss or skip, its key and why; then the graph this config makes."""
    from rich.table import Table

    table = Table("#", "stage", "status", "key", "why")
    colour = {"hit": "green", "miss": "yellow", "skip": "dim"}
    for i, p in enumerate(plan, 1):
        why = p.reason if p.status != "skip" else f"not selected ({'done' if p.finished else 'not done'})"
        table.add_row(str(i), p.spec.name, f"[{colour[p.status]}]{p.status}[/]", p.key or "(not yet known)", why)
    console.print(table)
    # The graph this config makes (null stages left out, consumers rewired): below the table, which stays
    # narrow enough that its reasons do not wrap.
    console.print("graph: " + " -> ".join(p.spec.name for p in plan))
    for p in plan:
        if p.spec.inputs:
            console.print(f"  {p.spec.name} reads {', '.join(p.spec.inputs)}")


def json_summary(cfg, summary: dict, exit_code: int, error: str | None) -> dict:
    """The `run --json` document: the outcome and, per stage, what happened and where its results are."""
    from pipeline import storage

    stages = []
    for p in summary.get("plan", []):
        name = p.spec.name
        manifest = summary.get("stages", {}).get(name)
        if manifest is not None:
            status = p.status
        elif p.status == "skip":
            status = "skip"
        else:
            status = "failed" if summary.get("running") == name else "not_run"
        out_dir = storage.artifact_dir(cfg.run_dir, name, p.key) if p.key else None
        metrics = (manifest or {}).get("metrics", {})
        stages.append({
            "name": name, "status": status, "reason": p.reason, "cache_key": p.key,
            "duration_s": summary.get("durations", {}).get(name),
            "artifact": str(out_dir) if manifest is not None or (status == "skip" and p.finished) else None,
            "outputs": {k: str(v) for k, v in storage.output_paths(manifest, out_dir).items()} if manifest else {},
            "mlflow_run_id": summary.get("run_ids", {}).get(name),
            "outcomes": outcomes.headline(p.spec.outcomes, metrics),
            "outcome": outcomes.describe(p.spec.outcomes, metrics),
        })
    return {"status": _OUTCOME.get(exit_code, "failed"), "exit_code": exit_code, "error": error,
            "run_dir": str(cfg.run_dir) if cfg else None, "tracking_uri": redact(cfg.tracking_uri) if cfg else None,
            "mlflow_parent_run_id": summary.get("parent_run_id"), "registered_model": registered_model(cfg, summary),
            "stages": stages}


def registered_model(cfg, summary: dict) -> str | None:
    """The registry URI a stage of this run (the serve stage) moved its alias to: its `served_model` output
    (None without one)."""
    from pipeline import storage

    maker = next((p for p in summary.get("plan", []) if "served_model" in p.spec.outputs), None)
    manifest = summary.get("stages", {}).get(maker.spec.name) if maker else None
    if manifest is None or cfg is None:
        return None
    path = storage.output_paths(manifest, storage.artifact_dir(cfg.run_dir, maker.spec.name, maker.key))
    try:
        return json.loads(Path(path["served_model"]).read_text())["uri"]
    except (KeyError, OSError, ValueError):
        return None


def follow_up(command: str, config_path, overrides: list[str] = (), *extra: str) -> str:
    """`python -m pipeline COMMAND CONFIG OVERRIDES... EXTRA...`, quoted for a shell: a command printed for the
    person to run next reads the same run (its run_dir, its tracking store) only with the run's overrides.
    Passwords are dropped, not masked (`redact(mask=None)`): the command then authenticates from the
    environment (MLFLOW_TRACKING_PASSWORD, ...), as the run itself did since its config loaded."""
    import shlex

    return shlex.join(["python", "-m", "pipeline", command, *([str(config_path)] if config_path else []),
                       *redact(list(overrides), mask=None), *extra])


def print_outcomes(cfg, config_path, summary: dict, console, overrides: list[str] = ()) -> None:
    """The end-of-run table: each stage, hit or miss, its time and what it achieved; then where to look,
    as commands that work as printed (`follow_up`)."""
    from rich.table import Table

    rows = []
    for p in summary.get("plan", []):
        manifest = summary.get("stages", {}).get(p.spec.name)
        if manifest is not None:
            seconds = summary.get("durations", {}).get(p.spec.name)
            rows.append((p.spec.name, p.status, f"{seconds:.0f}s" if seconds is not None else "",
                         outcomes.describe(p.spec.outcomes, manifest.get("metrics", {}))))
    if console.is_terminal:
        table = Table(title="run summary", title_justify="left", show_edge=False, pad_edge=False)
        for column in ("stage", "cache", "time", "outcome"):
            table.add_column(column, justify="right" if column == "time" else "left", overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    else:  # a log file or a pipe: one unwrapped line per stage, as grep and cron mail want them
        console.print("run summary", soft_wrap=True)
        for name, status, seconds, outcome in rows:
            console.print(f"  {name:<12} {status:<5} {seconds:>6}  {outcome}", soft_wrap=True, markup=False)
    model = registered_model(cfg, summary)
    if model:
        console.print(f"registered model: {model}")
        console.print(f"serve it: {follow_up('serve', config_path, overrides, '--model', model)}",
                      soft_wrap=True, markup=False)
    console.print(f"browse this run's stages in the MLflow UI: {follow_up('ui', config_path, overrides)}",
                  soft_wrap=True, markup=False)

