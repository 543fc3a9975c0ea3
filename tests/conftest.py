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


# --------------------------------------------------------------------------- what the suite costs
# Every run prints its wall time against the budget and the time of each module (setup, calls and
# teardown of its tests, so a shared fixture counts where it is first built); `--durations=15`
# (the Makefile's test commands) adds the 15 slowest tests. docs/development.md keeps the measured table and
# the rule a new feature's tests follow.
BUDGET_S = {"full": 25 * 60, "fast": 4 * 60}  # `make test` and `make test-fast` on the 2-core machine kind
_started = time.time()
_module_s: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _module_s[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    wall = time.time() - _started
    kind = "fast" if "not slow" in (config.getoption("markexpr") or "") else "full"
    terminalreporter.section("time per module")
    for module, seconds in sorted(_module_s.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
    budget = BUDGET_S[kind]
    verdict = "within" if wall <= budget else "OVER"
    terminalreporter.write_line(f"suite wall time: {wall:.0f}s ({wall / 60:.1f} min), {verdict} the {kind} suite's "
                                f"budget of {budget // 60} min (docs/development.md)", bold=True)


def smoke_config(run_dir: Path, *overrides: str):
    from pipeline.config import load_config

    return load_config(SMOKE, [f"run_dir={run_dir}", *overrides])


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m pipeline ARGS` in a fresh process, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for in-process stage tests (the runner reuses it and leaves it running)."""
    import ray

    from helpers.s3 import CREDENTIALS

    # Its workers hold credentials for the tests' local S3 server (helpers/s3.py), as a real node holds
    # its own: S3 clients without any send unsigned uploads, which moto stores still chunk-encoded.
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    ray.init(num_cpus=8, include_dashboard=True)  # the dashboard serves the state API Ray Train polls
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory) -> str:
    """One SQLite MLflow store for in-process runs (creating a store costs seconds of migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def smoke_upstream(ray_local, tmp_path_factory, tracking_uri):
    """smoke.yaml's model and data stages, run once; call it with a new run dir to get them there.

    Cache keys do not depend on the run directory, so the copied artifacts are cache hits in it:
    every training-stage test starts from the same upstream without paying for it again."""
    import shutil

    from rich.console import Console

    from pipeline.runner import run_pipeline

    source = tmp_path_factory.mktemp("smoke_upstream")
    run_pipeline(smoke_config(source, f"mlflow.tracking_uri={tracking_uri}"), SMOKE, Console(quiet=True), to="data")

    def seed(run_dir: Path) -> Path:
        shutil.copytree(source / "artifacts", run_dir / "artifacts", dirs_exist_ok=True)
        return run_dir

    return seed


# The shared trained smoke run: smoke.yaml's SFT (12 steps) and reward model, with SFT checkpoints every
# 3 steps (for the resume test) and the reward model's LM loss on. Every test that needs trained
# upstream stages uses these overrides, so they are cache hits in its run directory.
TRAINED = ("stages.sft.checkpoint_every=3", "stages.reward.lm_loss_weight=1.0")


@pytest.fixture(scope="session")
def smoke_trained(smoke_upstream, tmp_path_factory, tracking_uri):
    """smoke.yaml with TRAINED, run once to the reward stage: model, data, sft and reward for real
    (2 Ray Train workers, DeepSpeed ZeRO-2). Call it with a new run dir to get those artifacts there;
    `.summary` is the run's summary (manifests, MLflow run ids with the full metric histories)."""
    import shutil

    from rich.console import Console

    from pipeline.runner import run_pipeline

    source = smoke_upstream(tmp_path_factory.mktemp("smoke_trained"))
    summary = run_pipeline(smoke_config(source, f"mlflow.tracking_uri={tracking_uri}", *TRAINED), SMOKE,
                           Console(quiet=True), to="reward")

    def seed(run_dir: Path) -> Path:
        shutil.copytree(source / "artifacts", run_dir / "artifacts", dirs_exist_ok=True)
        return run_dir

    seed.summary, seed.run_dir = summary, source
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
