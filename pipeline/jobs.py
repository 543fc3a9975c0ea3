"""Ray Jobs: submit a pipeline run to a Ray cluster, follow it, stop it (Ray's Job Submission SDK).

    python -m pipeline submit configs/full.yaml --address http://HEAD:8265 --wait
    python -m pipeline status JOB_ID        python -m pipeline logs JOB_ID --follow
    python -m pipeline stop JOB_ID

What travels is code and config, as the job's runtime environment: a staged copy of the project's
code (`pipeline/`, `stages/`, `configs/`, `pyproject.toml`) plus the config, resolved on this machine
(overrides applied, relative paths made absolute, so every node reads the same files). The
cluster's Python must already have the dependencies (the same image or `make setup` on every
node): installing torch and vLLM per job would take longer than most runs. The job's driver runs
`python -m pipeline run` on the cluster and joins it through the RAY_ADDRESS Ray sets for it.

`--wait` follows the job's log and exits with the job's outcome: the driver's own exit code
(0 success, 1 a stage failed, 2 configuration error, 3 run dir locked), or 130 when it was stopped.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pipeline.errors import UserError
from pipeline.tracking import PASSWORD_ENV, USERNAME_ENV, is_local_store, redact, redacted_keys

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
SHIPPED = ("pipeline", "stages", "configs", "pyproject.toml")  # what a job needs of the project
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def dashboard_address(address: str | None) -> str:
    """--address, else RAY_API_SERVER_ADDRESS / an http RAY_ADDRESS (as `ray job submit` reads them), else local."""
    if address:
        return address
    for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        value = os.environ.get(var, "")
        if value.startswith(("http://", "https://")):
            return value
    return DEFAULT_ADDRESS


def client(address: str | None):
    from ray.job_submission import JobSubmissionClient

    url = dashboard_address(address)
    try:
        return JobSubmissionClient(url)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(f"--address {url}: no Ray dashboard answers there ({str(exc).splitlines()[0]}); start the "
                        "cluster (`ray start --head`) or pass the head's dashboard URL, e.g. "
                        "--address http://HEAD:8265") from None


def run_args(config_name: str, only=(), from_=None, to=None, force=()) -> list[str]:
    """The `python -m pipeline run ...` command line the job's driver executes."""
    args = ["python", "-m", "pipeline", "run", config_name]
    for name in only:
        args += ["--only", name]
    if from_:
        args += ["--from", from_]
    if to:
        args += ["--to", to]
    for name in force:
        args += ["--force", name]
    return args


def stage_package(cfg, config_name: str, dest: Path) -> Path:
    """Copy the project's code and the resolved config into `dest` (the job's working_dir)."""
    from pipeline.artifacts import PROJECT_ROOT

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SHIPPED:
        src = PROJECT_ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    # The package is stored on the cluster (its GCS, every node's working_dir) and shown by its
    # dashboard: URI passwords stay on this machine (the config holds none for the tracking server:
    # it keeps https://USER@host); the job's nodes authenticate from their own environment
    # (MLFLOW_TRACKING_PASSWORD, AWS_* for the bucket), as `submit` warns.
    (dest / config_name).write_text(yaml.safe_dump(redact(cfg.model_dump(mode="json"), mask=None), sort_keys=False),
                                    encoding="utf-8")
    return dest


def submit(cfg, config_path: Path, address: str | None, selection: dict, console) -> str:
    """Submit the run as a Ray Job; return its submission id."""
    from pipeline.runner import git_version

    jobs = client(address)
    stripped = redacted_keys(cfg.model_dump(mode="json"))
    if stripped:
        console.print(f"[yellow]the job's config carries {', '.join(stripped)} without its password (the package is "
                      "stored on the cluster); the cluster's nodes must supply it themselves[/]")
    env_vars = {"PIPELINE_CODE_VERSION": git_version(), **tracking_user(cfg)}
    if not is_local_store(cfg.tracking_uri) and os.environ.get(PASSWORD_ENV):
        console.print(f"[yellow]the tracking server's password stays on this machine (not in the job's command line, "
                      "config or runtime_env, which the cluster stores and its dashboard shows): the job's driver "
                      f"reads {PASSWORD_ENV} from the environment of the node it runs on (set it where `ray start "
                      "--head` runs) and passes it on to the run's workers[/]")
    name = f"{config_path.stem}.yaml"
    job_id = f"pipeline-{config_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"
    with tempfile.TemporaryDirectory(prefix="pipeline-job-") as tmp:
        package = stage_package(cfg, name, Path(tmp))
        entrypoint = shlex.join(run_args(name, **selection))
        jobs.submit_job(
            entrypoint=entrypoint,
            submission_id=job_id,
            runtime_env={"working_dir": str(package), "env_vars": env_vars},
            metadata={"config": str(config_path), "run_dir": str(cfg.run_dir), "code_version": git_version()},
        )
    console.print(f"submitted [bold]{job_id}[/] to {dashboard_address(address)}: {entrypoint}")
    return job_id


def tracking_user(cfg) -> dict[str, str]:
    """MLFLOW_TRACKING_USERNAME for the job's processes (a user name is no secret; the shipped config
    also names it when the URI did): the user this machine authenticates as since the config loaded."""
    user = os.environ.get(USERNAME_ENV)
    return {USERNAME_ENV: user} if user and not is_local_store(cfg.tracking_uri) else {}


def job_exit_code(status: str, driver_exit_code: int | None) -> int:
    """A finished job's outcome as the exit code `run` would have given (130: stopped)."""
    if status == "STOPPED":
        return 130
    if status == "SUCCEEDED":
        return 0
    return driver_exit_code if driver_exit_code not in (None, 0) else 1


class DeadlinePassed(Exception):
    """`follow` gave up: the job was still running at its deadline."""


def follow(address: str | None, job_id: str, out=None, poll_s: float = 2.0,
           deadline_s: float | None = None) -> str:
    """Print the job's log as it grows until the job ends; return its final status.
    With `deadline_s`: raise `DeadlinePassed` if it is still running that many seconds from now. `out` defaults
    to the sys.stdout of the call (not of the import: a stream replaced since, then closed, would be written to)."""
    out = sys.stdout if out is None else out
    jobs = client(address)
    shown = 0
    end = None if deadline_s is None else time.time() + deadline_s
    while True:
        if end is not None and time.time() > end:
            raise DeadlinePassed(job_id)
        status = str(jobs.get_job_status(job_id).value)
        logs = jobs.get_job_logs(job_id)
        if len(logs) > shown:
            out.write(logs[shown:])
            out.flush()
            shown = len(logs)
        if status in TERMINAL:
            return status
        time.sleep(poll_s)


def job_command(verb: str, job_id: str, address: str | None) -> str:
    """`python -m pipeline VERB JOB_ID [--address URL]`: a command printed about a job reaches the cluster the
    person named, not the default one."""
    import shlex

    return shlex.join(["python", "-m", "pipeline", verb, job_id, *(["--address", address] if address else [])])


def wait(address: str | None, job_id: str, console, deadline_s: float | None = None) -> int:
    """Follow the job to its end; its outcome as `run`'s exit code. Past `deadline_s` the job is
    stopped and the exit code is 1 (a scheduler's run that overran is a failure)."""
    try:
        status = follow(address, job_id, deadline_s=deadline_s)
    except KeyboardInterrupt:
        console.print(f"stopped following; the job keeps running (`{job_command('stop', job_id, address)}` ends it)")
        return 130
    except DeadlinePassed:
        console.print(f"job {job_id}: still running after the {deadline_s:g}s deadline (--deadline); stopping it")
        stop(address, job_id, console)
        return 1
    info = client(address).get_job_info(job_id)
    code = job_exit_code(status, info.driver_exit_code)
    console.print(f"job {job_id}: {status} (exit code {code})")
    return code


def status(address: str | None, job_id: str, console) -> int:
    info = _info(address, job_id)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.start_time / 1000)) if info.start_time else "-"
    took = f"{(info.end_time - info.start_time) / 1000:.1f}s" if info.end_time and info.start_time else "-"
    console.print(f"{job_id}: {info.status.value}" + (f" - {info.message}" if info.message else ""))
    console.print(f"  started {started}, duration {took}, driver exit code "
                  f"{info.driver_exit_code if info.driver_exit_code is not None else '-'}")
    console.print(f"  entrypoint: {info.entrypoint}")
    return 0


def logs(address: str | None, job_id: str, follow_: bool) -> int:
    _info(address, job_id)
    if follow_:
        follow(address, job_id)
    else:
        sys.stdout.write(client(address).get_job_logs(job_id))
    return 0


def stop(address: str | None, job_id: str, console, timeout_s: float = 60) -> int:
    info = _info(address, job_id)
    if info.status.value in TERMINAL:
        console.print(f"{job_id} already ended: {info.status.value}")
        return 0
    jobs = client(address)
    jobs.stop_job(job_id)  # SIGTERM to the driver: the running stage is marked KILLED and leaves no artifact
    deadline = time.time() + timeout_s
    while time.time() < deadline and str(jobs.get_job_status(job_id).value) not in TERMINAL:
        time.sleep(1)
    final = str(jobs.get_job_status(job_id).value)
    console.print(f"{job_id}: {final}")
    if final not in TERMINAL:
        console.print(f"{job_id} is still {final} {timeout_s:g}s after the stop request; check again with "
                      f"`{job_command('status', job_id, address)}` (or raise --timeout)")
        return 1
    return 0


def _info(address: str | None, job_id: str):
    try:
        return client(address).get_job_info(job_id)
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            raise UserError(f"no job {job_id!r} on {dashboard_address(address)}; "
                            "list jobs with `ray job list`") from None
        raise
