"""A tracking server with a user and password (issue 32, item 4): the URI's credentials are split out
at load and passed as MLflow expects them (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), and
the password shows up nowhere: no console line, error, `--json`, run_dir file, MLflow param or tag,
cache key or job submission. Changing only the password reruns nothing."""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import ROOT, SMOKE, smoke_config

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 2, "ray": 1}

PLANTED = "s3cret-PLANTED"  # a password nothing may show
USER = "alice"
CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


@pytest.fixture(autouse=True)
def no_credentials(monkeypatch):
    """Start without tracking credentials in the environment, and take back whatever a config load
    exported into it (monkeypatch restores the variables it recorded)."""
    for name in CREDENTIAL_VARS:
        monkeypatch.setenv(name, "recorded")
        monkeypatch.delenv(name)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@contextlib.contextmanager
def auth_server(passwords=(PLANTED,), upstream: str | None = None, open_health: bool = False):
    """An HTTP server on 127.0.0.1 that answers 401 to any request without basic auth USER and one of
    `passwords`, and otherwise 200 on /health, or (with `upstream`, host:port) forwards the request
    there: an authenticating proxy in front of a tracking server. With `open_health`, /health answers
    anyone (as MLflow's own basic-auth app does). Yields (url, seen) where `seen`
    lists (method, path, authorised) of every request."""
    allowed = {_basic(USER, p) for p in passwords}
    seen: list[tuple[str, str, bool]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _handle(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            ok = self.headers.get("Authorization") in allowed or (open_health and self.path == "/health")
            seen.append((self.command, self.path, ok))
            if not ok:
                return self._reply(401, b"authentication required", {"WWW-Authenticate": 'Basic realm="mlflow"'})
            if upstream is None:
                return self._reply(200 if self.path == "/health" else 404, b"OK" if self.path == "/health" else b"")
            conn = http.client.HTTPConnection(upstream, timeout=120)
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("host", "authorization", "connection", "content-length")}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            self._reply(resp.status, data, {k: v for k, v in resp.getheaders()
                                           if k.lower() not in ("content-length", "transfer-encoding", "connection")})

        def _reply(self, code: int, body: bytes, headers: dict | None = None):
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- check_reachable


def test_check_reachable_authenticates_with_the_uris_user_and_never_shows_the_password(monkeypatch):
    from pipeline.errors import UserError
    from pipeline.tracking import check_reachable

    with auth_server() as (url, seen):
        host = url.removeprefix("http://")
        check_reachable(f"http://{USER}:{PLANTED}@{host}")  # urllib alone takes "alice:s3cret..." for the host
        assert seen[-1] == ("GET", "/health", True)

        with pytest.raises(UserError) as refused:  # a wrong password: refused, and said so without it
            check_reachable(f"http://{USER}:wrong-PLANTED@{host}")
        assert "refused" in str(refused.value) and "alice" in str(refused.value)
        assert "wrong-PLANTED" not in str(refused.value)

        with pytest.raises(UserError) as anonymous:  # no credentials at all
            check_reachable(url)
        assert "refused" in str(anonymous.value) and "MLFLOW_TRACKING_PASSWORD" in str(anonymous.value)

        # The `user@host` form a submitted job's config carries: the password from the environment.
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PLANTED)
        check_reachable(f"http://{USER}@{host}")
        assert seen[-1] == ("GET", "/health", True)

    with pytest.raises(UserError) as down:  # nothing listens there
        check_reachable(f"http://{USER}:{PLANTED}@127.0.0.1:1")
    assert "cannot reach http://alice@127.0.0.1:1" in str(down.value) and PLANTED not in str(down.value)


def test_a_server_whose_health_check_is_open_refuses_at_the_first_call_and_says_why_without_the_password(tmp_path):
    from pipeline.errors import UserError
    from pipeline.tracking import Tracker

    cfg = smoke_config(tmp_path / "run", "mlflow.tracking_uri=http://alice:wrong-PLANTED@127.0.0.1:1")
    with auth_server(open_health=True) as (url, seen):
        uri = cfg.tracking_uri.replace("127.0.0.1:1", url.removeprefix("http://"))
        with pytest.raises(UserError) as refused:
            Tracker(uri, "posttrain", tmp_path / "run", run_name="x", tags={})
    assert "refused the request (HTTP 401; sent user 'alice' with a password)" in str(refused.value)
    assert "PLANTED" not in str(refused.value)
    assert [path.partition("?")[0] for _, path, _ in seen] == ["/health", "/api/2.0/mlflow/experiments/get-by-name"]


def test_split_credentials_leaves_database_uris_and_plain_uris_alone():
    from pipeline.tracking import split_credentials

    assert split_credentials(f"https://{USER}:{PLANTED}@mlflow.internal:5000/x") == (
        "https://alice@mlflow.internal:5000/x", USER, PLANTED)
    assert split_credentials("https://alice@h") == ("https://alice@h", "alice", None)
    assert split_credentials("http://a:p%40ss@h:1") == ("http://a@h:1", "a", "p@ss")  # escaped
    assert split_credentials("http://a:p@ss@h:1/p") == ("http://a@h:1/p", "a", "p@ss")  # or not
    assert split_credentials("http://:pw@h") == ("http://h", None, "pw")
    for uri in ("http://h:5000", "sqlite:////runs/mlflow.db", "postgresql://u:pw@db/mlflow", "/runs/mlruns"):
        assert split_credentials(uri) == (uri, None, None)


def test_what_mlflow_shows_has_the_passwords_of_uris_masked(tmp_path, tracking_uri):
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import Tracker, redact

    assert redact("http://alice:s3cret@mlflow.internal:5000") == "http://alice:***@mlflow.internal:5000"
    assert redact({"a": ["s3://k:v@minio/b", "plain", 3]}) == {"a": ["s3://k:***@minio/b", "plain", 3]}
    assert redact("http://mlflow:5000/path@x") == "http://mlflow:5000/path@x"  # no user info: unchanged
    client = MlflowClient(tracking_uri)
    exp = client.create_experiment(f"redact-{tmp_path.name}")
    run_id = client.create_run(exp).info.run_id
    from pipeline.tracking import log_params

    log_params(client, run_id, {"storage.endpoint_url": "http://key:topsecret@minio:9000"})
    Tracker.log_dict(type("T", (), {"client": client})(), run_id, {"uri": "https://u:topsecret@h/x"}, "cfg.json")
    run = client.get_run(run_id)
    assert run.data.params["storage.endpoint_url"] == "http://key:***@minio:9000"
    logged = open(client.download_artifacts(run_id, "cfg.json")).read()
    assert "topsecret" not in logged and "u:***@h" in logged


# --------------------------------------------------------------------------- the config


def test_the_password_goes_to_the_environment_never_into_the_config(tmp_path):
    cfg = smoke_config(tmp_path / "run", f"mlflow.tracking_uri=https://{USER}:{PLANTED}@mlflow.internal:5000")
    # What MLflow, messages, cache keys and --json get, validate shows and submit ships.
    assert cfg.tracking_uri == cfg.mlflow.tracking_uri == "https://alice@mlflow.internal:5000"
    assert PLANTED not in json.dumps(cfg.model_dump(mode="json")) and PLANTED not in repr(cfg)
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == USER and os.environ["MLFLOW_TRACKING_PASSWORD"] == PLANTED

    # The shipped form: the user from the URI, the password left as the environment has it.
    os.environ["MLFLOW_TRACKING_PASSWORD"] = "from-the-cluster"
    shipped = smoke_config(tmp_path / "run", "mlflow.tracking_uri=https://bob@mlflow.internal:5000")
    assert shipped.tracking_uri == "https://bob@mlflow.internal:5000"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "bob"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "from-the-cluster"


def test_changing_only_the_password_keeps_every_cache_key(tmp_path):
    from pipeline.runner import build_plan

    every_stage = ("stages.batch_infer.source=policy_model", "stages.tune.target=sft",
                   "stages.tune.search_space.lr.grid=[0.001, 0.01]")

    def plan(uri):
        return {p.spec.name: p for p in build_plan(smoke_config(tmp_path / "run", f"mlflow.tracking_uri={uri}",
                                                                *every_stage))}

    first = plan(f"https://{USER}:{PLANTED}@mlflow.internal:5000")
    second = plan(f"https://{USER}:another-PLANTED@mlflow.internal:5000")
    assert set(first) == {"model", "data", "sft", "tune", "reward", "ppo", "serve", "batch_infer"}
    assert {n: p.key for n, p in first.items()} == {n: p.key for n, p in second.items()}
    # What serve's attempt.json and manifest record of the registry it registers in: scheme, user, host.
    assert first["serve"].components["config"]["tracking_uri"] == "https://alice@mlflow.internal:5000"
    assert all(PLANTED not in json.dumps(p.components, default=str) for p in first.values())
    # Another server is still another registry.
    assert plan(f"https://{USER}:{PLANTED}@other.internal:5000")["serve"].key != first["serve"].key


# --------------------------------------------------------------------------- database stores

DATABASE_URIS = (f"postgresql://{USER}:{PLANTED}@db.internal:5432/mlflow",
                 f"mysql+pymysql://{USER}:{PLANTED}@db.internal/mlflow",
                 f"postgresql://db.internal/mlflow?user={USER}&password={PLANTED}&sslmode=require")


def test_redact_masks_userinfo_and_query_string_passwords():
    from pipeline.tracking import redact, redacted_keys

    assert redact(DATABASE_URIS[0]) == "postgresql://alice:***@db.internal:5432/mlflow"
    assert redact(DATABASE_URIS[1], mask=None) == "mysql+pymysql://alice@db.internal/mlflow"
    assert redact(DATABASE_URIS[2]) == "postgresql://db.internal/mlflow?user=alice&password=***&sslmode=require"
    assert redact(DATABASE_URIS[2], mask=None) == "postgresql://db.internal/mlflow?user=alice&sslmode=require"
    assert redact("postgresql://h/db?password=pw", mask=None) == "postgresql://h/db"
    assert redact("postgresql://h/db?PASSWORD=pw&a=1", mask=None) == "postgresql://h/db?a=1"
    assert redacted_keys({"mlflow": {"tracking_uri": DATABASE_URIS[2]}}) == ["mlflow.tracking_uri"]


@pytest.mark.parametrize("uri, masked, dropped", [
    # SQLAlchemy reads a password up to the '@' ('/' and spaces included); the redaction stopped at '/' or a
    # space and showed the rest (issue 59, item 9).
    ("postgresql://u:pa/ss@db/mlflow", "postgresql://u:***@db/mlflow", "postgresql://u@db/mlflow"),
    ("postgresql://u:pa ss@db:5432/mlflow", "postgresql://u:***@db:5432/mlflow", "postgresql://u@db:5432/mlflow"),
    ("mysql+pymysql://u:p@s/s w@db/mlflow", "mysql+pymysql://u:***@db/mlflow", "mysql+pymysql://u@db/mlflow"),
    ("s3://KEY:abc/def+ghi@minio/bucket", "s3://KEY:***@minio/bucket", "s3://KEY@minio/bucket"),
    # libpq's `sslpassword` (the client key's passphrase), and any parameter named for a password or secret
    ("postgresql://db/mlflow?sslmode=require&sslpassword=k3y", "postgresql://db/mlflow?sslmode=require&sslpassword=***",
     "postgresql://db/mlflow?sslmode=require"),
    ("postgresql://db/mlflow?user=u&password=pa ss&a=1", "postgresql://db/mlflow?user=u&password=***&a=1",
     "postgresql://db/mlflow?user=u&a=1"),
    ("mysql://db/m?pwd=x&passwd=y&password1=z", "mysql://db/m?pwd=***&passwd=***&password1=***", "mysql://db/m"),
    ("https://h/x?api_secret=s&token=t", "https://h/x?api_secret=***&token=***", "https://h/x"),
])
def test_redact_masks_passwords_with_slashes_spaces_and_named_parameters(uri, masked, dropped):
    from pipeline.tracking import redact, redacted_keys

    assert redact(uri) == masked
    assert redact(uri, mask=None) == dropped
    assert redacted_keys({"mlflow": {"tracking_uri": uri}}) == ["mlflow.tracking_uri"]


@pytest.mark.parametrize("text", [
    "http://mlflow:5000/path@x",  # a port and a path holding an '@': no user info
    "http://127.0.0.1:5000 (mail admin@corp.example)",
    "models:/posttrain-policy@champion",
    "postgresql://db.internal:5432/mlflow",
    "https://h/x?sslmode=require&user=u",
])
def test_redact_leaves_uris_without_a_password_alone(text):
    from pipeline.tracking import redact

    assert redact(text) == text


@pytest.mark.parametrize("uri", [*DATABASE_URIS, f"https://{USER}:{PLANTED}@mlflow.internal"])
def test_a_database_stores_password_is_in_no_summary_plan_or_ui_line(tmp_path, uri, monkeypatch):
    """A database store's URI keeps its password (SQLAlchemy reads it from there), so each place that
    shows or writes the URI redacts it: `run --json`, the cache key's components (manifests,
    attempt.json, MLflow params) and what `ui` prints and puts on its command line."""
    from rich.console import Console

    from pipeline import ui
    from pipeline.reports import json_summary
    from pipeline.runner import build_plan
    from pipeline.tracking import redact

    cfg = smoke_config(tmp_path / "run", f"mlflow.tracking_uri={uri}", "stages.batch_infer.source=policy_model")
    plan = build_plan(cfg)
    summary = json_summary(cfg, {"plan": plan}, 0, None)
    assert PLANTED not in json.dumps(summary) and summary["tracking_uri"] == redact(cfg.tracking_uri)
    assert all(PLANTED not in json.dumps(p.components, default=str) for p in plan)
    other = build_plan(smoke_config(tmp_path / "run", f"mlflow.tracking_uri={uri.replace(PLANTED, 'other-pw')}",
                                    "stages.batch_infer.source=policy_model"))
    assert [p.key for p in plan] == [p.key for p in other]  # another password is the same store

    seen = {}
    monkeypatch.setattr(ui, "ui_url", lambda cfg, port: f"http://127.0.0.1:{port}/")
    monkeypatch.setattr(ui, "_run_server", lambda cmd, env: seen.update(cmd=cmd, env=env))  # None: Ctrl-C ended it
    console = Console(record=True, width=300)
    assert ui.run_ui(cfg, 5999, 1, console) == 0
    assert PLANTED not in console.export_text() and PLANTED not in " ".join(seen.get("cmd", []))
    if "cmd" in seen:  # a database store: the UI's server gets the whole URI, in its environment
        assert seen["env"]["MLFLOW_BACKEND_STORE_URI"] == uri


# --------------------------------------------------------------------------- Ray workers and jobs


def test_cluster_workers_get_the_credentials_in_the_jobs_runtime_env(monkeypatch, tmp_path):
    import ray

    from pipeline import cluster
    from pipeline.config import RayConfig

    smoke_config(tmp_path / "run", f"mlflow.tracking_uri=https://{USER}:{PLANTED}@mlflow.internal:5000")
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2}}])
    monkeypatch.setattr(cluster, "_check_reachable", lambda address: None)
    monkeypatch.setattr(cluster, "capture_ray_logs", lambda: None)
    monkeypatch.delenv(cluster.JOB_DRIVER_ENV, raising=False)

    assert cluster.ensure_ray(RayConfig(address="10.0.0.1:6379"))
    assert calls[-1]["runtime_env"]["env_vars"] == {"MLFLOW_TRACKING_USERNAME": USER,
                                                    "MLFLOW_TRACKING_PASSWORD": PLANTED}
    assert calls[-1]["runtime_env"]["working_dir"]

    # A submitted job's driver: its job's runtime_env already has the user (Ray refuses a key set twice).
    monkeypatch.setenv(cluster.JOB_DRIVER_ENV, json.dumps(
        {"runtime_env": {"working_dir": "gcs://x.zip", "env_vars": {"MLFLOW_TRACKING_USERNAME": USER}}}))
    assert cluster.ensure_ray(RayConfig(address="auto"))
    assert calls[-1]["runtime_env"] == {"env_vars": {"MLFLOW_TRACKING_PASSWORD": PLANTED},
                                        "worker_process_setup_hook": "pipeline.own_cluster.address_own_cluster"}


def test_submit_ships_the_user_but_never_the_password(monkeypatch, tmp_path):
    from rich.console import Console

    from pipeline import jobs

    submitted = {}

    class FakeJobs:
        def submit_job(self, **kw):
            package = Path(kw["runtime_env"]["working_dir"])
            submitted.update(kw, files="\n".join(p.read_text(errors="replace") for p in package.rglob("*.yaml")))

    monkeypatch.setattr(jobs, "client", lambda address: FakeJobs())
    cfg = smoke_config(tmp_path / "run", f"mlflow.tracking_uri=https://{USER}:{PLANTED}@mlflow.internal:5000")
    console = Console(record=True, width=200)
    jobs.submit(cfg, SMOKE, "http://127.0.0.1:8265", {"only": [], "from_": None, "to": None, "force": []}, console)
    shown = console.export_text()
    assert PLANTED not in json.dumps({k: v for k, v in submitted.items() if k != "files"}) + submitted["files"] + shown
    assert submitted["runtime_env"]["env_vars"]["MLFLOW_TRACKING_USERNAME"] == USER
    assert "https://alice@mlflow.internal:5000" in submitted["files"]
    assert "MLFLOW_TRACKING_PASSWORD" in shown  # says where the job's driver takes the password from


def test_job_package_leaves_uri_passwords_on_the_submitting_machine(tmp_path):
    from pipeline.config import load_config
    from pipeline.jobs import stage_package
    from pipeline.tracking import redacted_keys

    # (the load exports the tracking credentials; the autouse `no_credentials` takes them back after)
    cfg = smoke_config(tmp_path / "run", "mlflow.tracking_uri=https://alice:s3cret@mlflow.internal:5000",
                       "storage.endpoint_url=http://key:t0psecret@minio:9000")
    # The tracking password went to the environment at load; another URI's stays, to be dropped here.
    assert redacted_keys(cfg.model_dump(mode="json")) == ["storage.endpoint_url"]
    package = stage_package(cfg, "smoke.yaml", tmp_path / "pkg")
    text = (package / "smoke.yaml").read_text()
    assert "s3cret" not in text and "t0psecret" not in text
    # The user stays; the password comes from the node's MLFLOW_TRACKING_PASSWORD, not a "***" mask.
    assert load_config(package / "smoke.yaml").mlflow.tracking_uri == "https://alice@mlflow.internal:5000"


@pytest.mark.slow
def test_a_local_rays_workers_inherit_the_credentials(tmp_path):
    """A local Ray starts after the config loaded: its workers (Train ranks, trials) have the credentials."""
    script = f"""
import ray
from pipeline.cluster import ensure_ray, shutdown_ray
from pipeline.config import load_config
cfg = load_config({str(SMOKE)!r}, ["run_dir={tmp_path / 'run'}",
                                   "mlflow.tracking_uri=https://{USER}:{PLANTED}@mlflow.internal:5000"])
assert ensure_ray(cfg.ray)
import os
env = ray.get(ray.remote(lambda: (os.environ.get("MLFLOW_TRACKING_USERNAME"),
                                   os.environ.get("MLFLOW_TRACKING_PASSWORD"))).remote())
shutdown_ray()
print("WORKER", *env)
"""
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARS and k != "RAY_ADDRESS"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=env)
    assert f"WORKER {USER} {PLANTED}" in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------- end to end


def _files_containing(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.slow
def test_a_run_against_an_authenticated_server_shows_the_password_nowhere(tmp_path):
    """A tracking server behind basic auth (an authenticating proxy in front of a real `mlflow server`):
    the run authenticates, nothing it printed or wrote (run_dir, the server's store) holds the
    password, and a rerun with only the password changed is all cache hits. The run's stage is tracked
    on the server, in the configured experiment, and nothing goes to the local default store (what
    tests/test_mlflow_server.py checked with a server of its own)."""
    from helpers.cluster import free_port
    from helpers.mlflow_server import mlflow_server

    store = tmp_path / "server"
    store.mkdir()
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARS}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, env=env)

    with mlflow_server(store, free_port()) as upstream, \
            auth_server((PLANTED, "another-PLANTED"), upstream.removeprefix("http://")) as (url, seen):
        host = url.removeprefix("http://")
        uri = f"mlflow.tracking_uri=http://{USER}:{PLANTED}@{host}"
        exp_name = "mlflow.experiment=server-test"
        results = [cli("validate", str(SMOKE), f"run_dir={run_dir}", uri, exp_name),
                   cli("plan", str(SMOKE), f"run_dir={run_dir}", uri, exp_name, "--to", "model"),
                   cli("ui", str(SMOKE), f"run_dir={run_dir}", uri, exp_name),  # a server: prints its address
                   cli("run", str(SMOKE), f"run_dir={run_dir}", uri, exp_name, "--to", "model", "--json")]
        assert f"open http://{USER}@{host} in a browser" in results[2].stdout
        assert results[-1].returncode == 0, results[-1].stderr[-3000:]
        assert not (run_dir / "mlflow.db").exists()  # nothing went to the local default store
        summary = json.loads(results[-1].stdout)
        assert summary["tracking_uri"] == f"http://{USER}@{host}"
        assert {s["name"]: s["status"] for s in summary["stages"]}["model"] == "miss"
        # The rerun with only the password changed: nothing reruns (the server takes both passwords).
        again = cli("run", str(SMOKE), f"run_dir={run_dir}", "--to", "model", "--json", exp_name,
                    f"mlflow.tracking_uri=http://{USER}:another-PLANTED@{host}")
        assert again.returncode == 0, again.stderr[-3000:]
        assert {s["name"]: s["status"] for s in json.loads(again.stdout)["stages"]}["model"] == "hit"
        authorised = list(seen)
        # A wrong password: exit 2, said without it.
        wrong = cli("run", str(SMOKE), f"run_dir={tmp_path / 'other'}", "--to", "model", "--json", exp_name,
                    f"mlflow.tracking_uri=http://{USER}:wrong-PLANTED@{host}")
        assert wrong.returncode == 2 and "refused" in wrong.stderr
        assert "wrong-PLANTED" not in wrong.stdout + wrong.stderr

        from mlflow.tracking import MlflowClient

        os.environ.update({"MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": PLANTED})
        client = MlflowClient(url)
        exp = client.get_experiment_by_name("server-test")
        runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
        assert {r.info.run_name for r in runs} >= {"model"}
        logged = json.dumps([[r.data.params, r.data.tags] for r in runs])
        # The first run's stage run (the rerun's was a cache hit): finished, keyed, with its config,
        # metrics and manifest on the server.
        parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
        stage = next(r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
        assert stage.info.run_name == "model" and stage.info.status == "FINISHED"
        assert stage.data.tags["cache"] == "miss" and len(stage.data.tags["cache_key"]) == 16
        assert stage.data.params["model.builtin.hidden_size"] == "64"
        assert stage.data.metrics["num_parameters"] > 1000
        manifest = client.download_artifacts(stage.info.run_id, "manifest.json", str(tmp_path))
        assert '"stage": "model"' in open(manifest).read()

    assert authorised and all(ok for _, _, ok in authorised), [s for s in authorised if not s[2]][:5]
    assert any(path.startswith("/api/2.0/mlflow/runs/create") for _, path, _ in authorised)
    assert any(path.startswith("/api/2.0/mlflow-artifacts/artifacts") for _, path, _ in authorised)  # manifests
    printed = "".join(r.stdout + r.stderr for r in [*results, again])
    assert "PLANTED" not in printed, [line for line in printed.splitlines() if "PLANTED" in line][:5]
    assert "PLANTED" not in logged
    assert not _files_containing(run_dir, b"PLANTED")  # manifests, attempt.json, logs, fingerprints...
    assert not _files_containing(store, b"PLANTED")  # the server's store: params, tags, artifacts
