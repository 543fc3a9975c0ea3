"""The pipeline as a user runs it: `python -m pipeline run configs/smoke.yaml` in a fresh process."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI_RUN, ROOT, SMOKE, cli_in_process, run_cli

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 4, "ray": 2}

pytestmark = pytest.mark.slow


def _runs(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("posttrain")
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


@pytest.fixture(scope="module")
def finished_smoke(smoke_cli):
    """The session's smoke run made by the command line, as a user runs it (conftest.smoke_cli, with
    CLI_RUN's overrides; the sft, reward and ppo tests train on its artifacts): (run_dir, its result)."""
    return smoke_cli


def test_run_then_cached_rerun_without_ray(finished_smoke):
    run_dir, first = finished_smoke
    assert "model miss - never run" in first.stdout and "data miss - never run" in first.stdout
    assert "Ray started" in first.stdout
    assert "serve: registered new version 1 of posttrain-policy" in first.stdout
    # A Train worker's progress reaches the console once (Ray Train's print patch doubled every line).
    steps = [line for line in first.stdout.splitlines() if "sft: step " in line or "reward: step " in line]
    assert steps and len(steps) == len(set(steps)), steps
    # The run ends with what each stage achieved, and where to look next.
    table = first.stdout[first.stdout.index("run summary"):]
    assert all(f"{s} " in table for s in ("model", "data", "sft", "reward", "ppo", "serve"))
    assert "held-out prompts (sign test p=" in table and "pairwise accuracy" in table
    assert "registered model: models:/posttrain-policy@champion" in table
    # ... as commands that read this run as printed: with its overrides (run_dir=...), labelled for what they do
    assert f"browse this run's stages in the MLflow UI: python -m pipeline ui {SMOKE} run_dir={run_dir} " in table
    assert f"serve it: python -m pipeline serve {SMOKE} run_dir={run_dir} " in table
    assert "--model models:/posttrain-policy@champion" in table
    # Only our lines reach the console (output not a terminal); library output is in each stage's
    # log file, which is also on the stage's MLflow run.
    console = (first.stdout + first.stderr).splitlines()
    assert len(console) < 80, "\n".join(console)
    assert not any("pid=" in line or "INFO" in line or "WARNING" in line for line in console), "\n".join(console)
    assert "(RayTrainWorker pid=" in (run_dir / "logs" / "sft.log").read_text()
    assert "vLLM" in (run_dir / "logs" / "ppo.log").read_text()

    # Everything cached: no stage runs and Ray is never contacted (an unreachable RAY_ADDRESS
    # would fail the run if anything tried).
    second = run_cli("run", str(SMOKE), f"run_dir={run_dir}", *CLI_RUN, "--json", env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert all(f"{s} hit" in second.stderr for s in ("model", "data", "sft", "reward", "ppo", "serve"))
    assert "0 stages run, 6 cached; Ray not started" in second.stderr  # with --json, progress goes to stderr
    summary = json.loads(second.stdout)
    assert summary["status"] == "succeeded" and summary["exit_code"] == 0
    stages = {s["name"]: s for s in summary["stages"]}
    assert list(stages) == ["model", "data", "sft", "reward", "ppo", "serve"]
    assert all(s["status"] == "hit" and s["duration_s"] is not None for s in stages.values())
    assert (Path(stages["sft"]["artifact"]) / "manifest.json").is_file()
    assert Path(stages["sft"]["outputs"]["sft_model"]).is_dir()
    assert summary["registered_model"] == "models:/posttrain-policy@champion"
    assert "eval_accuracy_sign_test_p" in stages["ppo"]["outcomes"] and "->" in stages["ppo"]["outcome"]

    # Lineage: two parent runs, each with a nested run per stage carrying config, tags and metrics.
    client, runs = _runs(run_dir)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2 and all(r.info.status == "FINISHED" for r in runs)
    children = {(r.data.tags["mlflow.parentRunId"], r.info.run_name): r for r in runs if r not in parents}
    assert summary["mlflow_parent_run_id"] == parents[1].info.run_id
    assert stages["data"]["mlflow_run_id"] == children[(parents[1].info.run_id, "data")].info.run_id
    data_miss = children[(parents[0].info.run_id, "data")]
    data_hit = children[(parents[1].info.run_id, "data")]
    assert (data_miss.data.tags["cache"], data_hit.data.tags["cache"]) == ("miss", "hit")
    assert data_miss.data.tags["cache_key"] == data_hit.data.tags["cache_key"]
    assert data_miss.data.params["stages.data.max_len"] == "64"
    assert data_miss.data.metrics["sft_train_rows"] == data_hit.data.metrics["sft_train_rows"] > 0
    assert "code_version" in data_miss.data.tags
    assert {a.path for a in client.list_artifacts(data_hit.info.run_id)} == {"manifest.json"}  # a hit logs nothing
    sft_miss = children[(parents[0].info.run_id, "sft")].info.run_id
    assert [a.path for a in client.list_artifacts(sft_miss, "logs")] == ["logs/sft.log"]
    assert "resolved_config.json" in {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    # The parent run carries the headline outcomes itself, so runs compare without expanding them.
    for parent in parents:
        ppo_child = children[(parent.info.run_id, "ppo")]
        assert parent.data.metrics["ppo.eval_accuracy"] == ppo_child.data.metrics["eval_accuracy"]
        assert parent.data.metrics["reward.eval_accuracy"] == stages["reward"]["outcomes"]["eval_accuracy"]
    assert parents[0].info.run_name != parents[1].info.run_name
    # Lineage in MLflow's columns: the SFT run read the data stage's split (digest: its key) and the
    # PPO policy is a logged model made by the first PPO run, yielded again by the cached one.
    sft_first = client.get_run(children[(parents[0].info.run_id, "sft")].info.run_id)
    assert {(d.dataset.name, d.dataset.digest) for d in sft_first.inputs.dataset_inputs} >= {
        ("sft_data", data_miss.data.tags["cache_key"])}
    policy = client.search_logged_models([parents[0].info.experiment_id], filter_string="name = 'policy_model'")
    assert len(policy) == 1 and policy[0].source_run_id == children[(parents[0].info.run_id, "ppo")].info.run_id
    ppo_cached = client.get_run(children[(parents[1].info.run_id, "ppo")].info.run_id)
    assert ppo_cached.outputs.model_outputs[0].model_id == policy[0].model_id

    # The serve stage registered the PPO policy with its lineage, deployed it and measured a smoke load.
    serve = children[(parents[0].info.run_id, "serve")]
    ppo = children[(parents[0].info.run_id, "ppo")]
    assert serve.data.metrics["smoke_requests"] == 4 and serve.data.metrics["smoke_tokens_per_s"] > 0
    assert 0 < serve.data.metrics["smoke_latency_p50_s"] <= serve.data.metrics["smoke_latency_p95_s"]
    version = client.get_model_version_by_alias("posttrain-policy", "champion")
    assert int(version.version) == 1 and version.run_id == serve.info.run_id
    assert version.tags["source_cache_key"] == ppo.data.tags["cache_key"]
    assert version.tags["pipeline_run_id"] == parents[0].info.run_id
    assert float(version.tags["metric.eval_accuracy"]) == pytest.approx(ppo.data.metrics["eval_accuracy"], rel=1e-5)

    # A config change reruns data only, and plan says why before anything runs.
    plan = run_cli("plan", str(SMOKE), f"run_dir={run_dir}", *CLI_RUN, "stages.data.max_len=48")
    assert "config changed: stages.data.max_len" in plan.stdout
    assert plan.stdout.count("hit") == 1 and plan.stdout.count("miss") == 5  # data and what follows it


def test_each_training_stage_shows_and_records_its_start_up(finished_smoke):
    """Stage start -> first optimizer step (ppo: first iteration): on the console with its parts, in the run
    summary, in the manifest and on the stage's MLflow run."""
    run_dir, first = finished_smoke
    table = first.stdout[first.stdout.index("run summary"):]
    client, runs = _runs(run_dir)
    for stage, what, parts in (("sft", "first optimizer step", ("workers", "imports", "model", "deepspeed")),
                               ("reward", "first optimizer step", ("workers", "imports", "model", "deepspeed")),
                               ("ppo", "first iteration", ("ray", "roles", "engines"))):
        line = next(x for x in first.stdout.splitlines() if f"{stage}: start-up " in x)
        assert f"to the {what} (" in line and all(f"{p} " in line for p in parts), line
        assert "start-up " in next(x for x in table.splitlines() if x.strip().startswith(f"{stage} "))
        manifest = json.loads(next((run_dir / "artifacts" / stage).glob("*/manifest.json")).read_text())
        metrics = manifest["metrics"]
        assert 0 < metrics["startup_s"] <= manifest["duration_s"]
        assert all(metrics[f"startup_{p}_s"] > 0 for p in parts)
        stage_run = next(r for r in runs if r.info.run_name == stage)
        assert stage_run.data.metrics["startup_s"] == pytest.approx(metrics["startup_s"])
    sft = json.loads(next((run_dir / "artifacts" / "sft").glob("*/manifest.json")).read_text())["metrics"]
    assert sft["startup_processes"] == 3  # Ray Train's controller and 2 workers
    ppo = json.loads(next((run_dir / "artifacts" / "ppo").glob("*/manifest.json")).read_text())["metrics"]
    assert ppo["startup_engine_imports_s"] > 0 and ppo["startup_policy_deepspeed_s"] > 0
    # The parts add up to the start-up; held-out evaluation before the first iteration is work, not start-up:
    # recorded, not counted.
    counted = {"sft": ("driver", "ray", "workers", "imports", "model", "deepspeed", "restore", "data"),
               "ppo": ("driver", "ray", "roles", "engines", "restore")}
    for metrics, names in ((sft, counted["sft"]), (ppo, counted["ppo"])):
        assert metrics["startup_s"] == pytest.approx(sum(metrics[f"startup_{n}_s"] for n in names), abs=0.05)
    assert ppo["startup_evaluation_s"] > 0


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = ROOT / "tests" / "artifacts" / "mlflow-ui.png"  # kept after the run, for a person to look at


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--window-size=3000,1000", "--virtual-time-budget=20000", *args],
                          capture_output=True, text=True, timeout=240)


def test_the_mlflow_ui_lists_each_run_with_its_outcomes_and_its_stages(finished_smoke):
    """`pipeline ui` on a finished run, in a real browser: the address it prints opens the runs table
    with each pipeline run's headline metrics and its stage runs listed."""
    from mlflow.tracking import MlflowClient

    from helpers.cluster import free_port
    from helpers.mlflow_server import server_process
    from pipeline.ui import ui_url
    from pipeline.config import load_config

    assert CHROMIUM, "headless Chromium is needed: `make setup` installs it (scripts/setup.sh, Debian package chromium)"
    run_dir, run = finished_smoke
    port = free_port()
    # The command the run's summary printed, as printed (with a free port: another test may hold 5000)
    printed = next(line for line in run.stdout.splitlines() if line.startswith("browse this run's stages"))
    command = shlex.split(printed.partition(": ")[2])
    assert command[:3] == ["python", "-m", "pipeline"]
    with server_process([sys.executable, *command[1:], "--port", str(port)], port) as (url, _proc):
        address = ui_url(load_config(SMOKE, [f"run_dir={run_dir}"]), port)
        SCREENSHOT.parent.mkdir(exist_ok=True)
        SCREENSHOT.unlink(missing_ok=True)
        shot = _chromium(f"--screenshot={SCREENSHOT}", address)
        assert SCREENSHOT.is_file() and SCREENSHOT.stat().st_size > 10_000, shot.stderr[-2000:]
        dom = _chromium("--dump-dom", address).stdout
        client = MlflowClient(url)
        runs = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert "Runs" in dom and "GenAI" in dom  # the model-training runs page, not the GenAI overview
    assert f">{parent.info.run_name}<" in dom
    for stage in ("model", "data", "sft", "reward", "ppo", "serve"):  # stage runs listed, not folded away
        assert f">{stage}<" in dom, stage
    for metric in ("sft.accuracy", "reward.eval_accuracy", "ppo.eval_accuracy", "ppo.eval_accuracy_sign_test_p"):
        assert f">{metric}<" in dom, metric  # headline columns ...
    shown = parent.data.metrics["reward.eval_accuracy"]  # ... with the parent run's values (as JavaScript prints them)
    assert f">{int(shown) if shown == int(shown) else repr(shown)}<" in dom


def test_only_a_stage_whose_inputs_are_missing_fails_naming_the_stage(tmp_path, capfd):
    result = cli_in_process(capfd, "run", str(SMOKE), f"run_dir={tmp_path / 'run'}", "--only", "data")
    assert result.returncode == 2
    assert "needs the output of stage 'model'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.tier("faults", covers=(
    "pipeline/runner.py", "pipeline/storage.py", "pipeline/swap.py", "pipeline/__main__.py", "pipeline/files.py"))
def test_killed_run_leaves_no_artifact_and_the_rerun_completes(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "run", str(SMOKE), f"run_dir={run_dir}", "--to", "data"],
                            cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        deadline = time.time() + 300
        while "data: reading and validating" not in seen and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        assert "data: reading and validating" in seen, seen
        os.kill(proc.pid, signal.SIGTERM)  # `kill PID`
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    assert "interrupted" in rest
    assert not list((run_dir / "artifacts" / "data").glob("*/manifest.json"))

    plan = run_cli("plan", str(SMOKE), f"run_dir={run_dir}", "--to", "data")
    assert "last attempt did not finish" in plan.stdout
    rerun = run_cli("run", str(SMOKE), f"run_dir={run_dir}", "--to", "data")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "model hit" in rerun.stdout and "data miss" in rerun.stdout
    assert len(list((run_dir / "artifacts" / "data").glob("*/manifest.json"))) == 1
    _, runs = _runs(run_dir)
    assert sorted(r.info.status for r in runs if r.info.run_name == "data") == ["FINISHED", "KILLED"]
