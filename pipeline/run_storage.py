"""What a worker receives about the run's files: `RunStorage`, run_dir and the bucket of record.

A plain, picklable value the runner builds once and hands to the stage (`ctx.storage`), which passes it
explicitly to every worker it creates. Workers open inputs through `localize` (pulled from the bucket when
this node lacks them), address run_dir paths for Ray Data and Ray Train through `target`, and push or pull
their own checkpoints (`push_path`, `pull_path`). The artifact store itself is `pipeline.storage`.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pipeline.bucket import ObjectStore
from pipeline.errors import StorageError
from pipeline.storage import ArtifactStore, artifact_of, artifact_rel


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
