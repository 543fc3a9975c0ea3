"""One bucket prefix (`storage.uri: s3://bucket/prefix`): the object operations the artifact store
and the checkpoint helpers are built from. Nothing here knows what an artifact is
(`pipeline.storage` does).

We use pyarrow's `S3FileSystem` rather than boto3: pyarrow is already what Ray Data and Ray Train
use for `s3://`, and it speaks to any S3-compatible endpoint (`endpoint_url`: MinIO, Ceph, GCS's
interoperability API). Credentials come from the usual AWS sources (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, ~/.aws, an instance role).

Content, never size: an upload and a download hash what they stream (SHA-256) and compare it with
what the caller expects, and "is this object the same as that file" is answered by the object's
ETag against the file's bytes. Safetensors shards of one model always have the same size, so a
size comparison would keep stale weights.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from functools import cached_property
from pathlib import Path

from pipeline.errors import StorageError, UserError

CHUNK = 1 << 20


class ContentMismatch(StorageError):
    """Bytes read or written do not hash to what the manifest says they are."""


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

    # ---------------------------------------------------------------- single objects

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
        """One PUT: readers see the old object or the whole new one, never a part."""
        try:
            with self.fs.open_output_stream(self.path(rel)) as f:
                f.write(data)
        except OSError as exc:
            raise StorageError(f"cannot write {self.url(rel)}: {exc}") from exc

    def delete(self, rel: str) -> None:
        self.fs.delete_file(self.path(rel))

    def delete_dir(self, rel: str) -> None:
        """Remove everything under `rel` (nothing there is fine)."""
        try:
            self.fs.delete_dir_contents(self.path(rel), missing_dir_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot delete {self.url(rel)}: {exc}") from exc

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

    def etag(self, rel: str) -> str | None:
        """The object's ETag (a HEAD request), or None when it does not exist."""
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return (f.metadata() or {}).get("ETag", b"").decode().strip('"') or None
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot read {self.url(rel)}: {exc}") from exc

    # ---------------------------------------------------------------- files, hashed as they stream

    def upload_file(self, local: Path, rel: str, sha256: str | None = None) -> str:
        """Upload `local` to `rel`, hashing the bytes as they are sent; returns the object's ETag.

        With `sha256`, bytes that do not hash to it (the file changed since it was recorded) are a
        `ContentMismatch`, and the object just written is removed."""
        digest = hashlib.sha256()
        try:
            with local.open("rb") as src, self.fs.open_output_stream(self.path(rel)) as dst:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
        except OSError as exc:
            raise StorageError(f"cannot upload {local} to {self.url(rel)}: {exc}") from exc
        if sha256 is not None and digest.hexdigest() != sha256:
            self.delete(rel)
            raise ContentMismatch(f"{local} changed while it was uploaded (its SHA-256 is not the manifest's)")
        return self.etag(rel) or ""

    def download_file(self, rel: str, dest: Path, sha256: str | None = None) -> int:
        """Download `rel` into `dest` (written whole, then renamed into place), hashing it as it
        arrives; bytes received. With `sha256`, other bytes are a `ContentMismatch` and `dest` is
        left as it was."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        digest, got = hashlib.sha256(), 0
        try:
            with self.fs.open_input_stream(self.path(rel)) as src, tmp.open("wb") as out:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    got += len(chunk)
            if sha256 is not None and digest.hexdigest() != sha256:
                raise ContentMismatch(f"{self.url(rel)} does not hold the bytes its manifest records "
                                      f"(SHA-256 {digest.hexdigest()[:12]}..., expected {sha256[:12]}...)")
            os.replace(tmp, dest)
        except FileNotFoundError as exc:
            raise ContentMismatch(f"{self.url(rel)} is missing") from exc
        except OSError as exc:
            raise StorageError(f"cannot download {self.url(rel)}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return got

    def upload_dir(self, local: Path, rel: str) -> int:
        """Upload every file under `local` to `rel`, skipping those the bucket already holds with the
        same content (ETag); returns the bytes uploaded. For checkpoints, which each rank adds to."""
        remote = self.files(rel)
        sent = 0
        for name in sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()):
            size = (local / name).stat().st_size
            if remote.get(name) == size and self.same_content(f"{rel}/{name}", local / name):
                continue
            self.upload_file(local / name, f"{rel}/{name}")
            sent += size
        return sent

    def download_dir(self, rel: str, local: Path, skip_same: bool = False) -> int:
        """Download every file under `rel` into `local` (each written whole, then renamed into place);
        returns the bytes downloaded. `skip_same` keeps a local file only when its content matches
        the object's (its ETag), never on size alone: a stale shard of the same size is replaced."""
        got = 0
        for name, size in self.files(rel).items():
            dest = local / safe_relative(name, self.url(rel))
            if skip_same and dest.is_file() and dest.stat().st_size == size and self.same_content(
                    f"{rel}/{name}", dest):
                continue
            got += self.download_file(f"{rel}/{name}", dest)
        return got

    def same_content(self, rel: str, local: Path) -> bool:
        """Whether `local` holds the object's bytes, by its ETag: the MD5 of a single-part upload, or
        the MD5 of the parts' MD5s with "-N" for a multipart one (tried with the part sizes pyarrow,
        boto3 and the AWS CLI use). An ETag none of them reproduces counts as different."""
        etag = self.etag(rel)
        return bool(etag) and etag in local_etags(local, etag_parts(etag, self.url(rel)))


def safe_relative(name: str, where: str) -> Path:
    """`name` as a relative path that stays inside the directory it is joined to; else a StorageError."""
    parts = Path(name).parts
    if Path(name).is_absolute() or not parts or ".." in parts:
        raise StorageError(f"refusing {where}/{name}: the name leaves the directory it belongs to")
    return Path(name)


def etag_parts(etag: str, where: str) -> int:
    """The part count an S3 ETag encodes: 0 for a single PUT ('<md5>'), N for '<md5>-N'. Anything
    else is not an S3 ETag: a `StorageError` naming the object, not a ValueError from deep inside."""
    head, sep, tail = etag.partition("-")
    if len(head) != 32 or any(c not in "0123456789abcdef" for c in head.lower()) or (sep and not tail.isdigit()):
        raise StorageError(f"{where}: the server reported ETag {etag!r}, which is neither '<md5>' nor '<md5>-N'; "
                           "is storage.endpoint_url an S3-compatible store?")
    return int(tail) if sep else 0


def local_etags(path: Path, parts: int) -> set[str]:
    """The ETags an S3 upload of `path` in `parts` parts (0: a single PUT) could have."""
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


def check(store: ObjectStore | None) -> None:
    """Fail before any work when the bucket cannot be written and read back (credentials, endpoint, name)."""
    problem = probe(store) if store is not None else ""
    if problem:
        raise UserError(f"storage.uri {store.uri}: cannot write and read back an object ({problem}); check that the "
                        "bucket exists, the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and "
                        "storage.endpoint_url")
