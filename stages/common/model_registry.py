"""The MLflow Model Registry: register a trained model, fetch one back by `models:/NAME@ALIAS`.

    info = register(client, "posttrain-policy", "champion", model_dir, run_id, tags={...})
    path = fetch("models:/posttrain-policy@champion", tracking_uri, cache_dir)   # a local HF directory

A version's files are the model directory exactly as `save_pretrained` wrote it (config, safetensors
weights, tokenizer, chat template), logged as the artifact `model` of the serve stage's MLflow run:
any machine that reaches the tracking server (and its artifact store) can fetch it and load it with
`from_pretrained` or vLLM. We use `MlflowClient`'s registry calls rather than a flavor's
`log_model` (e.g. `mlflow.transformers`), which would load the whole model into memory to save it
again and would store it in its own layout; vLLM and Ray Serve LLM read the plain HF layout.

A version is created only for a model whose files changed: each version is tagged with a hash of
its files (`model_hash`), and registering a model whose hash an existing version has reuses that
version (and moves the alias back to it), so rerunning the pipeline adds no version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.tracking import redact

HASH_TAG = "model_hash"


def model_hash(model_dir: Path) -> str:
    """A content hash of every file under `model_dir` (names and bytes), independent of its location."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        h.update(str(path.relative_to(model_dir)).encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def model_uri(name: str, alias: str) -> str:
    return f"models:/{name}@{alias}"


def _existing_version(client, name: str, digest: str):
    """The registered version of `name` whose files hash to `digest`, if there is one."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except MlflowException:
        return None
    same = [v for v in versions if v.tags.get(HASH_TAG) == digest]
    return max(same, key=lambda v: int(v.version)) if same else None


def register(client, name: str, alias: str, model_dir: Path, run_id: str, tags: dict[str, str]) -> dict:
    """Register `model_dir` as a version of `name` (new only if its files changed) and point `alias` at it.

    Returns {"name", "version", "alias", "uri", "model_hash", "new_version"}. `tags` (pipeline run,
    cache key, key metrics) are set on the version; an existing version's tags are kept as they are,
    since they describe the run that produced it.
    """
    from mlflow.exceptions import MlflowException

    digest = model_hash(model_dir)
    version = _existing_version(client, name, digest)
    new = version is None
    if new:
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description="Registered by the post-training pipeline's serve stage.")
        client.log_artifacts(run_id, str(model_dir), "model")
        source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/model"
        version = client.create_model_version(name, source, run_id=run_id,
                                              tags={HASH_TAG: digest, **{k: str(v) for k, v in tags.items()}})
    client.set_registered_model_alias(name, alias, version.version)
    return {"name": name, "version": int(version.version), "alias": alias, "uri": model_uri(name, alias),
            "model_hash": digest, "new_version": new, "source_run_id": version.run_id}


def fetch(uri: str, tracking_uri: str, cache_dir: Path) -> Path:
    """A local directory holding the model behind `uri`.

    A local path is returned as it is. A `models:/NAME@ALIAS` or `models:/NAME/VERSION` URI is
    resolved to its version and downloaded once into `cache_dir/NAME/VERSION-<hash of tracking URI,
    run id, source and model hash>` (into a temporary
    directory first, renamed when complete: an interrupted download is never taken as a model).
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from pipeline.errors import UserError
    from pipeline.tracking import require_run
    from stages.common.models import checkpoint_safety_problem

    def safe(path: Path) -> Path:
        problem = checkpoint_safety_problem(path)  # the check every training stage applies too
        if problem:
            raise UserError(f"{uri}: {problem}")
        return path

    if not uri.startswith("models:/"):
        path = Path(uri).expanduser().absolute()
        if not (path / "config.json").is_file():
            raise UserError(f"--model {uri}: not a model directory (no config.json); give a registry URI "
                            "models:/NAME@ALIAS or a directory written by save_pretrained")
        return safe(path)
    require_run(tracking_uri, uri, "serve")  # before MLflow, which would create an empty store to search
    client = MlflowClient(tracking_uri=tracking_uri)
    name, _, ref = uri.removeprefix("models:/").partition("@")
    try:
        if ref:
            version = client.get_model_version_by_alias(name, ref)
        else:
            name, _, number = name.partition("/")
            version = client.get_model_version(name, number)
    except MlflowException as exc:
        raise UserError(f"{uri}: not found in the model registry at {redact(tracking_uri)} "
                        f"({exc.message.splitlines()[0]}); "
                        "list versions in the MLflow UI (Models tab) or run the serve stage to register one") from None
    # Keyed by where the version lives, not just its number: another registry's (or a recreated
    # registry's) "version 1" is another model and must never be served from this download.
    # A database store's password is not part of where it is (`redact`): another password, the same download.
    source = json.dumps([redact(tracking_uri, mask=None), version.run_id, version.source,
                         (version.tags or {}).get(HASH_TAG)])
    target = Path(cache_dir) / name / f"{version.version}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return safe(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        import mlflow.artifacts

        local = mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(tmp),
                                                    tracking_uri=tracking_uri)
        os.replace(local, target) if Path(local) != tmp else os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return safe(target)
