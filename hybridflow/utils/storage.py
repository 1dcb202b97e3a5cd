"""Object storage (``s3://``, ``gs://``, any fsspec URL) for data files, models, checkpoints and exports.

Everything that trains reads local files: the loaders, safetensors, ``torch.distributed.checkpoint``.
So object storage is a transfer at the edges of a run, not a second code path through it:

- data files are read through fsspec (parquet by pyarrow over the fsspec filesystem);
- a model is downloaded once into a local cache (``fetch_tree``) and loaded from there;
- checkpoints and exports are written locally as before (atomic folder, SHA-256 manifest) and
  the finished folder is uploaded (``upload_tree``, the manifest last, so a remote folder
  without its manifest is an interrupted upload and never used).

Credentials come from each backend's own chain (for S3: ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws``, an instance role; for GCS:
``GOOGLE_APPLICATION_CREDENTIALS`` or gcloud's login): a user's existing set-up works unchanged.
``Storage.endpoint_url`` points S3 at a compatible server (MinIO, R2, a local test server);
botocore's own ``AWS_ENDPOINT_URL`` works too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.utils.errors import causes, one_line

log = logging.getLogger(__name__)

# "<scheme>://..." with a scheme of two letters or more: a Windows drive ("C:\") is no URL.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# Local schemes: a path the local filesystem reads directly.
_LOCAL_SCHEMES = ("file", "local")
# Backends fsspec names but does not ship, with the extra that installs them.
_BACKEND_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
# The tree manifest written next to a downloaded copy (fetch_tree): the remote listing it was
# made from and the SHA-256 of every file, so a reuse checks both that the remote is unchanged
# and that the local copy is intact.
TREE_MANIFEST = "manifest.json"
TREE_FILES = "files"


class StorageError(RuntimeError):
    """A remote URL that cannot be used (no backend, no credentials, no bucket, no such file),
    or a transfer that failed. One line, naming the URL; callers add the config key."""


def is_remote(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a URL that needs fsspec (``s3://b/k``), not a local path."""
    if path is None or isinstance(path, Path):
        return False
    m = _URL.match(str(path))
    return bool(m) and m.group(1).lower() not in _LOCAL_SCHEMES


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended by ``/`` (object stores have no other separator)."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def sha256_file(path: Path) -> str:
    """The SHA-256 hex digest of a local file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _version_tag(info: dict[str, Any]) -> str:
    """What identifies one version of a remote object in a listing: S3's ETag, GCS's md5 or
    generation, else the modification time. Compared only with an earlier listing of the same
    store, so its format does not matter."""
    for key in ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "updated"):
        if info.get(key) is not None:
            return str(info[key]).strip('"')
    return ""


def explain(url: str, exc: BaseException) -> str:
    """Why ``url`` could not be used, in words a user can act on."""
    names = {type(c).__name__ for c in causes(exc)}
    text = " ".join(str(c) for c in causes(exc))
    scheme = url.split("://", 1)[0].lower()
    if names & {"NoCredentialsError", "PartialCredentialsError"} or "Unable to locate credentials" in text:
        return (f"no credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, "
                f"~/.aws/credentials, an instance role)")
    if names & {"DefaultCredentialsError", "RefreshError"}:
        return f"no credentials for {url}: set GOOGLE_APPLICATION_CREDENTIALS or run gcloud auth application-default login"
    if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return f"the credentials were refused for {url} (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    if "AccessDenied" in text or "Forbidden" in text or "403" in text.split():
        return f"access denied to {url}: the credentials lack permission for it"
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return f"the bucket of {url} does not exist: create it or fix the URL"
    if names & {"EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError", "ConnectTimeoutError"}:
        where = "storage.endpoint_url / AWS_ENDPOINT_URL" if scheme.startswith("s3") else "the network"
        return f"cannot connect to the server of {url} (check {where}): {one_line(exc)}"
    return f"{url}: {one_line(exc)}"


@dataclass(frozen=True)
class Storage:
    """How to reach remote URLs: an S3-compatible endpoint, if any. One filesystem object per
    scheme, made on first use (each holds a connection pool)."""

    endpoint_url: str | None = None
    _filesystems: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def filesystem(self, url: str) -> tuple[Any, str]:
        """(fsspec filesystem, the path inside it) for ``url``; ``StorageError`` when fsspec or
        the scheme's backend is not installed."""
        scheme = url.split("://", 1)[0].lower()
        fs = self._filesystems.get(scheme)
        if fs is None:
            try:
                import fsspec
            except ImportError as exc:
                raise StorageError(f"{url}: reading remote URLs needs fsspec: pip install 'hybridflow[s3]'") from exc
            kwargs: dict[str, Any] = {}
            if scheme in ("s3", "s3a") and self.endpoint_url:
                kwargs["client_kwargs"] = {"endpoint_url": self.endpoint_url}
            # No instance cache: fsspec's would hand back a filesystem made under earlier
            # credentials; ours lives as long as this Storage (one run).
            kwargs["skip_instance_cache"] = True
            try:
                fs = fsspec.filesystem(scheme, **kwargs)
            except (ImportError, ValueError) as exc:
                package = _BACKEND_PACKAGES.get(scheme)
                extra = "s3" if package == "s3fs" else "gcs" if package == "gcsfs" else None
                fix = f"pip install 'hybridflow[{extra}]' (or pip install {package})" if extra else \
                    f"install the fsspec backend for {scheme}://"
                raise StorageError(f"{url}: no filesystem for {scheme}:// ({one_line(exc)}); {fix}") from exc
            self._filesystems[scheme] = fs
        return fs, fs._strip_protocol(url)

    def _call(self, url: str, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, a backend's exception turned into one line naming ``url``."""
        try:
            return fn(*args)
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"{what}: {explain(url, exc)}" if what else explain(url, exc)) from exc

    # ------------------------------------------------------------------ checks
    def check(self, url: str, kind: str) -> None:
        """Fail now, with one line, when ``url`` cannot be used as ``kind``: ``file`` (an object
        that must exist), ``dir`` (a folder that must exist), or ``root`` (a folder this run
        writes: its bucket must exist and be readable). Contacts the server once or twice."""
        fs, path = self.filesystem(url)
        bucket = path.split("/", 1)[0]
        scheme = url.split("://", 1)[0]
        # One request on the bucket itself (S3: HEAD bucket) needs both credentials and the
        # bucket; exists() would hide missing credentials behind "no such bucket" on some backends.
        try:
            self._call(url, "", fs.info, bucket)
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise StorageError(f"the bucket of {url} does not exist: create it or fix the URL") from exc
            raise
        if kind == "file" and not self._call(url, "", fs.isfile, path):
            raise StorageError(f"{url} does not exist (or is not a file) in bucket {scheme}://{bucket}")
        if kind == "dir" and not self._call(url, "", fs.isdir, path):
            raise StorageError(f"{url} does not exist (or is not a folder) in bucket {scheme}://{bucket}")

    # ------------------------------------------------------------------ reading and listing
    def open(self, url: str, mode: str = "rb") -> Any:
        fs, path = self.filesystem(url)
        return self._call(url, "cannot open it", fs.open, path, mode)

    def exists(self, url: str) -> bool:
        fs, path = self.filesystem(url)
        return bool(self._call(url, "cannot check it", fs.exists, path))

    def listdir(self, url: str) -> list[str]:
        """Names directly under ``url`` (files and folders); [] when there is nothing there."""
        fs, path = self.filesystem(url)
        if not self._call(url, "cannot list it", fs.exists, path):
            return []
        fs.invalidate_cache(path)  # another process may have written here since we last looked
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self._call(url, "cannot list it", fs.ls, path, False))

    def listing(self, url: str) -> dict[str, tuple[int, str]]:
        """{relative path: (size, version tag)} of every object under ``url``."""
        fs, path = self.filesystem(url)
        fs.invalidate_cache(path)
        found = self._call(url, "cannot list it", fs.find, path, None, False, True)
        prefix = path.rstrip("/") + "/"
        out = {}
        for name, info in found.items():
            if info.get("type") == "directory" or not name.startswith(prefix):
                continue
            out[name[len(prefix):]] = (int(info.get("size") or 0), _version_tag(info))
        return out

    def read_text(self, url: str) -> str:
        with self.open(url, "rb") as fh:
            return fh.read().decode("utf-8")

    # ------------------------------------------------------------------ transfers
    def download(self, url: str, dest: Path) -> dict[str, tuple[int, str]]:
        """Copy every object under ``url`` into the folder ``dest`` (created; its parents must
        exist); returns the listing it copied. Sizes are checked against the listing, so a
        transfer cut short fails here."""
        fs, path = self.filesystem(url)
        listed = self.listing(url)
        if not listed:
            raise StorageError(f"{url} holds no files")
        for rel, (size, _) in listed.items():
            local = dest / rel
            local.parent.mkdir(parents=True, exist_ok=True)
            self._call(url, f"downloading {rel} failed", fs.get_file, f"{path.rstrip('/')}/{rel}", str(local))
            if local.stat().st_size != size:
                raise StorageError(f"downloading {join(url, rel)} failed: {local.stat().st_size} bytes arrived, "
                                   f"the listing says {size}")
        return listed

    def upload(self, src: Path, url: str, last: tuple[str, ...] = ()) -> None:
        """Copy every file under ``src`` to ``url``, the relative paths in ``last`` after all the
        others (a manifest: its presence then means the upload finished)."""
        fs, path = self.filesystem(url)
        files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
        ordered = [f for f in files if f not in last] + [f for f in last if f in files]
        for rel in ordered:
            self._call(url, f"uploading {rel} failed", fs.put_file, str(src / rel), f"{path.rstrip('/')}/{rel}")
        fs.invalidate_cache(path)

    def remove(self, url: str, first: tuple[str, ...] = ()) -> None:
        """Delete everything under ``url``, the relative paths in ``first`` before the rest (a
        manifest: a deletion cut short then leaves a folder that no longer looks complete)."""
        fs, path = self.filesystem(url)
        for rel in first:
            target = f"{path.rstrip('/')}/{rel}"
            if self._call(url, "cannot delete it", fs.exists, target):
                self._call(url, "cannot delete it", fs.rm, target)
        if self._call(url, "cannot delete it", fs.exists, path):
            self._call(url, "cannot delete it", fs.rm, path, True)
        fs.invalidate_cache(path)

    def write_text(self, url: str, text: str) -> None:
        fs, path = self.filesystem(url)
        self._call(url, "cannot write it", fs.pipe_file, path, text.encode("utf-8"))

    # ------------------------------------------------------------------ cached copies
    def fetch_tree(self, url: str, cache_dir: str | os.PathLike[str]) -> Path:
        """A verified local copy of the folder ``url`` under ``cache_dir``: downloaded once, then
        reused while the remote listing (sizes and version tags) is unchanged and every local
        file still has its recorded SHA-256; else downloaded again.

        ``<cache_dir>/<sha256(url)[:16]>/{files/, manifest.json}``. The download goes into a
        temporary folder that is renamed into place only when complete and hashed, so a killed
        download is never used; a file lock makes ranks or runs sharing the cache wait for one
        download instead of each making their own."""
        from filelock import FileLock

        cache = Path(cache_dir).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
        final = cache / key
        with FileLock(str(cache / f"{key}.lock")):
            listed = self.listing(url)
            if not listed:
                raise StorageError(f"{url} holds no files")
            problem = _cached_copy_problem(final, listed)
            if problem is None:
                log.info("using the cached copy of %s: %s", url, final / TREE_FILES)
                return final / TREE_FILES
            if final.exists():
                log.warning("downloading %s again: the cached copy %s %s", url, final, problem)
            else:
                log.info("downloading %s to %s", url, final)
            tmp = cache / f".tmp-{key}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir()
                listed = self.download(url, tmp / TREE_FILES)
                manifest = {rel: {"size": size, "version": tag, "sha256": sha256_file(tmp / TREE_FILES / rel)}
                            for rel, (size, tag) in listed.items()}
                (tmp / TREE_MANIFEST).write_text(json.dumps({"url": url, TREE_FILES: manifest}, indent=1))
                if final.exists():
                    trash = cache / f".trash-{key}-{os.getpid()}"
                    os.replace(final, trash)
                    shutil.rmtree(trash, ignore_errors=True)
                os.replace(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return final / TREE_FILES


def _cached_copy_problem(folder: Path, listed: dict[str, tuple[int, str]]) -> str | None:
    """None when ``folder`` is a complete, intact copy of the objects ``listed``; else what is wrong."""
    try:
        manifest = json.loads((folder / TREE_MANIFEST).read_text())[TREE_FILES]
    except (OSError, ValueError, KeyError, TypeError):
        return "has no readable manifest"
    recorded = {rel: (entry["size"], entry["version"]) for rel, entry in manifest.items()}
    if recorded != listed:
        return "is of an older version of the remote files"
    files = folder / TREE_FILES
    present = {p.relative_to(files).as_posix() for p in files.rglob("*") if p.is_file()}
    if present != set(manifest):
        return "has missing or extra files"
    for rel, entry in manifest.items():
        path = files / rel
        # Hashing the whole copy costs a read of it (about a second per GB), the price of never
        # loading a model from a file that was altered or cut short on this disk.
        if path.stat().st_size != entry["size"] or sha256_file(path) != entry["sha256"]:
            return f"has a damaged file ({rel})"
    return None
