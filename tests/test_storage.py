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

from conftest import SMOKE, cli_in_process, run_cli, smoke_config
from helpers.s3 import BUCKET, S3Server

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 3, "ray": 1}


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


def _artifact(run_dir: Path, stage: str, key: str, payload: bytes, bucket=None) -> Path:
    """A finished artifact made as the runner makes one: built in the store's work directory, committed."""
    from pipeline.storage import ArtifactStore

    store = ArtifactStore(run_dir, bucket)
    work = store.begin(stage, key)
    (work / "model").mkdir()
    (work / "model" / "weights.bin").write_bytes(payload)
    store.commit(stage, key, {"outputs": {"model": "model"}})
    return store.local_dir(stage, key)


@pytest.fixture()
def node_storage(s3, tmp_path, request):
    """The `RunStorage` a worker on another node receives: its own run_dir, the shared bucket.

    Pickled and unpickled, as Ray ships it to an actor."""
    import pickle

    from pipeline.run_storage import RunStorage

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
    from pipeline.bucket import probe
    from pipeline.storage import ArtifactStore, ObjectStore

    store = ArtifactStore(tmp_path, ObjectStore("s3://pipeline-test/x", "http://127.0.0.1:9", "us-east-1"))
    with pytest.raises(StorageError, match="cannot read s3://pipeline-test/x/artifacts/sft/k/manifest.json"):
        store.lookup("sft", "k")
    with pytest.raises(StorageError, match="cannot"):
        store.pull("sft", "k")
    assert not (tmp_path / "artifacts" / "sft" / "k").exists()
    assert "NETWORK_CONNECTION" in probe(store.bucket)


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
    from pipeline.storage import ArtifactStore

    bucket = s3.store("roundtrip")
    src = _artifact(tmp_path / "a", "sft", "k1", os.urandom(3000), bucket)
    b = ArtifactStore(tmp_path / "b", bucket)
    assert b.lookup("sft", "k1").where == "bucket" and b.remote("sft", "k1")[0]["key"] == "k1"
    assert b.pull("sft", "k1")["key"] == "k1"
    got = b.local_dir("sft", "k1")
    assert (got / "model" / "weights.bin").read_bytes() == (src / "model" / "weights.bin").read_bytes()
    assert b.lookup("sft", "k1").where == "here"

    # An upload cut off before its manifest: files in the bucket, but not an artifact.
    bucket.upload_dir(src / "model", "artifacts/sft/k2/copy-x/model")
    assert b.lookup("sft", "k2").where == "missing" and b.pull("sft", "k2") is None
    assert not b.local_dir("sft", "k2").exists()


def test_a_pull_replaces_partial_local_output(s3, tmp_path):
    from pipeline.storage import ArtifactStore

    bucket = s3.store("partial")
    _artifact(tmp_path / "a", "data", "k", b"good", bucket)
    partial = tmp_path / "b" / "artifacts" / "data" / "k"
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "weights.bin").write_bytes(b"half")  # an interrupted local attempt, no manifest
    (partial / "stray.tmp").write_bytes(b"x")
    assert ArtifactStore(tmp_path / "b", bucket).pull("data", "k") is not None
    assert (partial / "model" / "weights.bin").read_bytes() == b"good" and not (partial / "stray.tmp").exists()


def _corrupt(bucket, stage: str, key: str, name: str, data: bytes | None = None) -> None:
    """Overwrite one file of the bucket's copy in place: other bytes of the same size unless `data`."""
    manifest = json.loads(bucket.read_bytes(f"artifacts/{stage}/{key}/manifest.json"))
    rel = f"artifacts/{stage}/{key}/{manifest['copy']}/{name}"
    old = bucket.read_bytes(rel)
    bucket.write_bytes(rel, data if data is not None else bytes(255 - c for c in old))


def test_a_damaged_file_in_the_bucket_is_a_miss_with_its_reason_and_never_pulled(s3, tmp_path):
    """Bytes changed at the same size (a large weights file, beyond any size check) and a truncated
    small file: each is a miss naming the file; a pull that finds damage while downloading refuses
    it and leaves run_dir as it was."""
    from pipeline.bucket import ContentMismatch
    from pipeline.storage import ArtifactStore

    bucket = s3.store("damaged")
    _artifact(tmp_path / "a", "sft", "big", os.urandom(3 << 20), bucket)
    _artifact(tmp_path / "a", "sft", "small", b"0123456789", bucket)
    b = ArtifactStore(tmp_path / "b", bucket)
    _corrupt(bucket, "sft", "big", "model/weights.bin")
    _corrupt(bucket, "sft", "small", "model/weights.bin", b"0123")
    big, small = b.lookup("sft", "big"), b.lookup("sft", "small")
    assert big.where == "missing" and "model/weights.bin changed after it was uploaded" in big.problem
    assert small.where == "missing" and "model/weights.bin has 4 bytes, 10 when made" in small.problem
    assert b.pull("sft", "big") is None and not b.local_dir("sft", "big").exists()

    # Damage the HEAD check cannot see (the recorded ETag forged too): the download's hash refuses it.
    rel = "artifacts/sft/big/manifest.json"
    manifest = json.loads(bucket.read_bytes(rel))
    manifest["etags"]["model/weights.bin"] = bucket.etag(f"artifacts/sft/big/{manifest['copy']}/model/weights.bin")
    bucket.write_bytes(rel, json.dumps(manifest).encode())
    assert b.lookup("sft", "big").where == "bucket"
    with pytest.raises(ContentMismatch, match="does not hold the bytes its manifest records"):
        b.pull("sft", "big")
    assert not b.local_dir("sft", "big").exists() and not list((tmp_path / "b" / "artifacts" / "sft").glob(".big*-*"))


def test_a_bucket_manifest_naming_paths_outside_its_artifact_is_refused(s3, tmp_path):
    from pipeline.storage import ArtifactStore

    bucket = s3.store("absolute")
    _artifact(tmp_path / "a", "sft", "k", b"w", bucket)
    for outputs, files in (({"model": "/etc"}, None), ({"model": "../../x"}, None), (None, {"/etc/passwd": {}})):
        manifest = json.loads(bucket.read_bytes("artifacts/sft/k/manifest.json"))
        manifest["outputs"] = outputs or manifest["outputs"]
        manifest["files"] = {**manifest["files"], **(files or {})}
        for name in files or {}:
            manifest["files"][name] = {"size": 1, "sha256": "0" * 64}
        bucket.write_bytes("artifacts/sft/k/manifest.json", json.dumps(manifest).encode())
        found = ArtifactStore(tmp_path / "b", bucket).lookup("sft", "k")
        assert found.where == "missing" and "a path outside the artifact" in found.problem, (outputs, files)
        _artifact(tmp_path / "a2", "sft", "k", b"w", bucket)  # a good copy again for the next case


def test_a_bucket_manifest_whose_copy_leaves_its_artifact_is_refused_and_nothing_is_written(s3, tmp_path):
    """A bucket manifest's `copy` is the directory under the artifact its files are read from: one written
    elsewhere naming '../other/<copy>' (another artifact's files, which would hash right), an absolute path or
    a nested one is refused naming the manifest and the entry; one the artifact does not hold is a miss too."""
    from pipeline.storage import ArtifactStore

    bucket = s3.store("copies")
    _artifact(tmp_path / "a", "sft", "other", b"w", bucket)
    _artifact(tmp_path / "a", "sft", "k", b"w", bucket)
    good = json.loads(bucket.read_bytes("artifacts/sft/k/manifest.json"))
    theirs = json.loads(bucket.read_bytes("artifacts/sft/other/manifest.json"))["copy"]
    for copy in (f"../other/{theirs}", "../../../../x", f"/{theirs}", f"{good['copy']}/..", "..", "copy-a/b", ""):
        bucket.write_bytes("artifacts/sft/k/manifest.json", json.dumps({**good, "copy": copy}).encode())
        store = ArtifactStore(tmp_path / "b", bucket)
        found = store.lookup("sft", "k")
        assert found.where == "missing", copy
        assert f"names copy {copy!r}, not a copy directory" in found.problem, found.problem
        assert bucket.url("artifacts/sft/k/manifest.json") in found.problem
        assert store.pull("sft", "k") is None  # downloads nothing: run_dir holds only the pull's lock file
        assert [p.name for p in (tmp_path / "b").rglob("*") if p.is_file()] == [".k.pull.lock"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # and nothing was written beside it
    bucket.write_bytes("artifacts/sft/k/manifest.json", json.dumps({**good, "copy": "copy-gone"}).encode())
    found = ArtifactStore(tmp_path / "b", bucket).lookup("sft", "k")
    assert found.where == "missing" and "names copy 'copy-gone', which the artifact does not hold" in found.problem


def test_an_etag_that_is_not_an_s3_etag_is_a_storage_error(s3, tmp_path, monkeypatch):
    """A content check against a store whose ETags are not '<md5>' or '<md5>-N' names the object."""
    from pipeline.bucket import ObjectStore
    from pipeline.errors import StorageError

    store = s3.store("etag")
    (tmp_path / "f").write_bytes(b"x")
    store.upload_file(tmp_path / "f", "d/f")
    store.download_dir("d", tmp_path / "out")  # a local copy the next pull compares with
    for etag in ("abc-xyz", "d41d8cd98f00b204e9800998ecf8427e-x", "not-an-etag"):
        monkeypatch.setattr(ObjectStore, "etag", lambda self, rel, etag=etag: etag)
        with pytest.raises(StorageError, match=r"s3://.*/d/f.*neither '<md5>' nor '<md5>-N'"):
            store.download_dir("d", tmp_path / "out", skip_same=True)


def test_the_local_swap_never_leaves_the_artifact_absent(tmp_path, monkeypatch):
    """Without an atomic exchange (some filesystems), the swap is two renames: if the second fails the
    old copy is put back, and a process killed between them has its old copy restored at lookup."""
    from pipeline import swap
    from pipeline.storage import ArtifactStore

    def no_exchange(a, b):
        raise OSError(22, "Invalid argument")

    store = ArtifactStore(tmp_path)
    _artifact(tmp_path, "sft", "k", b"old")
    before = store.manifest("sft", "k")
    work = store.begin("sft", "k")
    (work / "model").mkdir()
    (work / "model" / "weights.bin").write_bytes(b"new")
    monkeypatch.setattr(swap, "_exchange", no_exchange)
    real = os.replace

    def second_rename_fails(src, dst):
        if Path(src) == work:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(swap.os, "replace", second_rename_fails)
    with pytest.raises(OSError, match="No space left"):
        store.commit("sft", "k", {"outputs": {"model": "model"}})
    monkeypatch.setattr(swap.os, "replace", real)
    assert store.manifest("sft", "k") == before
    assert (store.local_dir("sft", "k") / "model" / "weights.bin").read_bytes() == b"old"

    # Killed between the renames: the finished copy is set aside and the new one not yet in place.
    aside = tmp_path / "artifacts" / "sft" / ".old" / "k"
    aside.parent.mkdir(parents=True, exist_ok=True)
    os.replace(store.local_dir("sft", "k"), aside)
    assert store.lookup("sft", "k").where == "here" and store.manifest("sft", "k") == before

    # With the exchange (this machine's filesystem has it), the new copy replaces the old one whole.
    monkeypatch.undo()
    store.commit("sft", "k", {"outputs": {"model": "model"}})
    assert (store.local_dir("sft", "k") / "model" / "weights.bin").read_bytes() == b"new"
    assert not work.exists() and not aside.exists()


def test_every_output_file_has_a_content_hash_and_a_same_size_edit_is_damage(tmp_path):
    """Large files too (model weights): a same-size edit of a multi-MiB file is damage, not a hit."""
    from pipeline.storage import ArtifactStore

    out = _artifact(tmp_path, "sft", "k", os.urandom(3 << 20))
    store = ArtifactStore(tmp_path)
    manifest = store.manifest("sft", "k")
    assert set(manifest["files"]["model/weights.bin"]) == {"size", "sha256"}
    data = bytearray((out / "model" / "weights.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "model" / "weights.bin").write_bytes(bytes(data))
    found = ArtifactStore(tmp_path).lookup("sft", "k")
    assert found.where == "missing" and "model/weights.bin changed after it was made" in found.problem


def test_a_worker_pulls_the_artifact_its_node_lacks(node_storage, tmp_path):
    active_store = node_storage.store
    _artifact(tmp_path / "driver", "sft", "k", b"weights", active_store)
    wanted = tmp_path / "node" / "artifacts" / "sft" / "k" / "model"
    assert node_storage.localize(wanted) == wanted and (wanted / "weights.bin").read_bytes() == b"weights"
    with pytest.raises(FileNotFoundError, match=rf"nowhere.*neither on this node nor in {active_store.uri}"):
        node_storage.localize(tmp_path / "node" / "artifacts" / "sft" / "nowhere" / "model")
    # Ray Data and Ray Train address run_dir paths in the bucket; other paths stay local.
    where, fs = node_storage.target(tmp_path / "node" / "checkpoints" / "sft" / "k")
    assert where == active_store.path("checkpoints/sft/k") and fs is not None
    copy = node_storage.artifacts.manifest("sft", "k")["copy"]  # an artifact's path: its current copy
    assert node_storage.target(wanted / "weights.bin")[0] == \
        active_store.path(f"artifacts/sft/k/{copy}/model/weights.bin")
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


def test_an_unusable_bucket_fails_before_any_work(s3, tmp_path, capfd):
    run_dir = tmp_path / "run"
    result = cli_in_process(capfd, "run", str(SMOKE), f"run_dir={run_dir}", "storage.uri=s3://no-such-bucket/run",
                     f"storage.endpoint_url={s3.endpoint}", "--json")
    assert result.returncode == 2, result.stderr
    assert "storage.uri s3://no-such-bucket/run: cannot write and read back an object" in result.stderr
    assert "Traceback" not in result.stderr and not (run_dir / "artifacts").exists()


# --------------------------------------------------------------------------- the pipeline


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.tier("e2e", covers=(
    "pipeline/storage.py", "pipeline/bucket.py", "pipeline/run_storage.py", "pipeline/swap.py",
    "pipeline/runner.py", "pipeline/files.py"))
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
    copies = {}
    for name, key in keys.items():  # every finished artifact is in the bucket, its manifest naming its copy
        local = _tree(tmp_path / "first" / "artifacts" / name / key)
        copies[name] = json.loads(local.pop("manifest.json"))["copy"]
        assert store.files(f"artifacts/{name}/{key}/{copies[name]}") == {k: len(v) for k, v in local.items()}
    assert any(n.endswith(".parquet") for n in store.files(f"artifacts/data/{keys['data']}/{copies['data']}/sft/train"))
    assert store.files("scratch") == {}  # the data stage's writes through the bucket leave nothing behind

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
    from pipeline.bucket import local_etags

    store = s3.store("etags")
    for name, size in (("small", 1000), ("big", (10 << 20) + 123)):
        path = tmp_path / name
        path.write_bytes(os.urandom(size))
        with store.fs.open_output_stream(store.path(f"d/{name}")) as f:
            f.write(path.read_bytes())
        with store.fs.open_input_stream(store.path(f"d/{name}")) as f:
            etag = f.metadata()["ETag"].decode().strip('"')
        assert etag in local_etags(path, int(etag.rsplit("-", 1)[1]) if "-" in etag else 0), (name, etag)
