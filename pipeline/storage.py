"""The artifact store: `artifacts/<stage>/<key>` on disk and, with `storage.uri: s3://...`, in a bucket.

Every reader and writer of finished artifacts goes through `ArtifactStore` (the runner, the
planner, `tuned_values`, the workers' `RunStorage.localize`): the layout is spelled here and
nowhere else, and so are the rules that keep a result from being lost or taken when it is bad.

    store = ArtifactStore.of(cfg)          # built once per run
    store.lookup("sft", key)               # Lookup: "here", "bucket" or "missing" (damage named)
    work = store.begin("sft", key)         # a clean work directory (always a staging directory)
    ... the stage writes into work ...
    manifest = store.commit("sft", key, fields)   # manifest last; bucket, then disk, replaced whole

The rules (docs/architecture.md, "The artifact store"):

- **An artifact exists only with its manifest**, written last, and the manifest records the size
  and SHA-256 of *every* file. A copy whose files do not match it is damaged: a miss, with the
  reason, never a traceback and never a hit. On disk the hashes are checked with a memo on (size,
  mtime) (`FingerprintCache`), so a multi-GB checkpoint is hashed once at disk speed; in the bucket
  each file's ETag is compared with the one recorded when it was uploaded (one HEAD per file, no
  download).
- **Pulls and pushes compare content, never size**: a pull hashes what it downloads and refuses
  bytes that are not the manifest's; a push hashes what it uploads. Two safetensors shards of the
  same model always have the same size.
- **No window without a good copy.** A stage always builds into `artifacts/<stage>/.staging/<key>`.
  In the bucket each committed copy lives under its own prefix (`artifacts/<stage>/<key>/<copy>/`)
  and the manifest at `artifacts/<stage>/<key>/manifest.json` names it: a commit uploads the new
  copy beside the old one, then replaces the manifest in one PUT, then deletes the old copy. On
  disk the finished directory and the staging one are exchanged in one `renameat2(RENAME_EXCHANGE)`;
  where the filesystem lacks it, two renames whose failure puts the old copy back (and a lookup
  restores an old copy left aside by a process killed between them). A failed commit leaves the
  last good copy readable in both places.
- **Storage errors are errors**: only "no such object" reads as missing; anything else
  (credentials, network, throttling) raises `StorageError` naming the object.

Without a bucket, `run_dir` is the storage of record, and on a multi-node cluster it must be a
path every node mounts (`pipeline.cluster.check_shared_storage`). With one, the bucket is the
storage of record and `run_dir` is each machine's working copy: a local miss pulls, a local-only
artifact is pushed when next used, Ray Train checkpoints go to `<uri>/checkpoints/<stage>/<key>/`
through Ray Train's `storage_filesystem`, and Ray Data reads stage inputs from the bucket.

Workers learn about the store from a `RunStorage` value the stage passes to every worker it
creates (no environment variable); Ray Data and Ray Train get the bucket's filesystem object
itself (`RunStorage.target`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pipeline.artifacts import FingerprintCache, read_json, sha256_file, write_json_atomic
from pipeline.bucket import ContentMismatch, ObjectStore, probe  # noqa: F401 - ContentMismatch: what callers of pull catch
from pipeline.errors import StorageError, UserError
# The layout and manifest rules (pipeline.layout), also read by callers as storage.<name>.
from pipeline.layout import (ARTIFACTS, ASIDE, COPY_NAME, MANIFEST, STAGING, _clear, artifact_dir,  # noqa: F401
                             artifact_of, artifact_rel, checkpoint_dir, copy_problem, damage, file_records,
                             manifest_problem, output_paths, replace_dir)

# --------------------------------------------------------------------------- the store


class ArtifactMissing(UserError):
    """A finished artifact the plan counted on is no longer anywhere (deleted since planning)."""


@dataclass(frozen=True)
class Lookup:
    """The planner's one answer about an artifact: where a finished, undamaged copy is ("here", "bucket" or
    "missing"); `problem`, why a copy that exists does not count (damage); if missing, the stage's last attempt."""

    where: str
    manifest: dict | None = None
    problem: str | None = None
    last_attempt: dict | None = None

    @property
    def found(self) -> bool:
        return self.where != "missing"


class ArtifactStore:
    """`artifacts/<stage>/<key>` in run_dir and, when the run has one, in the bucket (module docstring)."""

    def __init__(self, run_dir: Path, bucket: ObjectStore | None = None, fps: FingerprintCache | None = None):
        self.run_dir, self.bucket = Path(run_dir), bucket
        self.fps = fps if fps is not None else FingerprintCache(self.run_dir / "fingerprints.json")

    @classmethod
    def of(cls, cfg) -> "ArtifactStore":
        return RunStorage.of(cfg).artifacts

    @property
    def where(self) -> str:
        return self.bucket.uri if self.bucket else str(self.run_dir / ARTIFACTS)

    # ---------------------------------------------------------------- layout

    def local_dir(self, stage: str, key: str) -> Path:
        return artifact_dir(self.run_dir, stage, key)

    def staging_dir(self, stage: str, key: str) -> Path:
        return self.run_dir / ARTIFACTS / stage / STAGING / key

    def _aside_dir(self, stage: str, key: str) -> Path:
        return self.run_dir / ARTIFACTS / stage / ASIDE / key

    def checkpoint_dir(self, stage: str, key: str) -> Path:
        return checkpoint_dir(self.run_dir, stage, key)

    def url(self, stage: str, key: str) -> str:
        return self.bucket.url(artifact_rel(stage, key)) if self.bucket else str(self.local_dir(stage, key))

    # ---------------------------------------------------------------- attempts (to explain a miss)

    def _attempt_path(self, stage: str) -> Path:
        return self.run_dir / ARTIFACTS / stage / "attempt.json"

    def record_attempt(self, stage: str, key: str, components: dict) -> None:
        write_json_atomic(self._attempt_path(stage), {"key": key, "components": components, "pid": os.getpid()})

    def last_attempt(self, stage: str) -> dict | None:
        return read_json(self._attempt_path(stage))

    # ---------------------------------------------------------------- lookup

    def _hash(self, path: Path) -> str:
        return self.fps.file(path)  # memoised on (size, mtime): a big file is hashed once

    def local(self, stage: str, key: str) -> tuple[dict | None, str | None]:
        """(the manifest of the finished copy in run_dir, or None; why a copy there does not count, or None)."""
        out, aside = self.local_dir(stage, key), self._aside_dir(stage, key)
        if not out.exists() and (aside / MANIFEST).is_file():
            os.replace(aside, out)  # a swap killed between its two renames: the old copy comes back
        path = out / MANIFEST
        if not path.is_file():
            return None, None
        manifest = read_json(path)
        problem = manifest_problem(manifest, key) or damage(manifest, out, self._hash)
        return (None, problem) if problem else (manifest, None)

    def remote(self, stage: str, key: str) -> tuple[dict | None, str | None]:
        """(the bucket's manifest when its copy is complete and unchanged, or None; what is wrong, or None).

        Complete and unchanged: every file the manifest records is listed with its size and has
        the ETag it had when it was uploaded (HEAD requests, in parallel; nothing is downloaded)."""
        if self.bucket is None:
            return None, None
        rel = artifact_rel(stage, key)
        raw = self.bucket.read_bytes(f"{rel}/{MANIFEST}")
        if raw is None:
            return None, None
        try:
            manifest = json.loads(raw)
        except ValueError:
            manifest = None
        problem = manifest_problem(manifest, key, in_bucket=True)
        if problem:  # named with the manifest, the object to inspect or delete
            return None, f"damaged in {self.bucket.uri}: {problem} ({self.bucket.url(f'{rel}/{MANIFEST}')})"
        base = f"{rel}/{manifest['copy']}"
        listed = self.bucket.files(base)
        if manifest["files"] and not listed:
            return None, (f"damaged in {self.bucket.uri}: its manifest ({self.bucket.url(f'{rel}/{MANIFEST}')}) names "
                          f"copy {manifest['copy']!r}, which the artifact does not hold")
        etags = manifest.get("etags", {})
        for name, rec in manifest["files"].items():
            if name not in listed:
                return None, f"damaged in {self.bucket.uri}: {name} is missing"
            if listed[name] != rec["size"]:
                return None, f"damaged in {self.bucket.uri}: {name} has {listed[name]} bytes, {rec['size']} when made"
        with ThreadPoolExecutor(8) as pool:
            now = dict(zip(manifest["files"], pool.map(lambda n: self.bucket.etag(f"{base}/{n}"), manifest["files"])))
        for name in manifest["files"]:
            if not etags.get(name) or now[name] != etags[name]:
                return None, f"damaged in {self.bucket.uri}: {name} changed after it was uploaded (its ETag differs)"
        return manifest, None

    def lookup(self, stage: str, key: str) -> Lookup:
        """Where a good copy is: run_dir first, then the bucket. A damaged copy is a miss with its reason."""
        manifest, local_problem = self.local(stage, key)
        if manifest is not None:
            return Lookup("here", manifest)
        remote, remote_problem = self.remote(stage, key)
        if remote is not None:
            return Lookup("bucket", remote, f"output damaged: {local_problem}" if local_problem else None)
        problems = [p for p in (local_problem and f"output damaged: {local_problem}", remote_problem) if p]
        return Lookup("missing", None, "; ".join(problems) or None, self.last_attempt(stage))

    def manifest(self, stage: str, key: str) -> dict | None:
        """The manifest of the finished copy in run_dir, or None."""
        return self.local(stage, key)[0]

    def outputs(self, stage: str, key: str) -> dict[str, Path]:
        """{output name: path} of the finished copy in run_dir (pull it first: `ensure_local`)."""
        manifest = self.manifest(stage, key)
        if manifest is None:
            raise ArtifactMissing(f"stage '{stage}': no finished artifact {key} in {self.run_dir / ARTIFACTS}")
        return output_paths(manifest, self.local_dir(stage, key))

    def read_output(self, stage: str, key: str, name: str) -> bytes | None:
        """One (small) output file's bytes, from run_dir or else the bucket, without pulling the
        artifact (planning writes nothing); None without a good copy."""
        found = self.lookup(stage, key)
        if found.where == "here":
            return output_paths(found.manifest, self.local_dir(stage, key))[name].read_bytes()
        if found.where == "bucket":
            rel = found.manifest["outputs"][name]
            return self.bucket.read_bytes(f"{artifact_rel(stage, key)}/{found.manifest['copy']}/{rel}")
        return None

    # ---------------------------------------------------------------- moving copies

    def pull(self, stage: str, key: str) -> dict | None:
        """Bring the bucket's copy into run_dir; its manifest, or None when the bucket has no good copy.

        Every file is hashed as it downloads and must be the manifest's (`ContentMismatch`
        otherwise, and run_dir is left as it was). Downloaded into a temporary sibling and swapped
        in whole, manifest included; a per-artifact lock lets the processes of one node that need
        the same model share one download."""
        local = self.local_dir(stage, key)
        local.parent.mkdir(parents=True, exist_ok=True)
        with open(local.parent / f".{key}.pull.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            manifest, _ = self.local(stage, key)
            if manifest is not None or self.bucket is None:  # here already (another process pulled it meanwhile)
                return manifest
            manifest, _ = self.remote(stage, key)
            if manifest is None:
                return None
            base = f"{artifact_rel(stage, key)}/{manifest['copy']}"
            tmp = Path(tempfile.mkdtemp(dir=local.parent, prefix=f".{key}.pull-"))
            try:
                for name, rec in manifest["files"].items():
                    self.bucket.download_file(f"{base}/{name}", tmp / name, rec["sha256"])
                write_json_atomic(tmp / MANIFEST, manifest)
                self._remember(tmp, local, manifest)
                replace_dir(tmp, local, self._aside_dir(stage, key))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return manifest

    def _remember(self, src: Path, dest: Path, manifest: dict) -> None:
        """Seed the hash memo with files whose content was just verified (they keep their mtime when renamed)."""
        for name, rec in manifest["files"].items():
            st = (src / name).stat()
            self.fps.memo[str(dest / name)] = [st.st_size, st.st_mtime_ns, rec["sha256"]]

    def _publish(self, stage: str, key: str, src: Path, manifest: dict) -> tuple[dict, int]:
        """Upload `src` as a new copy beside the bucket's current one, then switch the manifest to it
        (one PUT), then delete every other copy. Returns (the bucket's manifest, bytes sent).

        Until the switch the old copy is the bucket's artifact, whole; a failure before it leaves
        only an unreferenced prefix, deleted by the next publish."""
        rel = artifact_rel(stage, key)
        copy = f"copy-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        etags, sent = {}, 0
        for name, rec in manifest["files"].items():
            etags[name] = self.bucket.upload_file(src / name, f"{rel}/{copy}/{name}", rec["sha256"])
            sent += rec["size"]
        published = {**manifest, "copy": copy, "etags": etags}
        self.bucket.write_bytes(f"{rel}/{MANIFEST}", json.dumps(published, indent=2, sort_keys=True,
                                                                  default=str).encode())
        for name in {n.split("/", 1)[0] for n in self.bucket.files(rel)} - {copy, MANIFEST}:
            try:
                self.bucket.delete_dir(f"{rel}/{name}") if name.startswith("copy-") else self.bucket.delete(
                    f"{rel}/{name}")
            except (StorageError, OSError):
                pass  # an old copy left behind costs space, not correctness: the next publish retries
        return published, sent

    def push(self, stage: str, key: str) -> int:
        """Publish run_dir's finished copy to the bucket (one that lacks it, or holds a damaged one);
        bytes sent. The local manifest then names the same copy as the bucket's."""
        manifest = self.manifest(stage, key)
        if manifest is None:
            raise ArtifactMissing(f"{self.local_dir(stage, key)} is not a finished artifact: only those are pushed")
        published, sent = self._publish(stage, key, self.local_dir(stage, key), manifest)
        write_json_atomic(self.local_dir(stage, key) / MANIFEST, published)
        return sent

    def ensure_local(self, stage: str, key: str, log=lambda message: None, verified: dict | None = None) -> dict:
        """Make a finished artifact present here (pulled if only the bucket has it) and in the bucket
        (pushed if it lacks a good copy); its manifest. `ContentMismatch` if the bucket's copy
        turns out damaged while it downloads; `ArtifactMissing` if it is nowhere. `verified`: the
        manifest of the copy here whose files the caller has just checked (`lookup`), not hashed again."""
        t0 = time.time()
        manifest = verified if verified is not None else self.local(stage, key)[0]
        if manifest is not None:
            if self.bucket is not None and self.remote(stage, key)[0] is None:
                sent = self.push(stage, key)
                log(f"  pushed {stage} ({key}, {sent / 2**20:.1f} MiB) to {self.bucket.uri}, which lacked a good "
                    f"copy, in {time.time() - t0:.1f}s")
                manifest = self.manifest(stage, key)
            return manifest
        manifest = self.pull(stage, key)
        if manifest is None:
            raise ArtifactMissing(f"stage '{stage}': its artifact {key} is no longer in {self.where} (deleted or "
                                  "damaged since planning); run again")
        log(f"  pulled {stage} ({key}) from {self.bucket.uri} in {time.time() - t0:.1f}s")
        return manifest

    # ---------------------------------------------------------------- building

    def begin(self, stage: str, key: str, fresh: bool = False) -> Path:
        """A clean work directory for a stage about to build `key`: always the staging directory, so
        whatever finished copy exists (here or in the bucket) stays whole until `commit`. `fresh`
        (--force) also drops the key's checkpoints, here and in the bucket: it trains from scratch."""
        work = self.staging_dir(stage, key)
        _clear(work)
        self._drop_in_bucket(work)  # what a worker of an interrupted attempt pushed there
        work.mkdir(parents=True)
        if fresh:
            shutil.rmtree(self.checkpoint_dir(stage, key), ignore_errors=True)
            self._drop_in_bucket(self.checkpoint_dir(stage, key))
        return work

    def _drop_in_bucket(self, path: Path) -> None:
        if self.bucket is not None:
            self.bucket.delete_dir(str(path.relative_to(self.run_dir)))

    def commit(self, stage: str, key: str, fields: dict, log=lambda message: None) -> dict:
        """Make the staging directory the artifact: manifest (with every file's SHA-256) written last,
        the bucket's copy replaced first, then run_dir's, each without a moment where neither copy
        exists. Returns the manifest."""
        work = self.staging_dir(stage, key)
        outputs = fields.get("outputs", {})
        external = [p for p in outputs.values() if Path(p).is_absolute()]
        if external and self.bucket is not None:
            raise UserError(f"stage '{stage}' returned {external[0]}, outside its artifact directory; with "
                            "storage.uri every output must be written under ctx.out_dir to reach the bucket")
        records = file_records(work, sha256_file)
        manifest = {**fields, "stage": stage, "key": key, "files": records}
        write_json_atomic(work / MANIFEST, manifest)
        if self.bucket is not None:
            t0 = time.time()
            manifest, sent = self._publish(stage, key, work, manifest)
            write_json_atomic(work / MANIFEST, manifest)
            self._drop_in_bucket(work)
            log(f"pushed {sent / 2**20:.1f} MiB to {self.url(stage, key)} in {time.time() - t0:.1f}s")
        self._remember(work, self.local_dir(stage, key), manifest)
        replace_dir(work, self.local_dir(stage, key), self._aside_dir(stage, key))
        self.fps.save()
        return manifest


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

    @cached_property
    def artifacts(self) -> ArtifactStore:
        """The artifact store over this run_dir and bucket (one per process)."""
        return ArtifactStore(self.run_dir, self.store)

    def __getstate__(self) -> dict:  # the cached S3 client and store stay behind; each process makes its own
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
        cluster without a shared run_dir, the driver's artifacts exist on this node only once pulled."""
        path = Path(path)
        if path.exists() or self.store is None:
            return path
        found = artifact_of(path, self.run_dir)
        if found is None or self.artifacts.pull(found[0], found[1]) is None:
            raise FileNotFoundError(f"{path} is neither on this node nor in {self.store.uri}")
        return path

    def target(self, path: str | Path) -> tuple[str, object | None]:
        """(path, pyarrow filesystem) under which Ray Data and Ray Train should address `path`.

        A path inside run_dir maps to the same place in the bucket when the run has a store (reads
        and checkpoints then work from any node), a path inside a finished artifact to its current
        copy there; anything else stays a local path (filesystem None)."""
        found = self._in_store(path)
        if found is None:
            return str(path), None
        store, rel = found
        art = artifact_of(path, self.run_dir)
        if art is not None:
            stage, key, inner = art
            manifest, problem = self.artifacts.remote(stage, key)
            if manifest is None:
                raise StorageError(f"{path}: artifact {stage}/{key} has no good copy in {store.uri}"
                                   f"{f' ({problem})' if problem else ''}")
            rel = str(Path(artifact_rel(stage, key)) / manifest["copy"] / inner)
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
            store.upload_file(path, rel)
            return path.stat().st_size
        return store.upload_dir(path, rel)

    def pull_path(self, path: str | Path) -> int:
        """Download a file or directory of run_dir from the bucket where this node lacks it (or holds other
        bytes); bytes received (0 without a store). Serialised per path: ranks on one node share one download."""
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
        """`ds.write_parquet(dest)`; with a store, through a scratch prefix of the bucket, then downloaded
        into `dest` (and the scratch deleted).

        Ray Data's write tasks run on any node: into a node-local run_dir they would scatter the files
        over the nodes. The bucket is the one place every node reaches. The commit uploads the
        artifact like any other."""
        if self.store is None:
            ds.write_parquet(str(dest))
            return
        scratch = f"scratch/{uuid.uuid4().hex}"
        try:
            ds.write_parquet(self.store.path(scratch), filesystem=self.store.fs)
            self.store.download_dir(scratch, Path(dest))
        finally:
            self.store.delete_dir(scratch)
