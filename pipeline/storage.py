"""The artifact store: `artifacts/<stage>/<key>` on disk and, with `storage.uri: s3://...`, in a bucket.

Every reader and writer of finished artifacts goes through `ArtifactStore` (the runner, the planner,
`tuned_values`, the workers' `RunStorage.localize`): the layout is spelled here and nowhere else, and
so are the rules that keep a result from being lost or taken when it is bad (docs/architecture.md,
"The artifact store", says each rule and why):

    store = ArtifactStore.of(cfg)          # built once per run
    store.lookup("sft", key)               # Lookup: "here", "bucket" or "missing" (damage named)
    work = store.begin("sft", key)         # a clean work directory (always a staging directory)
    ... the stage writes into work ...
    manifest = store.commit("sft", key, fields)   # manifest last; bucket, then disk, replaced whole

Read top to bottom (files written whole or not at all, and their memoised hashes, are pipeline/files.py's):
the layout (spelled once); manifests (every file's size and SHA-256; a copy whose files do not match is
damaged: a miss with its reason, never a hit); the store itself (lookup, pull, push, begin, commit: the
bucket's copy replaced before run_dir's, run_dir's swapped in by `pipeline.swap` with no moment without a
good copy). Storage errors are errors: only
"no such object" reads as missing. What a worker receives is `pipeline.run_storage.RunStorage`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.bucket import ContentMismatch, ObjectStore, safe_relative  # noqa: F401 - ContentMismatch: what callers of pull catch
from pipeline.errors import StorageError, UserError
from pipeline.files import FingerprintCache, read_json, sha256_file, write_json_atomic
from pipeline.swap import replace_dir

MANIFEST = "manifest.json"
ARTIFACTS = "artifacts"
STAGING = ".staging"  # artifacts/<stage>/.staging/<key>: where a stage builds (its name is still the key)
# What `_publish` names a bucket copy: one directory right under its artifact's prefix, `copy-<time>-<id>`.
COPY_NAME = re.compile(r"copy-[0-9A-Za-z-]+")
ASIDE = ".old"  # artifacts/<stage>/.old/<key>: a finished copy set aside during a two-rename swap


# --------------------------------------------------------------------------- layout (spelled once)


def artifact_rel(stage: str, key: str) -> str:
    """Where an artifact lives, relative to run_dir and to the bucket prefix."""
    return f"{ARTIFACTS}/{stage}/{key}"


def artifact_dir(run_dir: Path, stage: str, key: str) -> Path:
    return Path(run_dir) / artifact_rel(stage, key)


def checkpoint_dir(run_dir: Path, stage: str, key: str) -> Path:
    """Training checkpoints of one key, kept across attempts (a rerun of the same key resumes)."""
    return Path(run_dir) / "checkpoints" / stage / key


def artifact_of(path: str | Path, run_dir: Path) -> tuple[str, str, Path] | None:
    """(stage, key, path inside the artifact) of a path in run_dir's finished artifacts, else None."""
    try:
        parts = Path(path).relative_to(Path(run_dir) / ARTIFACTS).parts
    except ValueError:
        return None
    if len(parts) < 2 or parts[1].startswith("."):  # staging and set-aside copies are not artifacts
        return None
    return parts[0], parts[1], Path(*parts[2:]) if len(parts) > 2 else Path()


def output_paths(manifest: dict, out_dir: Path) -> dict[str, Path]:
    """Outputs recorded relative to the artifact dir resolve against it; external paths stay."""
    return {name: (out_dir / p) if not Path(p).is_absolute() else Path(p) for name, p in manifest["outputs"].items()}


# --------------------------------------------------------------------------- manifests, pure


def file_records(out_dir: Path, hasher=sha256_file) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of everything a stage wrote: what its manifest vouches for."""
    records = {}
    for f in sorted(out_dir.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            records[str(f.relative_to(out_dir))] = {"size": f.stat().st_size, "sha256": hasher(f)}
    return records


def manifest_problem(manifest, key: str, in_bucket: bool = False) -> str | None:
    """What makes a manifest unusable for `key` (not ours, no content hashes, outputs that leave the
    artifact), or None. A bucket manifest must name only paths inside its artifact: one written by
    another machine cannot point this one at its files."""
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return "its manifest is unreadable or belongs to another key"
    files, outputs = manifest.get("files"), manifest.get("outputs")
    if not isinstance(files, dict) or not isinstance(outputs, dict):
        return "its manifest lists no files or outputs"
    if any(not isinstance(r, dict) or "sha256" not in r for r in files.values()):
        return "its manifest has no content hash for every file (made by an older version of the pipeline)"
    names = [*files, *(outputs.values() if in_bucket else [p for p in outputs.values() if not Path(p).is_absolute()])]
    for name in names:
        try:
            safe_relative(str(name), "manifest")
        except StorageError:
            return f"its manifest names {name!r}, a path outside the artifact"
    return copy_problem(manifest.get("copy")) if in_bucket else None


def copy_problem(copy) -> str | None:
    """Why a bucket manifest's `copy` is not a copy directory of its artifact, or None.

    Its files are read from (and pulled into run_dir out of) `<artifact>/<copy>/`, so `copy` must be one
    name of the form `_publish` writes: '../../other', '/abs' or 'a/b' would point this machine at objects
    outside the artifact, which a manifest written elsewhere must not be able to do."""
    if not isinstance(copy, str):
        return "its bucket manifest names no copy (made by an older version of the pipeline)"
    if not COPY_NAME.fullmatch(copy):
        return (f"its bucket manifest names copy {copy!r}, not a copy directory of the artifact (one name, "
                "copy-<time>-<id>): a path that could leave the artifact is refused")
    return None


def damage(manifest: dict, out_dir: Path, hasher=sha256_file) -> str | None:
    """What on disk no longer matches the manifest's file records (missing, resized, edited), or None."""
    for rel, rec in manifest["files"].items():
        f = out_dir / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != rec["size"]:
            return f"{rel} has {size} bytes, {rec['size']} when it was made"
        if hasher(f) != rec["sha256"]:
            return f"{rel} changed after it was made (its SHA-256 differs)"
    return None


# --------------------------------------------------------------------------- local swaps


def _clear(directory: Path) -> None:
    """Remove a work directory, its manifest first (a half-deleted directory is never finished)."""
    if directory.exists():
        (directory / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(directory)


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
        s = cfg.storage
        return cls(Path(cfg.run_dir), ObjectStore(s.uri, s.endpoint_url, s.region) if s.uri else None)

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
