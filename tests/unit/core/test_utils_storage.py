"""Object storage (hybridflow/utils/storage.py) against moto's S3 server on 127.0.0.1 (the
``s3`` fixture, tests/conftest.py): URL checks and their one-line errors, transfers, and the
verified download cache that a model.path URL goes through."""

from __future__ import annotations

import json
import uuid

import pytest

from hybridflow.utils import storage as storage_module
from hybridflow.utils.storage import TREE_MANIFEST, Storage, StorageError, is_remote, join


@pytest.fixture
def bucket(s3):
    """A fresh bucket and a Storage that reaches it."""
    store = Storage(endpoint_url=s3.endpoint_url)
    name = f"b-{uuid.uuid4().hex[:12]}"
    fs, _ = store.filesystem(f"s3://{name}")
    fs.mkdir(name)
    return store, f"s3://{name}"


def write_tree(root, files):
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_urls_are_told_from_local_paths():
    assert is_remote("s3://b/k") and is_remote("gs://b/k") and is_remote("S3://b/k")
    assert not is_remote("/data/x.parquet") and not is_remote("file:///data/x") and not is_remote(None)
    assert not is_remote("C:\\data\\x.parquet") and not is_remote("relative/x.parquet")
    assert join("s3://b/run/", "/global_step_1", "manifest.json") == "s3://b/run/global_step_1/manifest.json"


def test_a_missing_bucket_file_or_folder_is_named(bucket):
    store, root = bucket
    with pytest.raises(StorageError, match=r"the bucket of s3://no-such-bucket-x/a does not exist"):
        store.check("s3://no-such-bucket-x/a", "root")
    with pytest.raises(StorageError, match=r"train.parquet does not exist \(or is not a file\)"):
        store.check(f"{root}/train.parquet", "file")
    with pytest.raises(StorageError, match=r"model does not exist \(or is not a folder\)"):
        store.check(f"{root}/model", "dir")
    store.check(f"{root}/checkpoints", "root")  # a folder the run will write need not exist yet


def test_missing_credentials_are_one_line_with_the_fix(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError) as err:
        Storage(endpoint_url=s3.endpoint_url).check("s3://any-bucket/x.parquet", "file")
    message = str(err.value)
    assert "no credentials for s3://any-bucket/x.parquet" in message and "AWS_ACCESS_KEY_ID" in message
    assert "\n" not in message


def test_upload_puts_the_last_files_last_and_download_round_trips(bucket, tmp_path, monkeypatch):
    store, root = bucket
    src = write_tree(tmp_path / "src", {"a.bin": b"a" * 10, "sub/b.bin": b"b" * 1000, "manifest.json": b"{}"})
    order = []
    fs, _ = store.filesystem(root)
    real_put = fs.put_file
    monkeypatch.setattr(fs, "put_file", lambda lpath, rpath, **kw: (order.append(rpath.rsplit("/", 1)[-1]),
                                                                      real_put(lpath, rpath, **kw))[1])
    store.upload(src, f"{root}/tree", last=("manifest.json",))
    assert order[-1] == "manifest.json" and sorted(order) == ["a.bin", "b.bin", "manifest.json"]
    assert {rel: size for rel, (size, _) in store.listing(f"{root}/tree").items()} == \
        {"a.bin": 10, "sub/b.bin": 1000, "manifest.json": 2}
    assert store.listdir(root) == ["tree"] and store.listdir(f"{root}/nothing") == []
    store.download(f"{root}/tree", tmp_path / "copy")
    assert (tmp_path / "copy" / "sub" / "b.bin").read_bytes() == b"b" * 1000
    store.remove(f"{root}/tree", first=("manifest.json",))
    assert store.listdir(root) == []


def test_fetch_tree_downloads_once_then_reuses_a_verified_copy(bucket, tmp_path, monkeypatch):
    store, root = bucket
    store.upload(write_tree(tmp_path / "model", {"config.json": b"{}", "model.safetensors": b"w" * 4096}), f"{root}/m")
    cache = tmp_path / "cache"
    first = store.fetch_tree(f"{root}/m", cache)
    assert (first / "model.safetensors").read_bytes() == b"w" * 4096
    manifest = json.loads((first.parent / TREE_MANIFEST).read_text())
    assert manifest["url"] == f"{root}/m" and set(manifest["files"]) == {"config.json", "model.safetensors"}

    downloads = []
    real = Storage.download
    monkeypatch.setattr(Storage, "download", lambda self, url, dest: (downloads.append(url), real(self, url, dest))[1])
    assert store.fetch_tree(f"{root}/m", cache) == first and downloads == []  # reused, nothing fetched

    # A file altered on the local disk (same size, so only the hash can tell) is caught and re-fetched.
    (first / "model.safetensors").write_bytes(b"x" * 4096)
    assert (store.fetch_tree(f"{root}/m", cache) / "model.safetensors").read_bytes() == b"w" * 4096
    assert downloads == [f"{root}/m"]

    # A new version of the remote files replaces the copy.
    store.upload(write_tree(tmp_path / "v2", {"model.safetensors": b"v" * 4096}), f"{root}/m")
    assert (store.fetch_tree(f"{root}/m", cache) / "model.safetensors").read_bytes() == b"v" * 4096
    assert len(downloads) == 2
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [first.parent.name]


def test_a_download_cut_short_is_never_used(bucket, tmp_path, monkeypatch):
    store, root = bucket
    store.upload(write_tree(tmp_path / "model", {"a.bin": b"a" * 100, "b.bin": b"b" * 100}), f"{root}/m")
    cache = tmp_path / "cache"
    fs, _ = store.filesystem(root)
    real_get = fs.get_file

    def short_get(rpath, lpath, **kw):
        real_get(rpath, lpath, **kw)
        if rpath.endswith("b.bin"):
            with open(lpath, "r+b") as fh:
                fh.truncate(10)  # the connection dropped: fewer bytes than the listing says

    monkeypatch.setattr(fs, "get_file", short_get)
    with pytest.raises(StorageError, match=r"10 bytes arrived, the listing says 100"):
        store.fetch_tree(f"{root}/m", cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no partial folder left
    monkeypatch.setattr(fs, "get_file", real_get)
    assert (store.fetch_tree(f"{root}/m", cache) / "b.bin").read_bytes() == b"b" * 100


def test_a_missing_backend_names_the_extra(monkeypatch):
    import fsspec

    def refuse(protocol, **kwargs):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "filesystem", refuse)
    with pytest.raises(StorageError, match=r"pip install 'hybridflow\[s3\]'"):
        Storage().filesystem("s3://b/x")
    assert storage_module.StorageError is StorageError


def test_two_processes_sharing_the_cache_download_once(bucket, tmp_path, monkeypatch):
    """Two ranks starting together: the file lock makes one download while the other waits,
    then finds the verified copy. (Threads with their own lock objects: flock is per open file.)"""
    import threading
    import time

    store, root = bucket
    store.upload(write_tree(tmp_path / "model", {"config.json": b"{}", "w.bin": b"w" * 100_000}), f"{root}/m")
    downloads = []
    real = Storage.download

    def slow_download(self, url, dest):
        downloads.append(url)
        time.sleep(1.0)  # a large model: the other rank starts while this one is still downloading
        return real(self, url, dest)

    monkeypatch.setattr(Storage, "download", slow_download)
    results = []
    stores = [store, Storage(endpoint_url=store.endpoint_url)]  # separate filesystems, as two processes
    threads = [threading.Thread(target=lambda s=s: results.append(s.fetch_tree(f"{root}/m", tmp_path / "cache")))
               for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2 and results[0] == results[1] and downloads == [f"{root}/m"]
