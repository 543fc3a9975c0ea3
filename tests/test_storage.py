"""Object storage (`storage.uri: s3://...`) against a local S3 server (moto, on 127.0.0.1).

The unit tests cover what makes the bucket a safe storage of record (a remote artifact without
its manifest is never finished, pulls are all-or-nothing, workers pull what their node lacks);
the pipeline test runs model -> data with the store, then from an empty run_dir on the same
bucket, which must reuse everything the first run pushed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import SMOKE, run_cli, smoke_config
from helpers.s3 import BUCKET, S3Server


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


def _artifact(run_dir: Path, stage: str, key: str, payload: bytes) -> Path:
    out = run_dir / "artifacts" / stage / key
    (out / "model").mkdir(parents=True)
    (out / "model" / "weights.bin").write_bytes(payload)
    (out / "manifest.json").write_text(json.dumps({"stage": stage, "key": key, "outputs": {"model": "model"}}))
    return out


@pytest.fixture()
def node_storage(s3, tmp_path, request):
    """The `RunStorage` a worker on another node receives: its own run_dir, the shared bucket.

    Pickled and unpickled, as Ray ships it to an actor."""
    import pickle

    from pipeline.storage import RunStorage

    store = s3.store(request.node.name)
    value = RunStorage(tmp_path / "node", store.uri, store.endpoint_url, store.region)
    assert value.store is not None  # builds (and caches) an S3 client ...
    shipped = pickle.loads(pickle.dumps(value))
    assert "store" not in shipped.__dict__ and shipped == value  # ... which stays behind; the value travels
    return shipped


# --------------------------------------------------------------------------- units


def test_a_storage_failure_is_an_error_never_missing(tmp_path):
    """A bucket that cannot be reached (here: nothing listens) is not a bucket without the artifact:
    the cache check and a checkpoint pull fail, naming the object, instead of redoing or resuming
    from nothing."""
    from pipeline.errors import StorageError
    from pipeline.storage import ObjectStore, probe, pull_artifact, remote_manifest

    store = ObjectStore("s3://pipeline-test/x", "http://127.0.0.1:9", "us-east-1")
    with pytest.raises(StorageError, match="cannot read s3://pipeline-test/x/artifacts/sft/k/manifest.json"):
        remote_manifest(store, "sft", "k")
    with pytest.raises(StorageError, match="cannot"):
        pull_artifact(store, tmp_path, "sft", "k")
    assert not (tmp_path / "artifacts" / "sft" / "k").exists()
    assert "NETWORK_CONNECTION" in probe(store)


def test_a_download_refuses_object_names_that_leave_its_directory(s3, tmp_path):
    import boto3

    from pipeline.errors import StorageError

    client = boto3.client("s3", endpoint_url=s3.endpoint)
    client.put_object(Bucket=BUCKET, Key="evil/ckpt/../../../escaped", Body=b"x")
    client.put_object(Bucket=BUCKET, Key="evil/ckpt/ok", Body=b"y")
    with pytest.raises(StorageError, match="leaves the directory"):
        s3.store("evil").download_dir("ckpt", tmp_path / "deep" / "out")
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_config_rejects_a_storage_uri_that_is_not_an_object_store(tmp_path):
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"storage\.uri.*s3://BUCKET"):
        smoke_config(tmp_path, "storage.uri=/mnt/shared")
    assert smoke_config(tmp_path, "storage.uri=s3://b/p/").storage.uri == "s3://b/p"


def test_an_artifact_round_trips_and_an_unfinished_upload_is_never_taken(s3, tmp_path):
    from pipeline import storage

    store = s3.store("roundtrip")
    src = _artifact(tmp_path / "a", "sft", "k1", os.urandom(3000))
    assert storage.push_artifact(store, tmp_path / "a", "sft", "k1") > 3000
    assert storage.remote_manifest(store, "sft", "k1")["key"] == "k1"
    assert storage.pull_artifact(store, tmp_path / "b", "sft", "k1")
    got = tmp_path / "b" / "artifacts" / "sft" / "k1"
    assert (got / "model" / "weights.bin").read_bytes() == (src / "model" / "weights.bin").read_bytes()

    # An upload cut off before its manifest: files in the bucket, but not an artifact.
    store.upload_dir(src / "model", "artifacts/sft/k2/model")
    assert storage.remote_manifest(store, "sft", "k2") is None
    assert not storage.pull_artifact(store, tmp_path / "b", "sft", "k2")
    assert not (tmp_path / "b" / "artifacts" / "sft" / "k2").exists()
    # ... and a rerun of that stage clears it before writing anew.
    storage.clear_artifact(store, "sft", "k2")
    assert store.files("artifacts/sft/k2") == {}


def test_a_pull_replaces_partial_local_output(s3, tmp_path):
    from pipeline import storage

    store = s3.store("partial")
    _artifact(tmp_path / "a", "data", "k", b"good")
    storage.push_artifact(store, tmp_path / "a", "data", "k")
    partial = tmp_path / "b" / "artifacts" / "data" / "k"
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "weights.bin").write_bytes(b"half")  # an interrupted local attempt, no manifest
    (partial / "stray.tmp").write_bytes(b"x")
    assert storage.pull_artifact(store, tmp_path / "b", "data", "k")
    assert (partial / "model" / "weights.bin").read_bytes() == b"good" and not (partial / "stray.tmp").exists()


def test_a_worker_pulls_the_artifact_its_node_lacks(node_storage, tmp_path):
    from pipeline import storage

    active_store = node_storage.store
    _artifact(tmp_path / "driver", "sft", "k", b"weights")
    storage.push_artifact(active_store, tmp_path / "driver", "sft", "k")
    wanted = tmp_path / "node" / "artifacts" / "sft" / "k" / "model"
    assert node_storage.localize(wanted) == wanted and (wanted / "weights.bin").read_bytes() == b"weights"
    with pytest.raises(FileNotFoundError, match=rf"nowhere.*neither on this node nor in {active_store.uri}"):
        node_storage.localize(tmp_path / "node" / "artifacts" / "sft" / "nowhere" / "model")
    # Ray Data and Ray Train address run_dir paths in the bucket; other paths stay local.
    where, fs = node_storage.target(tmp_path / "node" / "checkpoints" / "sft" / "k")
    assert where == active_store.path("checkpoints/sft/k") and fs is not None
    assert node_storage.target(tmp_path / "elsewhere") == (str(tmp_path / "elsewhere"), None)


def test_checkpoint_files_meet_in_the_bucket_and_reach_a_machine_without_them(node_storage, tmp_path):
    storage, active_store = node_storage, node_storage.store
    ckpt = tmp_path / "node" / "checkpoints" / "ppo" / "k"
    (ckpt / "iter_00001" / "policy").mkdir(parents=True)
    (ckpt / "iter_00001" / "policy" / "shard0.pt").write_bytes(b"a" * 10)  # each rank pushes what it wrote
    assert storage.push_path(ckpt / "iter_00001" / "policy") == 10
    (ckpt / "latest.json").write_text(json.dumps({"iteration": 1, "dir": "iter_00001"}))
    assert storage.push_path(ckpt / "latest.json") > 0
    shutil.rmtree(ckpt)  # a new machine: only the bucket has them

    assert storage.pull_path(ckpt / "latest.json") > 0
    assert json.loads((ckpt / "latest.json").read_text())["dir"] == "iter_00001"
    assert storage.pull_path(ckpt / "iter_00001" / "policy") == 10
    assert (ckpt / "iter_00001" / "policy" / "shard0.pt").read_bytes() == b"a" * 10
    assert storage.pull_path(ckpt / "iter_00001" / "policy") == 0  # already here: nothing downloaded
    (ckpt / "iter_00001" / "policy" / "shard0.pt").write_bytes(b"b" * 10)  # a stale shard of the same size
    assert storage.pull_path(ckpt / "iter_00001" / "policy") == 10  # compared by content (ETag): replaced
    assert (ckpt / "iter_00001" / "policy" / "shard0.pt").read_bytes() == b"a" * 10
    assert storage.pull_path(ckpt / "iter_00009") == 0 and not (ckpt / "iter_00009").exists()
    (ckpt / "latest.json").write_text(json.dumps({"iteration": 0, "dir": "iter_00000"}))  # same size, older
    assert storage.pull_path(ckpt / "latest.json") > 0  # the bucket's record wins
    assert json.loads((ckpt / "latest.json").read_text())["dir"] == "iter_00001"
    storage.drop_path(ckpt / "iter_00001")
    assert active_store.files("checkpoints/ppo/k/iter_00001") == {}
    (tmp_path / "elsewhere.txt").write_text("x")
    assert storage.push_path(tmp_path / "elsewhere.txt") == 0  # outside run_dir: not the store's business


def test_an_unusable_bucket_fails_before_any_work(s3, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("run", str(SMOKE), f"run_dir={run_dir}", "storage.uri=s3://no-such-bucket/run",
                     f"storage.endpoint_url={s3.endpoint}", "--json")
    assert result.returncode == 2, result.stderr
    assert "storage.uri s3://no-such-bucket/run: cannot write and read back an object" in result.stderr
    assert "Traceback" not in result.stderr and not (run_dir / "artifacts").exists()


# --------------------------------------------------------------------------- the pipeline


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_run_on_an_empty_run_dir_reuses_what_the_bucket_holds(s3, tmp_path):
    """model -> data with the store (the data stage's Parquet goes through the bucket), then the same
    config on an empty run_dir. SFT's checkpoints in the bucket are covered by tests/test_cluster.py."""
    store_args = [f"storage.uri=s3://{BUCKET}/pipeline", f"storage.endpoint_url={s3.endpoint}"]
    first = run_cli("run", str(SMOKE), f"run_dir={tmp_path / 'first'}", *store_args, "--to", "data", "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    stages = {s["name"]: s for s in json.loads(first.stdout)["stages"]}
    assert [stages[n]["status"] for n in ("model", "data")] == ["miss"] * 2
    assert "pushed" in first.stderr

    store = s3.store("pipeline")
    keys = {n: stages[n]["cache_key"] for n in ("model", "data")}
    for name, key in keys.items():  # every finished artifact is in the bucket, manifest included
        local = _tree(tmp_path / "first" / "artifacts" / name / key)
        assert store.files(f"artifacts/{name}/{key}") == {k: len(v) for k, v in local.items()}
    assert any(n.endswith(".parquet") for n in store.files(f"artifacts/data/{keys['data']}/sft/train"))

    # A new machine (an empty run_dir) on the same bucket: nothing reruns, everything is pulled.
    second = run_cli("run", str(SMOKE), f"run_dir={tmp_path / 'second'}", *store_args, "--to", "data", "--json")
    assert second.returncode == 0, second.stderr[-3000:]
    again = {s["name"]: s for s in json.loads(second.stdout)["stages"]}
    assert [again[n]["status"] for n in ("model", "data")] == ["hit"] * 2
    assert all(f"cached in s3://{BUCKET}/pipeline" in again[n]["reason"] for n in ("model", "data"))
    assert "pulled data" in second.stderr and "Ray not started" in second.stderr
    for name, key in keys.items():
        part = f"artifacts/{name}/{key}"
        assert _tree(tmp_path / "second" / part) == _tree(tmp_path / "first" / part)
    shutil.rmtree(tmp_path / "first", ignore_errors=True)


def test_local_etags_match_what_s3_reports_for_single_and_multipart_uploads(s3, tmp_path):
    """A pyarrow upload above its part size is multipart ("<md5 of part md5s>-N"): recognised too."""
    from pipeline.storage import local_etags

    store = s3.store("etags")
    for name, size in (("small", 1000), ("big", (10 << 20) + 123)):
        path = tmp_path / name
        path.write_bytes(os.urandom(size))
        with store.fs.open_output_stream(store.path(f"d/{name}")) as f:
            f.write(path.read_bytes())
        with store.fs.open_input_stream(store.path(f"d/{name}")) as f:
            etag = f.metadata()["ETag"].decode().strip('"')
        assert etag in local_etags(path, int(etag.rsplit("-", 1)[1]) if "-" in etag else 0), (name, etag)
