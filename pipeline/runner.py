"""Running a plan: take the run directory's lock, plan once, run each miss, track everything.

    run_pipeline(cfg, config_path, console, only=["data"])   # plan (pipeline.plan), then run

A stage's artifact is reused when a finished, undamaged copy exists under its cache key, in
run_dir or in the bucket. A miss builds into a clean work directory and commits it, manifest
last; every step of that goes through the artifact store (`pipeline.storage.ArtifactStore`). Ray
is started only when a stage asks for it (`ctx.ray()`), so a fully cached rerun never starts it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import artifacts, events, faults, outcomes, storage
from pipeline.run_storage import RunStorage
from pipeline import console as console_mod
from pipeline.bucket import check as check_bucket
from pipeline.config import PipelineConfig, flatten, get_path
from pipeline.errors import LockError, UserError
from pipeline.plan import FORCED, PlannedStage, Planner, build_plan, selection
from pipeline.registry import StageSpec
from pipeline.registry import load as load_stage

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
    storage: RunStorage
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


def _stray_worker() -> None:
    """Fault drill (PIPELINE_FAULT_STRAY_WORKER=<stage>): an actor that leaves as Ray Train's controller
    does when aborted (`exit_actor`), and whose exit then blocks, as a finalizer stuck in interpreter
    teardown does. Once told to exit, a worker is neither killed by its raylet at shutdown nor watches
    it: without `cluster.shutdown_ray`'s sweep, this process outlives the run (issue 48, item 8)."""
    import ray

    @ray.remote(num_cpus=0)
    class StrayWorker:
        def leave(self) -> None:
            import atexit
            import time

            atexit.register(time.sleep, 10**6)
            ray.actor.exit_actor()

    try:
        ray.get(StrayWorker.remote().leave.remote(), timeout=120)
    except ray.exceptions.RayActorError:  # what the caller of an actor that exited sees
        pass


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
    if faults.value("IN_STAGE") == name:  # fault drills: a stage that crashes
        faults.inject("IN_STAGE", f"in stage '{name}'")
    if faults.value("STRAY_WORKER") == name:  # a Ray worker whose exit never ends
        ctx.ray()
        _stray_worker()
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
    """A hit's manifest, once the artifact is here (pulled) and in the bucket (pushed). Its files were
    checked when it was planned, and are not hashed again. None when the bucket's copy turned out
    damaged while it downloaded: the stage then runs as a miss."""
    try:
        return store.ensure_local(p.spec.name, p.key, console.print, verified=_verified(p))
    except storage.ContentMismatch as exc:
        console.print(f"[yellow]{p.spec.name}: the cached copy in the bucket is damaged ({exc}); rebuilding it[/]")
        p.status, p.reason = "miss", f"damaged in the bucket: {exc}"
        return None


def _verified(p: PlannedStage) -> dict | None:
    """The manifest of the copy in run_dir whose files the plan checked, or None."""
    return p.found.manifest if p.found is not None and p.found.where == "here" else None


def _stale(p: PlannedStage, planner: Planner, made: set[str]) -> bool:
    """Whether a stage's planned key may be out of date: an input became known while running (a sweep
    that had not run, or ran again, gives its best values now) or an upstream stage's key changed."""
    if p.pending:
        return True
    tune = planner.producer.get("best_config")
    if "best_config" in p.spec.inputs and tune in made:
        return True
    return any(planner.keys.get(planner.producer[i]) != p.components["upstream"].get(i)
               for i in p.spec.inputs if i != "best_config")


def run_pipeline(cfg: PipelineConfig, config_path: Path, console, only=(), from_=None, to=None, force=(),
                 registry: tuple[StageSpec, ...] | None = None, summary: dict | None = None) -> dict[str, Any]:
    """Plan and run under the run-dir lock (so no other run changes the cache between the two).

    Each stage is keyed once, when planned; only a stage whose input became known while running (a
    sweep's best values) is keyed again when it is reached. Returns {"plan": [...], "stages": {stage:
    manifest}, "run_ids": {stage: MLflow run id}, "durations": {stage: seconds}, "parent_run_id": str,
    "started_ray": bool}. Pass `summary` to have it filled as the run goes, so a caller still sees what
    finished when a stage fails.
    """
    made = _first_missing(cfg.run_dir)  # what this run creates: removed again if it stops before any record
    check_run_dir(cfg.run_dir, cfg.min_free_gb)
    events.record_start("pipelines", detail=str(cfg.run_dir))
    summary = summary if summary is not None else {}
    try:
        run_storage = RunStorage.of(cfg)  # handed to every stage, which hands it to its workers
        store = run_storage.artifacts  # the one artifact store of this run: planner, runner, workers' pulls
        check_bucket(store.bucket)
        with RunLock(cfg.run_dir):
            planner = Planner(cfg, *selection(cfg, only, from_, to, force, registry), store)
            plan = build_plan(cfg, planner=planner)
            store.fps.save()
            summary.update({"plan": plan, "stages": {}, "run_ids": {}, "durations": {}, "started_ray": False})
            # Library output (Ray, vLLM, DeepSpeed, MLflow) goes to <run_dir>/logs when the command line routes it.
            with console_mod.run_logs(cfg.run_dir):
                _run_plan(cfg, config_path, console, planner, plan, run_storage, summary)
    except UserError as exc:
        # A usage error found while planning (a selected stage whose input was never made) exits 2, which
        # promises nothing was written: the run directory this run made, holding no run yet, goes again.
        if made is not None and not isinstance(exc, LockError) and "parent_run_id" not in summary:
            shutil.rmtree(made, ignore_errors=True)
        raise
    return summary


def _first_missing(path: Path) -> Path | None:
    """The topmost of `path` and its parents that does not exist yet (None if `path` exists)."""
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing


def _run_plan(cfg: PipelineConfig, config_path: Path, console, planner: Planner, plan: list[PlannedStage],
              run_storage: RunStorage, summary: dict) -> None:
    """Run the selected stages of `plan` in order under one MLflow parent run; shut down a Ray this started."""
    from pipeline.tracking import Tracker

    store = run_storage.artifacts
    active = [p for p in plan if p.status != "skip"]
    by_name = {p.spec.name: p for p in plan}
    ready: dict[str, dict] = {}  # stage -> the manifest of its artifact, present here (made or checked in this run)
    made: set[str] = set()  # the stages this run built (misses)
    version = git_version()
    # Named so runs tell apart in MLflow's table; the code version is the run's source (Source column).
    tracker = Tracker(cfg.tracking_uri, cfg.mlflow.experiment, cfg.run_dir,
                      run_name=f"{config_path.stem}-{time.strftime('%m%d-%H%M%S')}",
                      tags={"config": str(config_path), "code_version": version, "run_dir": str(cfg.run_dir),
                            "mlflow.source.type": "PROJECT", "mlflow.source.name": f"pipeline run {config_path}",
                            "mlflow.source.git.commit": version.removesuffix("-dirty")})
    summary["parent_run_id"] = tracker.parent_id
    tracker.log_dict(tracker.parent_id, cfg.model_dump(mode="json"), "resolved_config.json")
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    status, run_id, ctx, log_path = "FINISHED", None, None, None
    try:
        for i, planned in enumerate(active, 1):
            p = planner.key(planned.spec) if _stale(planned, planner, made) else planned
            if p.key is None:  # its upstream stages have all run by now, so this cannot happen
                raise RuntimeError(f"stage '{p.spec.name}' could not be keyed: {p.reason}")
            by_name[p.spec.name] = plan[plan.index(planned)] = p
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
                    upstream, inputs = {}, {}
                    for inp in p.spec.inputs:
                        up = by_name[planner.producer[inp]]
                        upstream[inp] = _input_manifest(store, up, ready, console)
                        inputs[inp] = storage.output_paths(upstream[inp], store.local_dir(up.spec.name, up.key))[inp]
                    ctx = RunContext(name, cfg, store.local_dir(name, p.key), store.checkpoint_dir(name, p.key),
                                     inputs, console, tracker, run_id, run_storage, upstream)
                    manifest = _run_stage(store, p, ctx)
                    made.add(name)
                    summary["started_ray"] |= ctx.started_ray
            ready[name] = manifest
            _attach_log(tracker, run_id, log_path)
            tracker.log_dict(run_id, manifest, "manifest.json")
            _record_lineage(store, tracker, run_id, p, manifest, by_name, planner.producer, console)
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

            shutdown_ray(lambda message: console.print(f"[yellow]{message}[/]"))


def _input_manifest(store: storage.ArtifactStore, up: PlannedStage, ready: dict[str, dict], console) -> dict:
    """The manifest of an upstream stage's artifact, made present here once per run: a stage this run
    made or used already is not looked up again; one it did not select is pulled if only the bucket has it."""
    if up.spec.name not in ready:
        ready[up.spec.name] = store.ensure_local(up.spec.name, up.key, console.print, verified=_verified(up))
    return ready[up.spec.name]
