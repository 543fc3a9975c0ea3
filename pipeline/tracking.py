"""MLflow lineage: one parent run per pipeline run, one nested run per stage (executed or cached).

Each stage run carries the stage's flattened config as params, its metrics, tags for the cache
key, hit/miss and code version, and its manifest as an artifact; the parent carries the resolved
config. Uses `MlflowClient` with explicit run ids rather than the fluent `mlflow.start_run` API,
so nothing depends on a global "active run" (stages may log from callbacks and other threads).

The default store is SQLite under the run directory, with artifacts beside it; any tracking
server URI works the same way (`mlflow server`, see docs/tracking.md). A server's user and password are
split out of its URI when the config loads and passed as MLflow expects them, in the environment
(`split_credentials`, `take_credentials`, below): no URI the pipeline prints, logs, ships or hashes
carries a password.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
BATCH = 100  # MLflow's limit on params per log_batch call


# scheme://user:password@host -> the password is never logged (a tracking server or object store
# URI can carry one); what the run needs stays in its own config, only what MLflow shows is redacted.
# The password runs from the user's ':' to the last '@' on the line: SQLAlchemy reads a database
# store's password up to an '@', '/' and spaces included (`postgresql://u:pa/ss@db/mlflow`), and it
# may hold an '@' itself; masking too much is safe, too little shows the rest. A ':' followed by digits
# and a '/', a space or the end is a port, not a password (`http://mlflow:5000/path@x` is left alone):
# a password of that shape is not masked.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?!\d+(?:[/\s?#]|$))"
                       r"(?P<secret>[^\n]+)@")
# A database store may carry its password as a query parameter instead (SQLAlchemy and libpq read
# `?password=`, libpq `?sslpassword=`, MySQL `passwd`, `password1`; `postgresql://db/mlflow?user=u&password=pw`):
# any parameter named for a password, secret or token is masked, or dropped with its '&'. The value runs to
# the next '&' or '#' (SQLAlchemy's parse_qsl keeps spaces in it).
_QUERY_SECRET = re.compile(r"(?P<sep>[?&])(?P<name>[\w.-]*(?:password|passwd|pwd|secret|token)[\w.-]*)="
                           r"(?P<secret>[^&#\n]*)", re.I)
_EMPTY_QUERY = re.compile(r"\?(?:&|(?=[#\s]|$))")  # what dropping them leaves: `?&a=1` -> `?a=1`, a bare `?` -> ''


# Where MLflow's REST client reads a tracking server's basic-auth credentials (mlflow.environment_variables).
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


def redact(value: Any, mask: str | None = "***") -> Any:
    """`value` (a string, or dicts/lists of them) with the passwords of any URIs in it masked.

    `mask=None` drops the password instead (`https://user@host`): what a shipped config carries, so
    the reader authenticates from its own environment (MLFLOW_TRACKING_PASSWORD, ...) rather than
    sending the mask as a password."""
    if isinstance(value, str):
        value = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}{'' if mask is None else ':' + mask}@", value)
        value, dropped = _QUERY_SECRET.subn(lambda m: _query_secret(m, mask), value)
        return _EMPTY_QUERY.sub(lambda m: "?" if m[0] == "?&" else "", value) if dropped and mask is None else value
    if isinstance(value, dict):
        return {k: redact(v, mask) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, mask) for v in value]
    return value


def _query_secret(m: re.Match, mask: str | None) -> str:
    """One `?password=...` parameter masked, or (mask None) dropped: `?a=1&password=pw` -> `?a=1`; the '?'
    of a first one stays for the next parameter (`?password=pw&a=1` -> `?&a=1`, tidied by `_EMPTY_QUERY`)."""
    if mask is not None:
        return f"{m['sep']}{m['name']}={mask}"
    return "?" if m["sep"] == "?" else ""


def redacted_keys(value: Any, prefix: str = "") -> list[str]:
    """Dotted keys of `value` (a config dump) whose strings carry a URI password."""
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in redacted_keys(v, f"{prefix}{key}.")]
    if isinstance(value, (list, tuple)):
        return [k for i, v in enumerate(value) for k in redacted_keys(v, f"{prefix}{i}.")]
    return [prefix.rstrip(".")] if isinstance(value, str) and redact(value) != value else []


# --------------------------------------------------------------------------- tracking server credentials
#
# The one place a tracking server's user and password are handled. `mlflow.tracking_uri:
# https://USER:PASSWORD@host` is split when the config is loaded (`take_credentials`, called by the
# config's validator): USER and PASSWORD go to MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD in
# this process's environment, where MLflow's REST client reads them, and the config keeps
# `https://USER@host`: the URI every MlflowClient, message, cache key, summary and submitted job gets
# (`PipelineConfig.tracking_uri`). Processes started from here inherit the environment (a local Ray,
# `mlflow ui`); Ray workers on a cluster get it as the job's runtime_env (`cluster.ensure_ray`).


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(`uri` without its password, user, password) of a tracking server URI.

    `https://alice:pw@host:5000/p` -> ("https://alice@host:5000/p", "alice", "pw"); `https://alice@host`
    -> ("https://alice@host", "alice", None). Percent-escapes in the user and password are decoded
    (an '@' in a password may be written as %40 or as it is; '/', '?' and '#' must be escaped). Only
    http(s) URIs are split: a database store's URI (postgresql://user:pw@db/mlflow) is SQLAlchemy's
    to read, returned as it is."""
    from urllib.parse import quote, unquote

    bare, userinfo = _userinfo(uri)
    if userinfo is None:
        return uri, None, None
    user, has_password, password = userinfo.partition(":")
    user = unquote(user) or None
    scheme, _, rest = bare.partition("://")
    return (f"{scheme}://{quote(user, safe='')}@{rest}" if user else bare, user,
            unquote(password) if has_password and password else None)


def _userinfo(uri: str) -> tuple[str, str | None]:
    """(`uri` without user and password, the `user:password` it had) for http(s); else (uri, None)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
    except ValueError:  # e.g. an unbalanced '[' in the host: MLflow will say what is wrong with it
        return uri, None
    if parts.scheme.lower() not in ("http", "https") or "@" not in parts.netloc:
        return uri, None
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=host)), userinfo


def take_credentials(uri: str) -> str:
    """Export the user and password of a tracking server URI to this process's environment (where
    MLflow reads them) and return the URI without the password (`https://alice@host`).

    The URI's user replaces MLFLOW_TRACKING_USERNAME; a URI with a user and no password takes the
    password from MLFLOW_TRACKING_PASSWORD (what a submitted job's config carries)."""
    clean, user, password = split_credentials(uri)
    if user:
        os.environ[USERNAME_ENV] = user
    if password:
        os.environ[PASSWORD_ENV] = password
    return clean


def credentials_env() -> dict[str, str]:
    """The tracking credentials of this process's environment, for processes that do not inherit it
    (Ray workers on other nodes: `cluster.ensure_ray` puts them in the job's runtime_env)."""
    return {k: os.environ[k] for k in (USERNAME_ENV, PASSWORD_ENV) if os.environ.get(k)}


def is_local_store(tracking_uri: str) -> bool:
    """A store that lives in files of the machine that opens it (SQLite, a file store, a bare path)."""
    scheme = tracking_uri.partition("://")[0].lower() if "://" in tracking_uri else ""
    return scheme in ("", "file") or scheme.startswith("sqlite")


def local_store_path(tracking_uri: str) -> Path | None:
    """The file or folder of a local store (`sqlite:///runs/x/mlflow.db`, `file:///...`, a bare path); None for
    a server."""
    if not is_local_store(tracking_uri):
        return None
    if tracking_uri.lower().startswith("sqlite"):
        return Path(tracking_uri.partition(":///")[2]) if ":///" in tracking_uri else None
    return Path(tracking_uri.removeprefix("file://"))


def require_run(tracking_uri: str, what: str, command: str = "ui") -> None:
    """A command that reads a run (`ui`; `serve` and `batch-infer` of a registered model) finds its tracking
    store where it was told, or stops with exit 2: MLflow would create an empty store there and serve or
    search it without a word (issue 59: `ui configs/full.yaml` after a run with run_dir=runs/elsewhere).
    `what` begins the message (the command, or the model URI); `command` is the example's."""
    path = local_store_path(tracking_uri)
    if path is not None and not path.exists():
        from pipeline.errors import UserError

        raise UserError(f"{what}: no run has tracked to {path} (it does not exist), so there is nothing to read "
                        "there; give the command the config and overrides the run was started with (the run's "
                        f"summary prints them, e.g. `python -m pipeline {command} configs/full.yaml "
                        "run_dir=runs/elsewhere`), or run the pipeline first")


def cluster_store_problem(tracking_uri: str, nodes: int) -> str | None:
    """Why `tracking_uri` cannot serve a run on `nodes` Ray nodes, or None.

    Training workers and tune trials log to the store from whatever node they run on: a SQLite
    file (or file store) is a different file on each node, or one file shared over a network
    filesystem, where SQLite's locking is not safe. A tracking server is one store for all."""
    if nodes <= 1 or not is_local_store(tracking_uri):
        return None
    return (f"mlflow.tracking_uri: the Ray cluster has {nodes} nodes and the tracking store is a local file "
            f"({redact(tracking_uri)}), which workers on other nodes cannot share; run a tracking server "
            "(`mlflow server --host 0.0.0.0 --port 5000 --backend-store-uri sqlite:///mlflow.db`) and set "
            "mlflow.tracking_uri: http://HOST:5000")


def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    """Params in batches within MLflow's limits (100 per call, 6000 characters per value), redacted."""
    from mlflow.entities import Param

    items = [Param(k, redact(str(v))[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
    for i in range(0, len(items), BATCH):
        client.log_batch(run_id, params=items[i : i + BATCH])


def log_metrics(client, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
    """Metrics at one step, in batches of MLflow's 1000-per-call limit."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
    for i in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[i : i + 1000])


def check_reachable(tracking_uri: str, timeout: float = 5.0) -> None:
    """Fail fast on an unreachable tracking server (MLflow's client would retry for minutes).

    Asks `<uri>/health` with basic auth when there are credentials (the URI's user and password, else
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), as a server behind an authenticating proxy
    requires; no message names the password."""
    uri, user, password = split_credentials(tracking_uri)
    if not uri.startswith(("http://", "https://")):
        return
    import base64
    import urllib.error
    import urllib.request

    from pipeline.errors import UserError

    user, password = user or os.environ.get(USERNAME_ENV), password or os.environ.get(PASSWORD_ENV)
    # urllib would take `user@host` for the host name: the request goes to the URI without user info.
    request = urllib.request.Request(_userinfo(uri)[0].rstrip("/") + "/health")
    if user and password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")

    def hidden(text: str) -> str:  # what the server or the OS says, never with the password in it
        return redact(text).replace(password, "***") if password else redact(text)

    try:
        urllib.request.urlopen(request, timeout=timeout).close()
    except urllib.error.HTTPError as exc:
        if exc.code not in (401, 403):
            raise UserError(f"mlflow.tracking_uri: {uri} answered HTTP {exc.code} to /health "
                            f"({hidden(str(exc.reason))}); is it an MLflow tracking server?") from None
        raise credentials_refused(uri, exc.code, user, password) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise UserError(f"mlflow.tracking_uri: cannot reach {uri} ({hidden(str(getattr(exc, 'reason', exc)))}); "
                        "start the server (`mlflow server --host 127.0.0.1 --port 5000`) or leave it empty for the "
                        "local SQLite store") from None


def credentials_refused(uri: str, code: int, user: str | None = None, password: str | None = None):
    """The UserError for a tracking server that answered 401/403: which credentials were sent (never
    the password itself) and where they come from."""
    from pipeline.errors import UserError

    user, password = user or os.environ.get(USERNAME_ENV), password or os.environ.get(PASSWORD_ENV)
    sent = (f"user {user!r} with a password" if user and password else
            f"user {user!r} without a password ({PASSWORD_ENV} is not set here)" if user else
            f"a password without a user ({USERNAME_ENV} is not set here)" if password else "no credentials")
    return UserError(f"mlflow.tracking_uri: {uri} refused the request (HTTP {code}; sent {sent}); give the "
                     "credentials in the URI (https://USER:PASSWORD@host, percent-escaping special characters) or "
                     f"as {USERNAME_ENV} / {PASSWORD_ENV} in the environment (a job run by `submit` takes the "
                     "password from the cluster's environment, see docs/operations.md, Ray Jobs)")


# MLflow 3's UI opens an experiment without this tag in its GenAI view (traces, "Evaluations");
# a model-training experiment opens on the runs table, where stages and runs compare.
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."  # + key: a runs-table view the UI opens with ?viewStateShareKey=key


def share_runs_view(client, experiment_id: str, metric_columns: list[str]) -> str:
    """Store the experiment's runs-table view for the UI and return its key.

    MLflow's UI (3.17) shows only the Source, Models and Dataset columns and keeps stage runs
    folded under their parent unless a person picks columns and expands each run by hand; a view
    shared through an experiment tag can set the columns and the order, not the expansion. Runs
    sorted by end time (latest first) are listed flat - the UI nests child runs only when sorted
    by start time - so each pipeline run is followed by its stages, each with its headline metrics."""
    state = {"orderByKey": "attributes.end_time", "orderByAsc": False, "searchFilter": "",
             "selectedColumns": ["attributes.`Source`", "attributes.`Models`", "attributes.`Dataset`",
                                 *(f"metrics.`{m}`" for m in metric_columns)]}
    value = json.dumps(state, separators=(",", ":"))
    key = "pipeline-" + hashlib.sha256(value.encode()).hexdigest()[:12]
    client.set_experiment_tag(experiment_id, SHARED_VIEW_PREFIX + key, value)
    return key


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str, run_dir: Path, run_name: str, tags: dict[str, str]):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        check_reachable(tracking_uri)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        try:
            exp = self.client.get_experiment_by_name(experiment)
        except MlflowException as exc:  # a server whose /health is open (MLflow's own auth) refuses here
            if exc.get_http_status_code() in (401, 403):
                raise credentials_refused(split_credentials(tracking_uri)[0], exc.get_http_status_code()) from None
            raise
        if exp is None:
            # A local store keeps artifacts beside it; a server decides for itself (mlflow-artifacts:/).
            location = (run_dir / "mlartifacts").as_uri() if is_local_store(tracking_uri) else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location,
                                                               tags={EXPERIMENT_KIND: MODEL_TRAINING})
        else:
            self.experiment_id = exp.experiment_id
            if EXPERIMENT_KIND not in exp.tags:  # made by an older version: MLflow guessed it was GenAI
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        self.parent_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id

    def start_stage(self, stage: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        run = self.client.create_run(
            self.experiment_id, run_name=stage, tags={"mlflow.parentRunId": self.parent_id, "stage": stage, **tags}
        )
        log_params(self.client, run.info.run_id, params)
        return run.info.run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
        log_metrics(self.client, run_id, metrics, step)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, v)

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_dict(self, run_id: str, data: Any, name: str) -> None:
        self.client.log_dict(run_id, redact(data), name)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)
