"""Checkpoints in object storage (RemoteCheckpoints) and set-up's checks of every URL in the
config, against moto's S3 server (the ``s3`` fixture, tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.controller.checkpoint import MANIFEST_FILE, CheckpointManager, RemoteCheckpoints
from hybridflow.controller.preflight import check_storage, remote_paths
from hybridflow.utils.storage import Storage, join


def write_actor(d):
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"x" * 100)


@pytest.fixture
def remote(s3):
    store = Storage(endpoint_url=s3.endpoint_url)
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs, _ = store.filesystem(f"s3://{name}")
    fs.mkdir(name)
    return store, f"s3://{name}/run/checkpoints"


def test_saves_upload_manifest_last_prune_and_resume_pulls_the_newest(remote, tmp_path):
    store, url = remote
    local = CheckpointManager(tmp_path / "stage", max_to_keep=2)
    mirror = RemoteCheckpoints(url, store, max_to_keep=2)
    for step in (1, 2, 3):
        mirror.upload(local.save(step, {"step": step}, write_actor))
    assert [s for s, _ in mirror.complete_checkpoints()] == [2, 3]
    assert store.read_text(join(url, "latest")).strip() == "global_step_3"

    # A fresh machine: nothing local; the newest remote checkpoint is downloaded and verified.
    fresh = CheckpointManager(tmp_path / "fresh", max_to_keep=2)
    pulled = mirror.pull_newest(fresh)
    assert pulled == tmp_path / "fresh" / "global_step_3"
    assert fresh.find("auto", None) == pulled and fresh.load_state(pulled) == {"step": 3}
    assert mirror.pull_newest(fresh) is None  # the local copy is as new: nothing downloaded
    assert not list((tmp_path / "fresh").glob(".tmp-*"))


def test_an_upload_cut_short_or_a_damaged_remote_checkpoint_is_skipped(remote, tmp_path, caplog):
    store, url = remote
    local = CheckpointManager(tmp_path / "stage", max_to_keep=None)
    mirror = RemoteCheckpoints(url, store, max_to_keep=None)
    for step in (1, 2, 3):
        mirror.upload(local.save(step, {"step": step}, write_actor))
    # Step 3's upload "died" before its manifest; step 2 was altered in the bucket.
    store.remove(join(url, "global_step_3", MANIFEST_FILE))
    fs, path = store.filesystem(url)
    fs.pipe_file(f"{path}/global_step_2/actor/weights.bin", b"y" * 100)
    assert [s for s, _ in mirror.complete_checkpoints()] == [1, 2]
    fresh = CheckpointManager(tmp_path / "fresh", max_to_keep=None)
    assert mirror.pull_newest(fresh) == tmp_path / "fresh" / "global_step_1"
    assert "skipping remote checkpoint" in caplog.text and "weights.bin is altered" in caplog.text
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["global_step_1"]  # no partial download


def test_set_up_names_the_key_and_url_of_a_missing_bucket_or_credentials(s3, monkeypatch, tmp_path):
    cfg = load_config(None, None, [
        f"storage.endpoint_url={s3.endpoint_url}", "data.train_files=[s3://no-such-bucket-q/train.parquet]",
        "trainer.checkpoint_dir=s3://no-such-bucket-q/ckpt",
    ])
    assert [(k, kind) for k, _, kind in remote_paths(cfg)] == [("data.train_files[0]", "file"),
                                                              ("trainer.checkpoint_dir", "root")]
    store = Storage(endpoint_url=s3.endpoint_url)
    with pytest.raises(ConfigError) as err:
        check_storage(cfg, store)
    assert err.value.key == "data.train_files[0]"
    assert str(err.value).startswith("data.train_files[0]=s3://no-such-bucket-q/train.parquet: ")
    assert "does not exist: create it or fix the URL" in str(err.value)

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match=r"^data.train_files\[0\]=.*no credentials .*AWS_ACCESS_KEY_ID"):
        check_storage(cfg, Storage(endpoint_url=s3.endpoint_url))

    with pytest.raises(ConfigError, match=r"trainer.output_dir=s3://b/out must be a local folder"):
        check_storage(load_config(None, None, ["trainer.output_dir=s3://b/out"]), store)
