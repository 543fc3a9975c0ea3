"""Object storage (`storage.uri: s3://bucket/prefix`): the run's artifacts and training checkpoints in a bucket.

Without it, `run_dir` is the storage of record, and on a multi-node cluster it must be a path
every node mounts (`pipeline.cluster.check_shared_storage`). With it, the bucket is the storage of
record and `run_dir` becomes each machine's working copy:

- a finished artifact is pushed to `<uri>/artifacts/<stage>/<key>/` after its manifest is written
  locally, the manifest uploaded last: a remote artifact without a manifest (an interrupted
  upload) is never taken as finished, exactly as locally;
- a cache lookup that misses locally looks in the bucket and pulls the artifact into `run_dir`
  (a new machine, a wiped disk or another node reuses what any run produced);
- Ray Train checkpoints go to `<uri>/checkpoints/<stage>/<key>/` through Ray Train's own
  `storage_filesystem`, so a restarted worker group on any node resumes from them;
- Ray Data reads the stage inputs from the bucket (its read tasks run on any node), and a
  worker process opening a model directory calls `localize`, which pulls the artifact holding it
  when this node has no copy.

Workers learn about the store from a `RunStorage` value the stage passes to every worker it
creates (no environment variable); Ray Data and Ray Train get the bucket's filesystem object
itself (`RunStorage.target`).

We use pyarrow's `S3FileSystem` rather than boto3: pyarrow is already what Ray Data and Ray
Train use for `s3://`, and it speaks to any S3-compatible endpoint (`endpoint_url`: MinIO, Ceph,
GCS's interoperability API). Credentials come from the usual AWS sources (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, ~/.aws, an instance role).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pydantic import Field, field_validator

from pipeline.artifacts import MANIFEST, read_manifest
from pipeline.errors import StorageError, UserError
from pipeline.schema import Section

class StorageConfig(Section):
    """Object storage for artifacts and checkpoints; empty: run_dir alone (a shared path on a cluster)."""

    uri: str | None = Field(
        None,
        description="'s3://bucket/prefix': finished artifacts and training checkpoints are kept in the bucket and "
        "pulled into run_dir (each machine's working copy) when missing there. Lets a multi-node cluster run "
        "without a shared run_dir. Empty: run_dir alone.",
    )
    endpoint_url: str | None = Field(
        None,
        description="S3-compatible endpoint (MinIO, Ceph, GCS interoperability), e.g. 'http://minio:9000'. "
        "Empty: AWS S3. Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws.",
    )
    region: str | None = Field(None, description="Bucket region, e.g. 'us-east-1'. Empty: AWS_DEFAULT_REGION or "
                               "pyarrow's default.")

    @field_validator("uri")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        v = v.strip().rstrip("/")
        if not v.startswith("s3://") or not v[5:].split("/")[0]:
            raise ValueError(f"{v!r} is not an object-store URI; write s3://BUCKET or s3://BUCKET/PREFIX (a local or "
                             "mounted path belongs in run_dir)")
        return v


class ObjectStore:
    """A bucket prefix; paths given to its methods are relative to it ('artifacts/sft/<key>')."""

    def __init__(self, uri: str, endpoint_url: str | None = None, region: str | None = None):
        self.uri, self.endpoint_url, self.region = uri.rstrip("/"), endpoint_url, region
        self.root = self.uri.removeprefix("s3://")  # bucket/prefix, as pyarrow names it

    @cached_property
    def fs(self):
        from pyarrow import fs

        kwargs = {"region": self.region} if self.region else {}
        if self.endpoint_url:
            scheme, _, host = self.endpoint_url.partition("://")
            kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
        return fs.S3FileSystem(**kwargs)

    def path(self, rel: str = "") -> str:
        """The pyarrow path (bucket/prefix/rel) of `rel`."""
        return f"{self.root}/{rel}".rstrip("/")

    def url(self, rel: str = "") -> str:
        return f"s3://{self.path(rel)}"

    # ---------------------------------------------------------------- files

    def read_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, or None when it does not exist. Any other failure (credentials,
        network, throttling) is a `StorageError`: a cache check must not read it as "missing" and
        redo, or resume from nothing."""
        from pyarrow.lib import ArrowException

        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except (ArrowException, OSError) as exc:
            raise StorageError(f"cannot read {self.url(rel)}: {exc}") from exc

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.fs.open_output_stream(self.path(rel)) as f:
            f.write(data)

    def delete(self, rel: str) -> None:
        self.fs.delete_file(self.path(rel))

    def delete_dir(self, rel: str) -> None:
        """Remove everything under `rel` (nothing there is fine)."""
        self.fs.delete_dir_contents(self.path(rel), missing_dir_ok=True)

    def files(self, rel: str) -> dict[str, int]:
        """{path relative to `rel`: size} of every file under `rel` (empty if none)."""
        from pyarrow import fs

        base = self.path(rel)
        try:
            infos = self.fs.get_file_info(fs.FileSelector(base, recursive=True, allow_not_found=True))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StorageError(f"cannot list {self.url(rel)}: {exc}") from exc
        return {i.path[len(base) + 1:]: i.size for i in infos if i.type == fs.FileType.File}

    def upload_dir(self, local: Path, rel: str, last: str | None = None, skip_same_size: bool = False) -> int:
        """Upload every file under `local` to `rel`, `last` (a relative name) after all others; returns
        the bytes uploaded. `skip_same_size` skips files already there with the same size: only for a
        prefix this attempt wrote itself (an artifact's, cleared when its stage starts)."""
        remote = self.files(rel) if skip_same_size else {}
        names = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        if last in names:
            names.remove(last)
            names.append(last)
        sent = 0
        for name in names:
            size = (local / name).stat().st_size
            if name != last and remote.get(name) == size:
                continue
            with (local / name).open("rb") as src, self.fs.open_output_stream(self.path(f"{rel}/{name}")) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            sent += size
        return sent

    def download_dir(self, rel: str, local: Path, skip_same: bool = False) -> int:
        """Download every file under `rel` into `local` (each written whole, then renamed into place);
        returns the bytes downloaded. `skip_same` keeps a local file only when its content matches
        the object's (its ETag), never on size alone: a stale shard of the same size is replaced."""
        got = 0
        for name, size in self.files(rel).items():
            parts = Path(name).parts
            if Path(name).is_absolute() or not parts or ".." in parts:  # would land outside `local`
                raise StorageError(f"refusing to download {self.url(rel)}/{name}: the object name leaves "
                                   "the directory it is downloaded into")
            dest = local / name
            if skip_same and dest.is_file() and dest.stat().st_size == size and self._same_content(
                    f"{rel}/{name}", dest):
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
            with self.fs.open_input_stream(self.path(f"{rel}/{name}")) as src, tmp.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(tmp, dest)
            got += size
        return got

    def _same_content(self, rel: str, local: Path) -> bool:
        """Whether `local` holds the object's bytes, by its ETag: the MD5 of a single-part upload, or
        the MD5 of the parts' MD5s with "-N" for a multipart one (tried with the part sizes pyarrow,
        boto3 and the AWS CLI use). An ETag none of them reproduces counts as different."""
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                etag = (f.metadata() or {}).get("ETag", b"").decode().strip('"')
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot read {self.url(rel)}: {exc}") from exc
        return bool(etag) and etag in local_etags(local, int(etag.rsplit("-", 1)[1]) if "-" in etag else 0)


def local_etags(path: Path, parts: int) -> set[str]:
    """The ETags an S3 upload of `path` in `parts` parts (0: a single PUT) could have."""
    import hashlib

    if parts == 0:
        with path.open("rb") as f:
            return {hashlib.file_digest(f, "md5").hexdigest()}
    size, out = path.stat().st_size, set()
    for part_size in (10 << 20, 8 << 20, 5 << 20, 16 << 20, 64 << 20):
        if -(-size // part_size) != parts and not (size == 0 and parts == 1):
            continue
        digests = hashlib.md5()
        with path.open("rb") as f:
            while chunk := f.read(part_size):
                digests.update(hashlib.md5(chunk).digest())
        out.add(f"{digests.hexdigest()}-{parts}")
    return out


def from_config(cfg) -> ObjectStore | None:
    """The run's store (`cfg.storage`), or None when it has none."""
    return RunStorage.of(cfg).store


# --------------------------------------------------------------------------- artifacts


def _artifact_rel(stage: str, key: str) -> str:
    return f"artifacts/{stage}/{key}"


def remote_manifest(store: ObjectStore, stage: str, key: str) -> dict | None:
    """The manifest of a finished artifact in the bucket, or None (missing or an interrupted upload)."""
    data = store.read_bytes(f"{_artifact_rel(stage, key)}/{MANIFEST}")
    try:
        manifest = json.loads(data) if data else None
    except json.JSONDecodeError:
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("key") == key else None


def clear_artifact(store: ObjectStore, stage: str, key: str) -> None:
    """Drop what an interrupted attempt left in the bucket under this key, manifest first."""
    try:
        store.delete(f"{_artifact_rel(stage, key)}/{MANIFEST}")
    except (FileNotFoundError, OSError):
        pass
    store.delete_dir(_artifact_rel(stage, key))


def push_artifact(store: ObjectStore, run_dir: Path, stage: str, key: str) -> int:
    """Upload a finished local artifact, its manifest last; returns the bytes sent."""
    local = run_dir / "artifacts" / stage / key
    if read_manifest(run_dir, stage, key) is None:
        raise FileNotFoundError(f"{local} has no {MANIFEST}: only finished artifacts are pushed")
    # The data stage already wrote its Parquet through the bucket (`write_parquet`): not sent twice.
    return store.upload_dir(local, _artifact_rel(stage, key), last=MANIFEST, skip_same_size=True)


def pull_artifact(store: ObjectStore, run_dir: Path, stage: str, key: str) -> bool:
    """Bring a finished artifact from the bucket into run_dir; False if the bucket has none.

    Downloaded into a temporary sibling and renamed into place, manifest included, so a pull cut
    short never leaves a directory that looks finished. A per-artifact lock lets the workers of one
    node that need the same model share a single download.
    """
    local = run_dir / "artifacts" / stage / key
    if read_manifest(run_dir, stage, key) is not None:
        return True
    local.parent.mkdir(parents=True, exist_ok=True)
    with open(local.parent / f".{key}.pull.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if read_manifest(run_dir, stage, key) is not None:  # another process pulled it while we waited
            return True
        if remote_manifest(store, stage, key) is None:
            return False
        tmp = Path(tempfile.mkdtemp(dir=local.parent, prefix=f".{key}.pull-"))
        try:
            store.download_dir(_artifact_rel(stage, key), tmp)
            if local.exists():  # partial output of an interrupted local attempt
                (local / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(local)
            os.replace(tmp, local)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def sync_artifact(store: ObjectStore, run_dir: Path, stage: str, key: str, log) -> None:
    """Make a finished artifact (a hit, or the input of a stage to run) present both here and in the bucket.

    Pulls what only the bucket has; pushes what only run_dir has (a push cut short by a network
    failure, or an artifact made before the run used a store)."""
    t0 = time.time()
    if read_manifest(run_dir, stage, key) is not None:
        if remote_manifest(store, stage, key) is None:
            sent = push_artifact(store, run_dir, stage, key)
            log(f"  pushed {stage} ({key}, {sent / 2**20:.1f} MiB) to {store.uri}, which lacked it, "
                f"in {time.time() - t0:.1f}s")
        return
    if not pull_artifact(store, run_dir, stage, key):
        raise UserError(f"stage '{stage}': its artifact {key} vanished from {store.uri} since planning; run again")
    log(f"  pulled {stage} ({key}) from {store.uri} in {time.time() - t0:.1f}s")


def check(store: ObjectStore | None) -> None:
    """Fail before any work when the bucket cannot be written and read back (credentials, endpoint, name)."""
    problem = probe(store) if store is not None else ""
    if problem:
        raise UserError(f"storage.uri {store.uri}: cannot write and read back an object ({problem}); check that the "
                        "bucket exists, the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and "
                        "storage.endpoint_url")


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class RunStorage:
    """Where this run's files live: `run_dir`, and the bucket of record when the run has one.

    A plain, picklable value that the runner builds once (`RunStorage.of(cfg)`) and hands to the
    stage (`ctx.storage`), which passes it explicitly to every worker it creates (Ray Train's loop
    config, the PPO ranks' and rollout engines' constructors, Tune trials). Workers never learn
    about the store from the environment, so a Ray instance or actor that predates the run cannot
    miss it.
    """

    run_dir: Path
    uri: str | None = None
    endpoint_url: str | None = None
    region: str | None = None

    @classmethod
    def of(cls, cfg) -> "RunStorage":
        s = cfg.storage
        return cls(Path(cfg.run_dir), s.uri, s.endpoint_url, s.region)

    @cached_property
    def store(self) -> ObjectStore | None:
        return ObjectStore(self.uri, self.endpoint_url, self.region) if self.uri else None

    def __getstate__(self) -> dict:  # the cached S3 client stays behind; each process makes its own
        return {k: getattr(self, k) for k in ("run_dir", "uri", "endpoint_url", "region")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def _in_store(self, path: str | Path) -> tuple[ObjectStore, str] | None:
        """(store, path relative to run_dir) when the run has a store and `path` lies in run_dir."""
        if self.store is None:
            return None
        try:
            return self.store, str(Path(path).relative_to(self.run_dir))
        except ValueError:
            return None

    def localize(self, path: str | Path) -> Path:
        """`path` on this node: pulled from the store first when it is part of an artifact this node lacks.

        Call it in worker processes before opening an input (a model directory): on a multi-node
        cluster without a shared run_dir, the driver's artifacts exist on this node only once pulled.
        """
        path = Path(path)
        if path.exists() or self.store is None:
            return path
        artifact = _artifact_of(path, self.run_dir)
        if artifact is None or not pull_artifact(self.store, self.run_dir, *artifact):
            raise FileNotFoundError(f"{path} is neither on this node nor in {self.store.uri}")
        return path

    def target(self, path: str | Path) -> tuple[str, object | None]:
        """(path, pyarrow filesystem) under which Ray Data and Ray Train should address `path`.

        A path inside run_dir maps to the same place in the bucket when the run has a store (reads
        and checkpoints then work from any node); anything else stays a local path (filesystem None).
        """
        found = self._in_store(path)
        if found is None:
            return str(path), None
        store, rel = found
        return store.path(rel), store.fs

    def push_path(self, path: str | Path) -> int:
        """Upload a file or directory of run_dir to the same place in the bucket; bytes sent (0 without a store).

        For checkpoints written outside Ray Train (the PPO stage's): each process pushes what it wrote."""
        found = self._in_store(path)
        path = Path(path)
        if found is None or not path.exists():
            return 0
        store, rel = found
        if path.is_file():
            store.write_bytes(rel, path.read_bytes())
            return path.stat().st_size
        return store.upload_dir(path, rel)

    def pull_path(self, path: str | Path) -> int:
        """Download a file or directory of run_dir from the bucket where this node lacks it (or has another
        size); bytes received (0 without a store). Serialised per path: ranks on one node share one download."""
        found = self._in_store(path)
        if found is None:
            return 0
        store, rel = found
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.pull.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if store.files(rel):  # a directory
                return store.download_dir(rel, path, skip_same=True)
            data = store.read_bytes(rel)  # a file (or nothing)
            if data is None or (path.is_file() and path.read_bytes() == data):
                return 0
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return len(data)

    def drop_path(self, path: str | Path) -> None:
        """Remove a directory of run_dir from the bucket too (old checkpoints); nothing without a store."""
        found = self._in_store(path)
        if found is not None:
            found[0].delete_dir(found[1])

    def write_parquet(self, ds, dest: Path) -> None:
        """`ds.write_parquet(dest)`; with a store, through the bucket, then pulled into `dest`.

        Ray Data's write tasks run on any node: into a node-local run_dir they would scatter the files
        over the nodes. The bucket is the one place every node reaches."""
        found = self._in_store(dest)
        if found is None:
            ds.write_parquet(str(dest))
            return
        store, rel = found
        store.delete_dir(rel)
        ds.write_parquet(store.path(rel), filesystem=store.fs)
        store.download_dir(rel, Path(dest))


def _artifact_of(path: Path, run_dir: Path) -> tuple[str, str] | None:
    """(stage, key) of the artifact holding `path`, if `path` lies in run_dir's artifacts."""
    try:
        parts = Path(path).relative_to(run_dir / "artifacts").parts
    except ValueError:
        return None
    return (parts[0], parts[1]) if len(parts) >= 2 else None


def probe(store: ObjectStore) -> str:
    """Write, read back and delete a marker object; '' if that works, else what failed."""
    rel = f".storage-check-{uuid.uuid4().hex}"
    try:
        store.write_bytes(rel, b"ok")
        ok = store.read_bytes(rel) == b"ok"
        store.delete(rel)
    except StorageError as exc:
        return str(exc.__cause__ or exc)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "" if ok else "wrote a marker object but could not read it back"
