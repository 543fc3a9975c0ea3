"""The cached stage runner: plan which stages to run, then run them with lineage.

    plan = build_plan(cfg, only=["data"])      # keys, hit/miss and why; starts nothing
    run_pipeline(cfg, plan, config_path)       # lock run_dir, run misses, track everything

A stage's artifact is reused when a finished, undamaged copy exists under its cache key, in
run_dir or in the bucket. A miss builds into a clean work directory and commits it, manifest
last; every step of that goes through the artifact store (`pipeline.storage.ArtifactStore`). Ray
is started only when a stage asks for it (`ctx.ray()`), so a fully cached rerun never starts it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import artifacts, outcomes, storage
from pipeline import console as console_mod
from pipeline.config import PipelineConfig, flatten, get_path, to_plain, with_values
from pipeline.errors import LockError, UserError
from pipeline.registry import STAGES, StageSpec, stages_for
from pipeline.stage import load as load_stage

FORCED = "forced (--force)"  # the reason of a stage the user forced: it reruns from scratch


@dataclass
class PlannedStage:
    spec: StageSpec
    key: str | None  # None: not knowable yet (it takes the values of a sweep that has not run)
    components: dict
    status: str  # "hit", "miss" or "skip" (not selected)
    reason: str
    finished: bool  # a finished artifact exists for this key
    config: Any = None  # the stage's config section as it runs (with tuned values applied, if it uses them)

    @property
    def pending(self) -> bool:
        """Its key waits for an upstream outcome (a sweep's best values); it is keyed when it is reached."""
        return self.key is None


# --------------------------------------------------------------------------- planning


def ordered(stages: tuple[StageSpec, ...] = STAGES) -> list[StageSpec]:
    """Stages in dependency order (producers before consumers)."""
    producer = {o: s.name for s in stages for o in s.outputs}
    done: list[StageSpec] = []
    pending = list(stages)
    while pending:
        ready = [s for s in pending if all(producer.get(i) in {d.name for d in done} for i in s.inputs)]
        if not ready:
            raise RuntimeError(f"registry has a cycle or a missing producer among {[s.name for s in pending]}")
        done.extend(ready)
        pending = [s for s in pending if s not in ready]
    return done


def _upstream(spec: StageSpec, stages: list[StageSpec]) -> list[str]:
    producer = {o: s.name for s in stages for o in s.outputs}
    return sorted({producer[i] for i in spec.inputs})


def _closure(names: set[str], stages: list[StageSpec], downstream: bool) -> set[str]:
    """`names` plus every stage upstream (or downstream) of them."""
    out, changed = set(names), True
    while changed:
        changed = False
        for s in stages:
            ups = set(_upstream(s, stages))
            if downstream and s.name not in out and ups & out:
                out.add(s.name)
                changed = True
            if not downstream and s.name in out and not ups <= out:
                out |= ups
                changed = True
    return out


def select(stages: list[StageSpec], only=(), from_=None, to=None) -> set[str]:
    names = [s.name for s in stages]
    for n in [*only, from_, to]:
        if n is not None and n not in names:
            raise UserError(f"unknown stage '{n}'; stages are: {', '.join(names)}")
    if only:
        if from_ or to:
            raise UserError("--only cannot be combined with --from/--to")
        return set(only)
    chosen = set(names)
    if from_:
        chosen &= _closure({from_}, stages, downstream=True)
    if to:
        chosen &= _closure({to}, stages, downstream=False)
    return chosen


_FUNCTION_SPEC = re.compile(r"^([A-Za-z_][\w.]*):[A-Za-z_]\w*$")


def named_modules(config: dict, reads: tuple[str, ...]) -> list[str]:
    """Modules named as 'module:function' by the settings a stage reads from elsewhere in the config (a
    custom `task.verifier`, a gold preference): their code changes the stage's results like its own."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, str) and (m := _FUNCTION_SPEC.match(value)):
            found.append(m.group(1))

    for p in reads:
        walk(config.get(p))
    return found


def components(cfg: PipelineConfig, spec: StageSpec, upstream_keys: dict[str, str], fps, stage_cfg: Any = None) -> dict:
    """Everything a stage's output depends on; its hash is the cache key.

    `stage_cfg` is the stage's own section as it will run (tuned values applied), if not the YAML's.
    """
    stage = load_stage(spec.module)
    section = stage_cfg if stage_cfg is not None else get_path(cfg, spec.config)
    raw = stage.raw_inputs(cfg)
    config = {p: to_plain(get_path(cfg, p)) for p in (spec.config, *spec.reads)}
    config[spec.config] = to_plain(section)
    for p in spec.reads:  # whether a swept stage takes the sweep's values does not change the sweep
        if isinstance(config[p], dict):
            config[p].pop("use_tuned", None)
    for dotted in spec.ignores:  # e.g. task.verifier for the stages that generate the task
        section, _, key = dotted.rpartition(".")
        if isinstance(config.get(section), dict):
            config[section].pop(key, None)
    code = {}
    for name in (spec.module, *spec.code, *stage.configured_code(section), *named_modules(config, spec.reads)):
        code.update(artifacts.code_fingerprint(name))
    return {
        "stage": spec.name,
        "config": config,
        "code": code,
        "libraries": artifacts.library_versions(),
        "upstream": upstream_keys,
        "raw_inputs": fps.paths([Path(p) for p in raw]),
    }


def _diff(old: dict, new: dict) -> str:
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(changed[:3]) + (f" (+{len(changed) - 3} more)" if len(changed) > 3 else "")


def explain_miss(store: storage.ArtifactStore, spec: StageSpec, key: str, comps: dict) -> str:
    """Why a stage has no artifact for this key, compared with its last attempt."""
    last = store.last_attempt(spec.name)
    if not last:
        return "never run"
    if last.get("key") == key:
        return "last attempt did not finish (no manifest)"
    old = last.get("components", {})
    reasons = []
    if old.get("config") != comps["config"]:
        reasons.append("config changed: " + _diff(flatten(old.get("config", {})), flatten(comps["config"])))
    if old.get("code") != comps["code"]:
        reasons.append("code changed: " + _diff(old.get("code", {}), comps["code"]))
    if old.get("libraries") != comps["libraries"]:
        reasons.append("libraries changed: " + _diff(old.get("libraries", {}), comps["libraries"]))
    if old.get("upstream") != comps["upstream"]:
        reasons.append("upstream changed: " + _diff(old.get("upstream", {}), comps["upstream"]))
    if old.get("raw_inputs") != comps["raw_inputs"]:
        reasons.append("raw inputs changed: " + _diff(old.get("raw_inputs", {}), comps["raw_inputs"]))
    return "; ".join(reasons) or "changed"


def tuned_values(store: storage.ArtifactStore, tune_key: str) -> dict | None:
    """The finished sweep's best values ({field path: value}), or None if it has not run.

    Read from the bucket when only the bucket has the sweep (planning writes nothing locally)."""
    raw = store.read_output("tune", tune_key, "best_config")
    try:
        best = json.loads(raw) if raw else None
    except ValueError:
        return None
    return best["params"] if isinstance(best, dict) and "params" in best else None


class Planner:
    """Keys stages one at a time, in order, from the keys of the stages upstream of them.

    `build_plan` keys every stage up front (for `plan`, and to validate a selection before anything
    runs); `run_pipeline` keys each stage again just before running it, once its upstream stages
    have run. A stage that takes a sweep's best values (`use_tuned`) is keyed on those values, not
    on the sweep's key, so it reruns exactly when the best values change; before the sweep has run
    its key is unknown (None), and so is every key downstream of it.
    """

    def __init__(self, cfg: PipelineConfig, stages: list[StageSpec], chosen: set[str], forced: set[str],
                 store: storage.ArtifactStore):
        self.cfg, self.stages, self.chosen, self.forced, self.store = cfg, stages, chosen, forced, store
        self.fps = store.fps
        self.producer = {o: s.name for s in stages for o in s.outputs}
        self.keys: dict[str, str | None] = {}

    def key(self, spec: StageSpec) -> PlannedStage:
        cfg = self.cfg
        status_if = (lambda status: status if spec.name in self.chosen else "skip")
        upstream = {i: self.keys[self.producer[i]] for i in spec.inputs}
        stage_cfg = get_path(cfg, spec.config)
        if "best_config" in spec.inputs and upstream["best_config"] is not None:
            values = tuned_values(self.store, upstream["best_config"])
            if values is None:
                upstream["best_config"] = None
            else:
                upstream["best_config"] = artifacts.hash_json(values)
                try:
                    stage_cfg = with_values(stage_cfg, values, prefix=spec.config)
                except ValueError as exc:
                    raise UserError(f"{spec.config}.use_tuned: the sweep's best values do not fit the current "
                                    f"config ({exc}); rerun the sweep (--force tune) or set use_tuned: false") from None
        unknown = sorted(self.producer[i] for i, k in upstream.items() if k is None)
        if unknown:
            self.keys[spec.name] = None
            why = ("waits for the tune stage's best values (keyed once the sweep has run)" if unknown == ["tune"]
                   else f"keyed once {' and '.join(unknown)} {'has' if len(unknown) == 1 else 'have'} run")
            return PlannedStage(spec, None, {"upstream": upstream}, status_if("miss"), why, False, stage_cfg)
        comps = components(cfg, spec, upstream, self.fps, stage_cfg)
        key = self.keys[spec.name] = artifacts.hash_json(comps)
        found = self.store.lookup(spec.name, key)
        finished = found.found
        always = load_stage(spec.module).always_runs(stage_cfg)
        if spec.name in self.chosen and spec.name in self.forced:
            status, reason = "miss", FORCED
        elif always:
            status, reason = "miss", always
        elif finished:
            status, reason = "hit", f"cached ({key})" if found.where == "here" else (
                f"cached in {self.store.bucket.uri} ({key})" + (f"; here: {found.problem}" if found.problem else ""))
        else:
            status, reason = "miss", found.problem or explain_miss(self.store, spec, key, comps)
        return PlannedStage(spec, key, comps, status_if(status), reason, finished, stage_cfg)


def selection(cfg: PipelineConfig, only=(), from_=None, to=None, force=(),
              registry: tuple[StageSpec, ...] | None = None) -> tuple[list[StageSpec], set[str], set[str]]:
    """(stages in order, the selected names, the forced names); the one place a selection is validated.

    A bad stage name (in --only, --from, --to or --force) is a UserError naming the valid ones."""
    stages = ordered(registry or stages_for(cfg))
    chosen = select(stages, only, from_, to)
    forced = {s.name for s in stages} if "all" in force else set(force)
    for name in forced:
        select(stages, only=[name])  # validates the name
    return stages, chosen, forced


def build_plan(cfg: PipelineConfig, only=(), from_=None, to=None, force=(),
               registry: tuple[StageSpec, ...] | None = None, planner: Planner | None = None) -> list[PlannedStage]:
    """Cache key, hit/miss and the reason for every stage. Reads files, writes and starts nothing.

    With `planner` (already holding a validated selection) the selection arguments are not used."""
    if planner is None:
        planner = Planner(cfg, *selection(cfg, only, from_, to, force, registry), storage.ArtifactStore.of(cfg))
    plan = [planner.key(spec) for spec in planner.stages]
    _check_needed(plan, planner.chosen)
    return plan


def _check_needed(plan: list[PlannedStage], chosen: set[str]) -> None:
    """Selected stages whose inputs come from unselected stages need those artifacts to exist."""
    by_name = {p.spec.name: p for p in plan}
    stages = [p.spec for p in plan]
    for p in plan:
        if p.spec.name not in chosen:
            continue
        for up in _upstream(p.spec, stages):
            upp = by_name[up]
            if up not in chosen and not upp.finished:
                raise UserError(
                    f"stage '{p.spec.name}' needs the output of stage '{up}', which has not been run with "
                    f"this configuration ({upp.reason}); run it first: add it to --only, or use --from {up}"
                )


# --------------------------------------------------------------------------- running


def check_run_dir(run_dir: Path, min_free_gb: float) -> None:
    """Fail before any work when the run directory cannot be written or its disk is (nearly) full.

    Creating it and writing a probe file catch permissions and read-only mounts; `statvfs` catches a
    full disk, which would otherwise surface as a half-written checkpoint an hour into the run.
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"run_dir {run_dir}: not writable ({exc.strerror or exc}); fix its permissions or choose "
                        "another directory (run_dir=...)") from None
    free_gb = shutil.disk_usage(run_dir).free / 2**30
    if free_gb < min_free_gb:
        raise UserError(f"run_dir {run_dir}: only {free_gb:.2f} GiB free on its filesystem, less than min_free_gb "
                        f"({min_free_gb:g} GiB); free some space, choose another run_dir, or lower min_free_gb")


class RunLock:
    """An exclusive lock on the run directory: a second run on it refuses instead of racing.

    `flock` is released by the kernel when the process dies, so a killed run never leaves a
    stale lock behind.
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise LockError(
                f"another pipeline run (pid {holder}) is using run_dir {self.path.parent}; wait for it to "
                "finish, or give this run another run_dir (run_dir=...)"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


@dataclass
class RunContext:
    """The runner's implementation of the stage interface (`pipeline.stage.StageContext`)."""

    name: str
    pipeline: PipelineConfig
    out_dir: Path
    checkpoint_dir: Path
    inputs: dict[str, Path]
    console: Any
    tracker: Any
    run_id: str
    storage: storage.RunStorage
    upstream: dict[str, dict] = field(default_factory=dict)  # input name -> the manifest of the stage that made it
    metrics: dict[str, float] = field(default_factory=dict)
    started_ray: bool = False
    board: Any = field(default=None, repr=False)  # progress shown when no command line routes the console

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)
        self.tracker.log_metrics(self.run_id, metrics, step)

    def log_dict(self, data: Any, name: str) -> None:
        self.tracker.log_dict(self.run_id, data, name)

    def log_artifact(self, path: Path) -> None:
        self.tracker.log_artifact(self.run_id, path)

    def set_tags(self, tags: dict[str, str], run_id: str | None = None) -> None:
        self.tracker.set_tags(run_id or self.run_id, tags)

    def mlflow_client(self):
        return self.tracker.client

    @property
    def experiment_id(self) -> str:
        return self.tracker.experiment_id

    @property
    def pipeline_run_id(self) -> str:
        return self.tracker.parent_id

    def train_callbacks(self) -> list:
        return []

    def progress(self, message: str) -> None:
        self.console.print(console_mod.stamped(f"{self.name}: {message}"))

    def advance(self, done: int, total: int | None, unit: str = "step", note: str = "") -> None:
        event = {"task": self.name, "done": done, "total": total, "unit": unit, "note": note}
        router = console_mod.current()
        if router is not None:
            router.event(event)
        else:  # called as a library (no command line routing the console): plain lines on our console
            self.board = self.board or console_mod.Board(self.console, live=False)
            self.board.update(event)

    def ray(self) -> None:
        from pipeline.cluster import ensure_ray

        self.started_ray = ensure_ray(self.pipeline.ray, self.storage, self.progress,
                                       self.pipeline.tracking_uri) or self.started_ray
        # Ray's core worker installs a C-level SIGTERM handler that aborts the process; put ours
        # back so `kill` still ends the stage cleanly (no manifest, MLflow run marked KILLED).
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


def git_version() -> str:
    """The code's git commit (`-dirty` with uncommitted changes); a submitted job carries its submitter's."""
    if os.environ.get("PIPELINE_CODE_VERSION"):
        return os.environ["PIPELINE_CODE_VERSION"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=artifacts.PROJECT_ROOT,
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=artifacts.PROJECT_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if dirty else "")


def _sigterm_as_interrupt(*_: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _run_stage(store: storage.ArtifactStore, p: PlannedStage, ctx: RunContext) -> dict:
    """Execute one missed stage in a clean work directory and commit it as the artifact.

    The store builds every attempt in a staging directory and replaces the finished copy (in the
    bucket, then in run_dir) only once the stage succeeded, so a failed rerun leaves the last good
    result usable in both. A forced stage also starts from scratch: its checkpoints from earlier
    attempts are removed first (locally and in the bucket)."""
    name = p.spec.name
    ctx.out_dir = store.begin(name, p.key, fresh=p.reason == FORCED)
    store.record_attempt(name, p.key, p.components)
    start = time.time()
    if os.environ.get("PIPELINE_FAULT_IN_STAGE") == name:  # fault drills: a stage that crashes
        raise RuntimeError(f"injected fault in stage '{name}' (PIPELINE_FAULT_IN_STAGE)")
    outputs = load_stage(p.spec.module).run(p.config if p.config is not None else get_path(ctx.pipeline, p.spec.config),
                                            ctx)
    missing = [o for o in p.spec.outputs if o not in outputs or not Path(outputs[o]).exists()]
    if missing:
        raise RuntimeError(f"stage '{name}' did not produce {missing}")
    fields = {
        "components": p.components, "metrics": ctx.metrics,
        "outputs": {o: str(Path(outputs[o]).relative_to(ctx.out_dir)) if Path(outputs[o]).is_relative_to(ctx.out_dir)
                    else str(outputs[o]) for o in p.spec.outputs},
        "duration_s": round(time.time() - start, 3), "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "code_version": git_version(), "host": socket.gethostname(),
    }
    manifest = store.commit(name, p.key, fields, ctx.progress)
    ctx.out_dir = store.local_dir(name, p.key)
    return manifest


def _attach_log(tracker, run_id: str, log_path: Path | None) -> None:
    """The stage's library log on its MLflow run (under logs/); a log that cannot be attached stays on disk."""
    if log_path is not None and log_path.exists():
        try:
            tracker.log_artifact(run_id, log_path, "logs")
        except Exception:  # noqa: BLE001 - the stage's outcome does not depend on its log upload
            pass


def _record_lineage(store, tracker, run_id: str, p, manifest: dict, by_name: dict, producer: dict, console) -> None:
    """The stage run's datasets and models in MLflow (`pipeline.lineage`); a failure to record them
    is reported, not fatal: the stage's result is good either way."""
    from pipeline import lineage

    inputs = {}
    for inp in p.spec.inputs:
        up = by_name[producer[inp]]
        if up.key:
            inputs[inp] = (store.local_dir(up.spec.name, up.key), up.key)
    outputs = storage.output_paths(manifest, store.local_dir(p.spec.name, p.key))
    try:
        lineage.record(tracker.client, tracker.experiment_id, run_id, p.spec.name, p.key, inputs, outputs)
    except Exception as exc:  # noqa: BLE001 - MLflow's client raises many kinds
        console.print(f"[yellow]{p.spec.name}: could not record its datasets and models in MLflow ({exc})[/]")


def _use_hit(store: storage.ArtifactStore, p: PlannedStage, console) -> dict | None:
    """A hit's manifest, once the artifact is here (pulled) and in the bucket (pushed). None when
    the bucket's copy turned out damaged while it downloaded: the stage then runs as a miss."""
    try:
        return store.ensure_local(p.spec.name, p.key, console.print)
    except storage.ContentMismatch as exc:
        console.print(f"[yellow]{p.spec.name}: the cached copy in the bucket is damaged ({exc}); rebuilding it[/]")
        p.status, p.reason = "miss", f"damaged in the bucket: {exc}"
        return None


def run_pipeline(cfg: PipelineConfig, config_path: Path, console, only=(), from_=None, to=None, force=(),
                 registry: tuple[StageSpec, ...] | None = None, summary: dict | None = None) -> dict[str, Any]:
    """Plan and run under the run-dir lock (so no other run changes the cache between the two).

    Returns {"plan": [...], "stages": {stage: manifest}, "run_ids": {stage: MLflow run id},
    "durations": {stage: seconds}, "parent_run_id": str, "started_ray": bool}. Pass `summary` to
    have it filled as the run goes, so a caller still sees what finished when a stage fails.
    """
    from pipeline.tracking import Tracker

    check_run_dir(cfg.run_dir, cfg.min_free_gb)
    run_storage = storage.RunStorage.of(cfg)  # handed to every stage, which hands it to its workers
    store = run_storage.artifacts  # the one artifact store of this run: planner, runner, workers' pulls
    storage.check(store.bucket)
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    # Library output (Ray, vLLM, DeepSpeed, MLflow) goes to <run_dir>/logs when the command line routes it.
    with RunLock(cfg.run_dir), console_mod.run_logs(cfg.run_dir):
        # The planner keys every stage up front (validation, the plan shown); each selected stage is
        # keyed again just before it runs, from the keys its upstream stages ran with.
        planner = Planner(cfg, *selection(cfg, only, from_, to, force, registry), store)
        plan = build_plan(cfg, planner=planner)
        store.fps.save()
        active = [p for p in plan if p.status != "skip"]
        by_name = {p.spec.name: p for p in plan}
        producer = {o: p.spec.name for p in plan for o in p.spec.outputs}
        summary = summary if summary is not None else {}
        summary.update({"plan": plan, "stages": {}, "run_ids": {}, "durations": {}, "started_ray": False})
        version = git_version()
        # Named so runs tell apart in MLflow's table; the code version is the run's source (Source column).
        tracker = Tracker(cfg.tracking_uri, cfg.mlflow.experiment, cfg.run_dir,
                          run_name=f"{config_path.stem}-{time.strftime('%m%d-%H%M%S')}",
                          tags={"config": str(config_path), "code_version": version, "run_dir": str(cfg.run_dir),
                                "mlflow.source.type": "PROJECT", "mlflow.source.name": f"pipeline run {config_path}",
                                "mlflow.source.git.commit": version.removesuffix("-dirty")})
        summary["parent_run_id"] = tracker.parent_id
        tracker.log_dict(tracker.parent_id, cfg.model_dump(mode="json"), "resolved_config.json")
        status, run_id, ctx, log_path = "FINISHED", None, None, None
        try:
            for i in range(1, len(active) + 1):
                p = planner.key(active[i - 1].spec)
                if p.key is None:  # its upstream stages have all run by now, so this cannot happen
                    raise RuntimeError(f"stage '{p.spec.name}' could not be keyed: {p.reason}")
                by_name[p.spec.name] = plan[plan.index(active[i - 1])] = active[i - 1] = p
                name, t0 = p.spec.name, time.time()
                summary["running"] = name
                console.print(f"[bold][{i}/{len(active)}] {name}[/] {'[green]hit' if p.status == 'hit' else '[yellow]miss'}"
                              f"[/] - {p.reason}")
                run_id = tracker.start_stage(
                    name, flatten(p.components["config"]),
                    {"cache_key": p.key, "cache": p.status, "code_version": version,
                     "code_hash": artifacts.hash_json(p.components["code"])},
                )
                # Library output of a stage that runs (Ray, vLLM, DeepSpeed...) goes to logs/<stage>.log when
                # the command line captures it; the log is attached to the stage's MLflow run, failed or not.
                # A cache hit keeps the log of the run that made its artifact.
                with console_mod.stage_log(name) if p.status != "hit" else contextlib.nullcontext() as log_path:
                    manifest = _use_hit(store, p, console) if p.status == "hit" else None
                    if manifest is not None:
                        tracker.log_metrics(run_id, manifest.get("metrics", {}))
                    else:
                        inputs, upstream = {}, {}
                        for inp in p.spec.inputs:
                            up = by_name[producer[inp]]
                            upstream[inp] = store.ensure_local(up.spec.name, up.key, console.print)
                            inputs[inp] = storage.output_paths(upstream[inp], store.local_dir(up.spec.name, up.key))[inp]
                        ctx = RunContext(name, cfg, store.local_dir(name, p.key), store.checkpoint_dir(name, p.key),
                                         inputs, console, tracker, run_id, run_storage, upstream)
                        manifest = _run_stage(store, p, ctx)
                        summary["started_ray"] |= ctx.started_ray
                _attach_log(tracker, run_id, log_path)
                tracker.log_dict(run_id, manifest, "manifest.json")
                _record_lineage(store, tracker, run_id, p, manifest, by_name, producer, console)
                tracker.end(run_id)
                summary["stages"][name] = manifest
                summary["run_ids"][name] = run_id
                summary["durations"][name] = round(time.time() - t0, 3)
                del summary["running"]
                run_id = None
                console.print(f"[bold][{i}/{len(active)}] {name}[/] done in {time.time() - t0:.1f}s")
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except BaseException:
            status = "FAILED"
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            if run_id:
                _attach_log(tracker, run_id, log_path)
                tracker.end(run_id, status)
            # What the finished stages achieved, on the parent run itself: comparable without expanding it.
            tracker.log_metrics(tracker.parent_id, outcomes.rollup(
                {n: (by_name[n].spec.outcomes, m.get("metrics", {})) for n, m in summary["stages"].items()}))
            tracker.end(tracker.parent_id, status)
            if summary["started_ray"] or (ctx is not None and ctx.started_ray):
                from pipeline.cluster import shutdown_ray

                shutdown_ray()
    return summary
