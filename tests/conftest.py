"""Shared fixtures: the smoke config in a temporary run dir, one local Ray for the session, CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "configs" / "smoke.yaml"
if str(ROOT) not in sys.path:  # `bench` is imported from the repository's root, whichever way pytest was started
    sys.path.insert(0, str(ROOT))

from bench import machine  # noqa: E402  (the calibration and the kernel's CPU counters: bench/machine.py)

# Tiers (which scenarios `make test` may leave out, and the full-pass record) and the start-up allowance
# (each module's declared starts): docs/development.md.
pytest_plugins = ["helpers.tiers", "helpers.starts", "pytester"]


# --------------------------------------------------------------------------- what the suite costs
# Every run first times the calibration workload (bench/machine.py) and prints the machine's speed, and at
# its end prints its wall time raw and normalised to the reference machine against the budget, the time
# of each module (setup, calls and teardown of its tests, so a shared fixture counts where it is first
# built) and how busy the cores were, steal apart; `--durations=15` (the Makefile's test commands) adds
# the 15 slowest tests. docs/development.md keeps the measured figures and the rule a new feature's tests
# follow. Budgets are on the reference machine: `make test` (the base tier and the changed tiers),
# `make test-all` (every test), `make test-fast`.
BUDGET_S = {"base": 20 * 60, "all": 35 * 60, "fast": 4 * 60}
_started = time.time()
_cpu_before = machine.read_cpu()
_module_s: dict[str, float] = defaultdict(float)
_calibration: list[machine.Calibration] = []


def pytest_sessionstart(session):
    from helpers.tiers import CALIBRATION

    cal = machine.calibrate()
    _calibration.append(cal)
    session.config.stash[CALIBRATION] = {"calibration": {"gemm_s": round(cal.gemm_s, 3),
                                                         "python_s": round(cal.python_s, 3),
                                                         "torch_import_s": round(cal.torch_import_s, 3),
                                                         "steal": round(cal.steal, 4), "speed": round(cal.speed, 3)}}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(cal.line())


def suite_kind(config) -> str:
    """Which budget a run is held to: the fast suite (-m "not slow"), the base tier with the changed tiers
    (make test, when a full-pass record let it leave tiers out), or every test (make test-all, and make test
    without a usable record, which then runs every tier)."""
    from helpers import tiers

    if "not slow" in (config.getoption("markexpr") or ""):
        return "fast"
    return "base" if config.getoption("tiers", "all") == "changed" and tiers.applied(config) else "all"


# Collecting the tests imports every test module; one that changes os.environ on import (a library setting
# its own variables) changes the environment of every subprocess the suite starts afterwards, as a user's
# shell would not. tests/test_imports.py fails on what this records.
_ENV_BEFORE_COLLECTION: dict[str, str] = {}
ENV_CHANGED_BY_COLLECTION: dict[str, tuple[str | None, str | None]] = {}


def pytest_collection(session):
    _ENV_BEFORE_COLLECTION.update(os.environ)


def pytest_collection_finish(session):
    now = dict(os.environ)
    for key in set(now) | set(_ENV_BEFORE_COLLECTION):
        if now.get(key) != _ENV_BEFORE_COLLECTION.get(key):
            ENV_CHANGED_BY_COLLECTION[key] = (_ENV_BEFORE_COLLECTION.get(key), now.get(key))


def pytest_runtest_logreport(report):
    _module_s[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    wall = time.time() - _started
    kind = suite_kind(config)
    terminalreporter.section("time per module")
    for module, seconds in sorted(_module_s.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
    for line in budget_lines(wall, kind, _calibration[0] if _calibration else None):
        terminalreporter.write_line(line, bold=True)
    after = machine.read_cpu()
    if _cpu_before is not None and after is not None:  # whether running tests side by side could help
        terminalreporter.write_line(machine.cores_line(wall, *machine.shares(_cpu_before, after)))


def budget_lines(wall: float, kind: str, cal: machine.Calibration | None) -> list[str]:
    """The wall time, raw and normalised to the reference machine, against the budget (which is in reference
    seconds): printed, never asserted."""
    budget = BUDGET_S[kind]
    name = {"base": "make test (base tier and changed tiers)", "all": "make test-all", "fast": "make test-fast"}[kind]
    lines = [f"suite wall time: {wall:.0f}s ({wall / 60:.1f} min) on this machine"]
    if cal is not None:
        norm = cal.normalised(wall)
        verdict = "within" if norm <= budget else "OVER"
        lines.append(f"normalised to the reference machine (speed {cal.speed:.2f}): {norm:.0f}s ({norm / 60:.1f} min), "
                     f"{verdict} {name}'s budget of {budget // 60} min (docs/development.md)")
        lines.append(cal.line())
    return lines


# --------------------------------------------------------------------------- unit modules use no Ray
# A module named tests/*_units.py tests pure code: its tests start no Ray, join none and use none (a test that
# needs Ray lives in the stage's module, test_<stage>_stage.py). Any of its tests fails (an error at setup or
# teardown) that asks for a Ray fixture (refused before the fixture starts anything), calls `ray.init` (a
# pipeline run, Ray Data's auto-init), leaves Ray initialised, or, when the session's Ray is already up,
# calls into it from the test's thread (`Worker.check_connected`, which ray.get/put, tasks, actors and
# placement groups call first; not while Ray imports its own libraries). The check imports ray (under a
# second, once) to watch `ray.init`; tests/test_hygiene.py shows it failing on purpose.
RAY_FIXTURES = frozenset({"ray_local", "smoke_upstream", "smoke_trained", "smoke_cli"})
_RAY_WATCH = pytest.StashKey[dict]()


def _is_units_module(item) -> bool:
    return item.path.name.endswith("_units.py")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if not _is_units_module(item):
        return
    asked = sorted(RAY_FIXTURES & set(getattr(item, "fixturenames", ())))
    if asked:
        pytest.fail(f"{item.path.name} is a unit module (no Ray) but this test asks for the Ray fixture(s) "
                    f"{', '.join(asked)}: move it to the stage's test module", pytrace=False)
    import threading

    import ray
    from ray._private import worker as ray_worker

    watch = {"init": ray.init, "up": ray.is_initialized(), "calls": [], "worker": ray_worker.global_worker}
    main = threading.get_ident()

    def init(*args, **kwargs):
        watch["calls"].append("ray.init")
        return watch["init"](*args, **kwargs)

    ray.init = init
    if watch["up"]:  # the session's Ray: calls into it, not a new start, would be the test's use of Ray
        check_connected = type(watch["worker"]).check_connected
        ray_dir = os.path.dirname(ray.__file__) + os.sep

        def watched(self=watch["worker"]):
            if threading.get_ident() == main:
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename.startswith(ray_dir):
                    frame = frame.f_back
                # Importing Ray's own libraries reads the connected Ray (ray.llm asks ray.get_gpu_ids() when
                # first imported): Ray's import, not the test's use of Ray.
                if frame is None or not frame.f_code.co_filename.startswith("<frozen importlib"):
                    watch["calls"].append("a call into the running Ray")
            return check_connected(self)

        watch["worker"].check_connected = watched
    item.stash[_RAY_WATCH] = watch


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)  # the test's fixtures, module-scoped ones included, are torn down by then
    finally:
        watch = item.stash.get(_RAY_WATCH, None)
        if watch is not None:
            import ray

            ray.init = watch["init"]
            watch["worker"].__dict__.pop("check_connected", None)
            problems = sorted(set(watch["calls"]))
            if not watch["up"] and ray.is_initialized():
                problems.append("Ray left initialised")
                ray.shutdown()  # not the session's: the next tests start from no Ray, as they would have
            if problems:
                pytest.fail(f"{item.path.name} is a unit module (no Ray) but this test used Ray "
                            f"({'; '.join(problems)}): move it to the stage's test module", pytrace=False)


def smoke_config(run_dir: Path, *overrides: str):
    from pipeline.config import load_config

    return load_config(SMOKE, [f"run_dir={run_dir}", *overrides])


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m pipeline ARGS` in a fresh process, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def cli_in_process(capfd, *args: str) -> subprocess.CompletedProcess:
    """`python -m pipeline ARGS` as its `main(argv)` in this process, output read through `capfd`: for a
    command's error paths, where no process behaviour (signals, child processes, exit) is under test. A fresh
    interpreter costs seconds of imports; this costs milliseconds. The router `run` installs is removed after."""
    from pipeline import console
    from pipeline.__main__ import main

    capfd.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        router = console.current()
        if router is not None:
            router.out.flush()
            router.err.flush()
        console.install(None)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["pipeline", *args], code, out, err)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for in-process stage tests (the runner reuses it and leaves it running)."""
    import ray

    from helpers.s3 import CREDENTIALS

    # Its workers hold credentials for the tests' local S3 server (helpers/s3.py), as a real node holds
    # its own: S3 clients without any send unsigned uploads, which moto stores still chunk-encoded.
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    from pipeline.cluster import init_local

    init_local(num_cpus=8)  # as a run starts its own: its workers address it, whatever else runs here
    from pipeline.events import record_start

    record_start("ray", detail="the session's Ray (ray_local)")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory) -> str:
    """One SQLite MLflow store for in-process runs (creating a store costs seconds of migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


# The session's trained run is made by the command line (`smoke_cli`, below): once it exists, its model and
# data are smoke_upstream's too (same config, same keys), so a full suite builds them once.
_SHARED: dict[str, Path] = {}


def _copy_artifacts(source: Path, run_dir: Path, stages: tuple[str, ...] | None = None) -> Path:
    import shutil

    for stage_dir in sorted((source / "artifacts").iterdir()):
        if stages is None or stage_dir.name in stages:
            shutil.copytree(stage_dir, run_dir / "artifacts" / stage_dir.name, dirs_exist_ok=True)
    return run_dir


@pytest.fixture(scope="session")
def smoke_upstream(ray_local, tmp_path_factory, tracking_uri):
    """smoke.yaml's model and data stages, made once; call it with a new run dir to get them there.

    Cache keys do not depend on the run directory, so the copied artifacts are cache hits in it:
    every training-stage test starts from the same upstream without paying for it again. When the
    shared command-line run already exists (the full suite makes it first), they are its model and
    data; otherwise (the fast suite, a module alone) the two stages run here, in-process."""
    from rich.console import Console

    from pipeline.runner import run_pipeline

    source = _SHARED.get("trained")
    if source is None:
        source = tmp_path_factory.mktemp("smoke_upstream")
        run_pipeline(smoke_config(source, f"mlflow.tracking_uri={tracking_uri}"), SMOKE, Console(quiet=True), to="data")

    def seed(run_dir: Path) -> Path:
        return _copy_artifacts(source, run_dir, ("model", "data"))

    return seed


# The shared trained smoke run: smoke.yaml's SFT (12 steps) and reward model, with SFT checkpoints every
# 3 steps (for resume tests) and the reward model's LM loss on. Every test that needs trained
# upstream stages uses these overrides, so they are cache hits in its run directory.
TRAINED = ("stages.sft.checkpoint_every=3", "stages.reward.lm_loss_weight=1.0")
# The rest of the command-line run: one policy rank and one engine (PPO's distributed paths have their own
# tests, and fewer processes start faster on 2 cores), the old policy's log-probs from the engines as
# configs/full.yaml takes them (the PPO tests measure the engine/trainer mismatch, so they take them from
# the ranks), and a short smoke load on the served model.
CLI_RUN = (*TRAINED, "stages.ppo.policy.num_ranks=1", "stages.ppo.rollout.num_engines=1",
           "stages.ppo.rollout.engine_logprobs=true", "stages.serve.smoke.requests=4")


@pytest.fixture(scope="session")
def smoke_cli(tmp_path_factory):
    """The whole smoke pipeline (model -> data -> sft -> reward -> ppo -> serve), made once by the
    command line in a fresh process, as a user runs it: (run_dir, its CompletedProcess).

    Every test that needs a finished pipeline shares it: the CLI end-to-end and MLflow UI checks read
    its console and run store, and `smoke_trained` (so the sft, reward, ppo, cluster and data tests)
    seeds its artifacts. Its tracking store is its own: `sqlite:///<run_dir>/mlflow.db`."""
    from helpers.procs import watched

    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not the session's
    # Watched: the processes it started, and which of them outlived it (tests/test_run_ends_processes.py).
    run = watched([sys.executable, "-m", "pipeline", "run", str(SMOKE), f"run_dir={run_dir}", *CLI_RUN], ROOT, env,
                  timeout=1200, separate_stderr=True)
    left = run.left_running()
    run.end_left_running()  # processes this fixture started, by PID; the test names them
    result = subprocess.CompletedProcess(run.args, run.returncode, run.output, run.stderr)
    result.started, result.left_running = run.seen, left
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _SHARED["trained"] = run_dir
    return run_dir, result


def _summary_of(run_dir: Path, tracking: str) -> dict:
    """What `run_pipeline` returns for the run that trained `run_dir`'s artifacts: each stage's manifest
    and the MLflow run id of the stage run that made it (the first pipeline run in the store)."""
    import json

    from mlflow.tracking import MlflowClient

    stages = {}
    for manifest in sorted(run_dir.glob("artifacts/*/*/manifest.json")):
        stages[manifest.parent.parent.name] = json.loads(manifest.read_text())
    client = MlflowClient(tracking)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              order_by=["attributes.start_time ASC"])
    first_parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags).info.run_id
    run_ids = {r.data.tags["stage"]: r.info.run_id for r in runs
               if r.data.tags.get("mlflow.parentRunId") == first_parent}
    return {"stages": stages, "run_ids": run_ids}


@pytest.fixture(scope="session")
def smoke_trained(smoke_cli):
    """The shared command-line run's model, data, sft and reward (SFT and reward trained for real: 2 Ray
    Train workers, DeepSpeed ZeRO-2, TRAINED), and its ppo and serve. Call it with a new run dir to get
    those artifacts there (cache hits for smoke.yaml + TRAINED); `.summary` is the run's summary
    (manifests, MLflow run ids), `.tracking_uri` the store those run ids are in, `.run_dir` the run."""
    run_dir, _ = smoke_cli
    tracking = f"sqlite:///{run_dir / 'mlflow.db'}"

    def seed(dest: Path) -> Path:
        return _copy_artifacts(run_dir, dest)

    seed.summary, seed.run_dir, seed.tracking_uri = _summary_of(run_dir, tracking), run_dir, tracking
    return seed


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The built-in tokenizer, trained on the smoke task corpus."""
    from stages.common import models, tasks

    cfg = smoke_config(tmp_path_factory.mktemp("unused"))
    tok = models.build_tokenizer(tasks.corpus(cfg.task, cfg.seed), cfg.model.builtin.vocab_size)
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return models.load_tokenizer(path)
