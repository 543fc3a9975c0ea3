"""Operations: exit codes, `run --json`, run-dir preflight, the cron wrapper, job helpers, deploy files."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, SMOKE, cli_in_process, run_cli
from pipeline.events import START_LEDGER

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 7, "ray": 2}

CRON = ROOT / "deploy" / "cron" / "pipeline-cron.sh"


def _json(result: subprocess.CompletedProcess) -> dict:
    return json.loads(result.stdout)  # stdout holds only the summary: progress and logs go to stderr


# --------------------------------------------------------------------------- exit codes and preflight


# The error paths below run the command in-process (`cli_in_process`): nothing about processes is under test.
def test_config_error_exits_2_with_a_json_summary(tmp_path, capfd):
    result = cli_in_process(capfd, "run", str(SMOKE), f"run_dir={tmp_path / 'run'}", "stages.sft.lr=-1", "--json")
    assert result.returncode == 2
    summary = _json(result)
    assert summary["status"] == "config_error" and summary["exit_code"] == 2
    assert "stages.sft.lr" in summary["error"] and summary["stages"] == []
    assert not (tmp_path / "run").exists()


def test_unwritable_run_dir_fails_before_any_work(tmp_path, capfd):
    result = cli_in_process(capfd, "run", str(SMOKE), "run_dir=/sys/pipeline-test-run")  # read-only even for root
    assert result.returncode == 2
    assert "run_dir /sys/pipeline-test-run: not writable" in result.stderr and "Traceback" not in result.stderr


def test_full_disk_fails_before_any_work(tmp_path, capfd):
    run_dir = tmp_path / "run"
    result = cli_in_process(capfd, "run", str(SMOKE), f"run_dir={run_dir}", "min_free_gb=1000000", "--json")
    assert result.returncode == 2
    assert "GiB free on its filesystem, less than min_free_gb (1e+06 GiB)" in result.stderr
    assert _json(result)["status"] == "config_error"
    assert not (run_dir / "artifacts").exists() and not (run_dir / "mlflow.db").exists()


def test_a_run_dir_held_by_another_run_exits_3(tmp_path, capfd):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242\n")
        lock.flush()
        result = cli_in_process(capfd, "run", str(SMOKE), f"run_dir={run_dir}", "--json")
    assert result.returncode == 3, result.stderr
    summary = _json(result)
    assert summary["status"] == "locked" and "another pipeline run (pid 4242)" in summary["error"]
    assert not (run_dir / "artifacts").exists()


@pytest.mark.slow
@pytest.mark.tier("faults", covers=("pipeline/__main__.py", "pipeline/runner.py", "pipeline/files.py"))
def test_a_failed_stage_exits_1_and_names_it(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli("run", str(SMOKE), f"run_dir={run_dir}", "--only", "model").returncode == 0
    result = run_cli("run", str(SMOKE), f"run_dir={run_dir}", "--to", "data", "--json",
                     env={"PIPELINE_FAULT_IN_STAGE": "data"})  # the data stage crashes
    assert result.returncode == 1, result.stderr[-2000:]
    assert "stage 'data' failed" in result.stderr and "Traceback" in result.stderr
    # The run's last console line names the failed stage's log, which holds its traceback.
    assert result.stderr.strip().splitlines()[-1].strip() == f"its log: {run_dir / 'logs' / 'data.log'}"
    assert "injected fault in stage 'data'" in (run_dir / "logs" / "data.log").read_text()
    summary = _json(result)
    assert summary["status"] == "failed"
    stages = {s["name"]: s for s in summary["stages"]}
    assert stages["model"]["status"] == "hit" and Path(stages["model"]["artifact"]).is_dir()
    assert stages["data"]["status"] == "failed" and stages["data"]["artifact"] is None
    assert not list((run_dir / "artifacts" / "data").glob("*/manifest.json"))


# --------------------------------------------------------------------------- cron


def _cron(run_dir: Path, logs: Path, *args: str) -> subprocess.CompletedProcess:
    """Call the wrapper the way cron does: a bare environment, started in $HOME, not the project."""
    env = {"HOME": str(logs.parent), "PATH": "/usr/bin:/bin", "SHELL": "/bin/sh", "LOGNAME": "cron",
           "PIPELINE_LOG_DIR": str(logs)}
    if START_LEDGER in os.environ:  # what the wrapper's runs start counts against this module (helpers/starts.py)
        env[START_LEDGER] = os.environ[START_LEDGER]
    command = shlex.join([str(CRON), str(SMOKE), f"run_dir={run_dir}", *args])
    return subprocess.run(["/bin/sh", "-c", command], cwd=logs.parent, env=env, capture_output=True, text=True,
                          timeout=900)


def _stage_status(logs: Path) -> dict[str, str]:
    summary = json.loads((logs / "latest.json").read_text())
    return {s["name"]: s["status"] for s in summary["stages"] if s["status"] != "skip"}


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=("deploy/cron/", "pipeline/__main__.py", "pipeline/runner.py", "pipeline/files.py"))
def test_cron_wrapper_runs_idempotently_and_reruns_only_what_new_data_changes(tmp_path):
    def rows(a_values) -> str:  # sft chat rows "a+1=" -> "a+1"
        return "".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+1="},
                                                {"role": "assistant", "content": str(a + 1)}]}) + "\n"
                       for a in a_values)

    raw = tmp_path / "sft.jsonl"  # enough rows for both splits at smoke's eval_fraction 0.2
    raw.write_text(rows(range(40)))
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    args = ("--to", "data", f"stages.data.sources.sft=[{raw}]")

    first = _cron(run_dir, logs, *args)
    assert first.returncode == 0, (logs / "latest.log").read_text()[-3000:]
    assert _stage_status(logs) == {"model": "miss", "data": "miss"}

    again = _cron(run_dir, logs, *args)  # the next tick, nothing changed: no work, Ray not started
    assert again.returncode == 0
    assert _stage_status(logs) == {"model": "hit", "data": "hit"}
    assert "Ray not started" in (logs / "latest.log").read_text()

    raw.write_text(raw.read_text() + rows(range(40, 45)))
    changed = _cron(run_dir, logs, *args)  # new raw data: the data stage reruns, the model does not
    assert changed.returncode == 0
    assert _stage_status(logs) == {"model": "hit", "data": "miss"}
    assert "raw inputs changed" in json.loads((logs / "latest.json").read_text())["stages"][1]["reason"]

    with open(run_dir / ".lock", "w") as lock:  # a tick while a long run still holds the run dir
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        busy = _cron(run_dir, logs, *args)
    assert busy.returncode == 3
    history = (logs / "history.log").read_text().splitlines()
    assert len(history) == 4 and "skipped: another run still holds the run directory" in history[-1]
    assert "succeeded (exit 0" in history[0]


def test_cron_wrapper_without_a_config_explains_its_usage(tmp_path):
    result = subprocess.run(["/bin/sh", "-c", str(CRON)], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                            text=True)
    assert result.returncode == 2 and "usage:" in result.stderr


# --------------------------------------------------------------------------- job and cluster helpers


def test_job_exit_codes_follow_the_run_command():
    from pipeline.jobs import job_exit_code

    assert job_exit_code("SUCCEEDED", 0) == 0
    assert job_exit_code("FAILED", 2) == 2  # the driver's own code: a configuration error on the cluster
    assert job_exit_code("FAILED", 3) == 3
    assert job_exit_code("FAILED", None) == 1  # e.g. the driver was lost with its node
    assert job_exit_code("STOPPED", None) == 130


class _FakeJobs:
    """A Ray job client whose job never leaves RUNNING (or leaves it once stopped, if `obeys`)."""

    def __init__(self, obeys: bool):
        self.obeys, self.status, self.stops = obeys, "RUNNING", 0

    def get_job_info(self, job_id):
        from types import SimpleNamespace

        return SimpleNamespace(status=SimpleNamespace(value=self.status), driver_exit_code=None)

    def get_job_status(self, job_id):
        from types import SimpleNamespace

        return SimpleNamespace(value=self.status)

    def get_job_logs(self, job_id):
        return "working\n"

    def stop_job(self, job_id):
        self.stops += 1
        if self.obeys:
            self.status = "STOPPED"


def test_stop_fails_while_the_job_still_runs_and_wait_enforces_a_deadline(monkeypatch, capsys):
    from rich.console import Console

    from pipeline import jobs

    stubborn = _FakeJobs(obeys=False)
    monkeypatch.setattr(jobs, "client", lambda address: stubborn)
    assert jobs.stop(None, "j1", Console(), timeout_s=0.1) == 1  # still RUNNING after the timeout: not a success
    assert "still RUNNING 0.1s after the stop request" in capsys.readouterr().out
    # the command it prints reaches the cluster it was given
    assert jobs.stop("http://head:8265", "j1", Console(width=300), timeout_s=0.1) == 1
    assert "`python -m pipeline status j1 --address http://head:8265`" in capsys.readouterr().out

    obedient = _FakeJobs(obeys=True)
    monkeypatch.setattr(jobs, "client", lambda address: obedient)
    assert jobs.stop(None, "j2", Console(), timeout_s=5) == 0
    obedient.status = "RUNNING"
    assert jobs.wait(None, "j3", Console(), deadline_s=0.1) == 1  # overran its deadline: stopped, exit 1
    assert obedient.stops == 2 and obedient.status == "STOPPED"
    assert "still running after the 0.1s deadline" in capsys.readouterr().out


def test_submit_deadline_needs_wait(tmp_path, capfd):
    result = cli_in_process(capfd, "submit", str(SMOKE), f"run_dir={tmp_path / 'run'}", "--deadline", "60")
    assert result.returncode == 2 and "--deadline SECONDS needs --wait" in result.stderr


def test_dashboard_address_precedence(monkeypatch):
    from pipeline.jobs import DEFAULT_ADDRESS, dashboard_address

    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a GCS address is not a dashboard URL
    assert dashboard_address(None) == DEFAULT_ADDRESS
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert dashboard_address(None) == "http://head:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://api:8265")
    assert dashboard_address(None) == "http://api:8265"
    assert dashboard_address("http://given:8265") == "http://given:8265"


def test_job_package_carries_code_and_the_resolved_config(tmp_path):
    from conftest import smoke_config
    from pipeline.config import load_config
    from pipeline.jobs import run_args, stage_package

    cfg = smoke_config(tmp_path / "run", "stages.sft.lr=0.002")
    package = stage_package(cfg, "smoke.yaml", tmp_path / "pkg")
    assert (package / "pipeline" / "runner.py").is_file() and (package / "stages" / "sft.py").is_file()
    assert not list(package.rglob("__pycache__"))
    shipped = load_config(package / "smoke.yaml")
    assert shipped.stages.sft.lr == 0.002 and shipped.run_dir == tmp_path / "run"  # absolute: same on every node
    assert run_args("smoke.yaml", only=["sft"], force=["sft"]) == [
        "python", "-m", "pipeline", "run", "smoke.yaml", "--only", "sft", "--force", "sft"]


def test_a_local_tracking_file_is_refused_on_a_multi_node_cluster_only():
    from pipeline.tracking import cluster_store_problem

    for local in ("sqlite:////runs/x/mlflow.db", "file:///runs/mlruns", "/runs/mlruns"):
        assert cluster_store_problem(local, 1) is None
        problem = cluster_store_problem(local, 3)
        assert "3 nodes" in problem and "mlflow.tracking_uri: http://HOST:5000" in problem
    assert cluster_store_problem("http://alice:pw@mlflow:5000", 3) is None


def test_validate_of_a_config_joining_an_absent_cluster_says_what_it_could_not_check(tmp_path, capfd):
    result = cli_in_process(capfd, "validate", str(SMOKE), f"run_dir={tmp_path / 'run'}", "ray.address=127.0.0.1:9")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "could not ask the cluster how many nodes it has" in result.stdout
    assert "needs mlflow.tracking_uri set to a tracking server" in result.stdout


def test_status_of_an_unreachable_cluster_is_a_clear_error(capfd):
    result = cli_in_process(capfd, "status", "pipeline-x", "--address", "http://127.0.0.1:9")
    assert result.returncode == 2
    assert "no Ray dashboard answers there" in result.stderr and "Traceback" not in result.stderr


def test_storage_problems_name_the_node_that_cannot_use_the_run_dir():
    from pipeline.cluster import storage_problems

    ok = {"node_id": "a" * 56, "host": "head", "ip": "10.0.0.1", "reads": True, "writes": True, "error": ""}
    local = {"node_id": "b" * 56, "host": "worker-1", "ip": "10.0.0.2", "reads": False, "writes": True, "error": ""}
    readonly = {"node_id": "c" * 56, "host": "worker-2", "ip": "10.0.0.3", "reads": True, "writes": False,
                "error": "OSError: Read-only file system"}
    assert storage_problems("/data/run", [ok]) == []
    problems = storage_problems("/data/run", [ok, local, readonly])
    assert len(problems) == 2
    assert "bbbbbbbbbbbb (worker-1, 10.0.0.2) does not see /data/run" in problems[0]
    assert "cccccccccccc (worker-2, 10.0.0.3) cannot write to /data/run (OSError: Read-only" in problems[1]


# --------------------------------------------------------------------------- deploy files


def test_deploy_manifests_run_commands_the_cli_accepts():
    from pipeline.__main__ import parse_args

    rayjob, pvc = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "rayjob.yaml").read_text())
    assert rayjob["kind"] == "RayJob" and pvc["kind"] == "PersistentVolumeClaim"
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "pipeline"]
    args = parse_args(argv[3:])  # strict: an unknown flag fails
    assert args.command == "run" and args.json and Path(args.config).name == "full.yaml"
    cron = yaml.safe_load((ROOT / "deploy" / "k8s" / "cronjob.yaml").read_text())
    assert cron["kind"] == "CronJob" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    container = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    args = parse_args(container["command"][3:])
    assert args.command == "submit" and args.wait and args.address.startswith("http://")


def _containers(node):
    """Every container spec (dicts with `image`) anywhere in a manifest."""
    if isinstance(node, dict):
        if "image" in node and "name" in node:
            yield node
        for value in node.values():
            yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def test_k8s_manifests_are_locked_down_and_bounded_in_time():
    from pipeline.__main__ import parse_args

    rayjob, _ = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "rayjob.yaml").read_text())
    cron = yaml.safe_load((ROOT / "deploy" / "k8s" / "cronjob.yaml").read_text())
    # the dashboard listens where KubeRay's submitter pod reaches it (the head service), behind the token
    assert rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    # deadlines: the RayJob, the CronJob's pod, and the submit it runs
    assert rayjob["spec"]["activeDeadlineSeconds"] > 0
    job = cron["spec"]["jobTemplate"]["spec"]
    assert job["activeDeadlineSeconds"] > 0
    args = parse_args(job["template"]["spec"]["containers"][0]["command"][3:])
    assert 0 < args.deadline < job["activeDeadlineSeconds"]  # the run is stopped before its pod is killed
    containers = [*_containers(rayjob), *_containers(cron)]
    assert len(containers) == 4  # submitter, head, workers, cron's submit
    # the Ray nodes run model-written code: the sandbox's strongest tier needs user namespaces (docs/security.md)
    cluster = rayjob["spec"]["rayClusterSpec"]
    for pod in (cluster["headGroupSpec"]["template"]["spec"],
                *(g["template"]["spec"] for g in cluster["workerGroupSpecs"])):
        assert pod["hostUsers"] is False
        for c in pod["containers"]:
            ctx = c["securityContext"]
            assert ctx["seccompProfile"] == {"type": "Unconfined"} and ctx["appArmorProfile"] == {"type": "Unconfined"}
            assert ctx["procMount"] == "Unmasked" and "privileged" not in ctx and "add" not in ctx["capabilities"]
    for c in containers:
        assert not c["image"].endswith(":latest") and ":" in c["image"].rsplit("/", 1)[-1], c["image"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"] and "value" not in env["RAY_AUTH_TOKEN"], c["name"]


def test_dockerfile_is_pinned_non_root_and_runs_the_cli():
    text = (ROOT / "Dockerfile").read_text()
    base = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ARG BASE_IMAGE="))
    assert ":" in base and not base.endswith(":latest") and base.count(".") >= 2  # an exact release
    stages = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert stages == ["${BASE_IMAGE}", "${BASE_IMAGE}"]  # build, then the image: one base, chosen by a build argument
    final = text.rsplit("\nFROM ", 1)[1]
    assert "bubblewrap" in final and "COPY --from=build" in final  # the sandbox's strongest tier ships in the image
    assert "ARG EXTRA=gpu" in text and "ARG PIP_CONFIG_FILE" in text and "SETUP_PROFILE=image" in text
    assert "download.pytorch.org" not in text.split("FROM ", 1)[1]  # no index a PyPI-only machine cannot reach
    assert "USER app" in final and "useradd" in final
    assert 'ENTRYPOINT ["python", "-m", "pipeline"]' in final


def test_setup_names_missing_python_headers_instead_of_blaming_the_compiler(tmp_path):
    """A Debian python3 without python3-dev: DeepSpeed's CPU ops cannot build. setup.sh says so, before it
    creates anything, instead of "is a C++ compiler installed?" after minutes of installs (issue 49)."""
    import shutil
    import sys

    (tmp_path / "scripts").mkdir()
    for name in ("scripts/setup.sh", "scripts/check_install.py", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    python = tmp_path / "python3"  # an interpreter whose headers are missing; the rest is the real one
    python.write_text(f'#!/bin/sh\ncase "$2" in *Python.h*) exit 1;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "EXTRA": "cpu", "PYTHON": str(python), "HOME": str(tmp_path)}
    run = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Python's C headers (Python.h) are missing" in run.stderr and "python3-dev" in run.stderr
    assert "C++ compiler" not in run.stderr and not (tmp_path / ".venv").exists()


# --------------------------------------------------------------------------- security defaults


def _checkpoint(path: Path, weights: str, config: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    (path / "tokenizer.json").write_text("{}")
    (path / weights).write_bytes(b"\0")
    return path


def test_checkpoints_load_from_safetensors_only_and_never_run_their_code(tmp_path):
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    pickled = _checkpoint(tmp_path / "pickled", "pytorch_model.bin", {})
    with pytest.raises(ConfigError, match=r"only pickle weights \(pytorch_model.bin\).*safe_serialization=True"):
        load_config(SMOKE, [f"model.source={pickled}"])
    custom = _checkpoint(tmp_path / "custom", "model.safetensors", {"auto_map": {"AutoModel": "modeling_x.XModel"}})
    with pytest.raises(ConfigError, match=r"needs its own model code \(auto_map"):
        load_config(SMOKE, [f"model.source={custom}"])
    fine = _checkpoint(tmp_path / "fine", "model.safetensors", {})
    assert load_config(SMOKE, [f"model.source={fine}"]).model.source == str(fine)

    # Every model load in the stages goes through SAFE_LOAD (safetensors only, no checkpoint code):
    # a new loader that forgets it fails here.
    import ast

    from stages.common.models import GGUF_SAFE_LOAD, SAFE_LOAD

    assert SAFE_LOAD == {"use_safetensors": True, "trust_remote_code": False}
    assert GGUF_SAFE_LOAD == {"trust_remote_code": False}  # a .gguf model.source: tensors, no pickle
    loads = []
    for path in sorted((ROOT / "stages").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.startswith("AutoModelFor")):
                safe = any(k.arg is None and ast.unparse(k.value).endswith("SAFE_LOAD") for k in node.keywords)
                loads.append((f"{path.relative_to(ROOT)}:{node.lineno}", safe))
    assert len(loads) >= 5 and [where for where, safe in loads if not safe] == []
    # and engines: no checkpoint code, safetensors only, unless the config says otherwise (trust_remote_code)
    from stages.common.serving import EngineConfig, engine_kwargs

    kwargs = engine_kwargs(EngineConfig(), fine, gpu=False)
    assert kwargs["trust_remote_code"] is False and kwargs["load_format"] == "safetensors"

