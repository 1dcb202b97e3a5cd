"""A run whose data, model, checkpoints and export live in object storage, against moto's S3
server on 127.0.0.1 (the ``s3_server`` fixture, tests/conftest.py): train from s3:// data and an
s3:// model, checkpoint to s3://, resume a second run on an empty output folder from there
(reusing the model's verified download), export to s3://; and the one-line errors of a missing
bucket and missing credentials, before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from hybridflow.utils.storage import Storage

pytestmark = pytest.mark.slow

RUN = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
    "rollout.n=2", "data.max_response_length=4", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2", "trainer.num_threads=1", "trainer.progress_bar=false",
    "trainer.logger=[jsonl]",
]


def train(server, out: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", *RUN, f"trainer.output_dir={out}",
         f"storage.endpoint_url={server.endpoint_url}", *overrides],
        capture_output=True, text=True, timeout=300, env=env or server.env(),
    )


@contextmanager
def aws_test_env(server):
    """This process's AWS environment set to the server's test credentials, restored after."""
    aws = {k: v for k, v in server.env().items() if k.startswith("AWS_")}
    saved = {k: os.environ.get(k) for k in aws}
    os.environ.update(aws)
    try:
        yield Storage(endpoint_url=server.endpoint_url)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def bucket(s3_server, tmp_path_factory):
    """A bucket holding the tiny model and the arithmetic task's parquet files."""
    root = tmp_path_factory.mktemp("storage")
    model = write_tiny_model(root / "model")
    train_file, val_file = write_arithmetic_task(root / "data", train_size=32, val_size=8)
    with aws_test_env(s3_server) as store:
        name = f"e2e-{uuid.uuid4().hex[:10]}"
        fs, _ = store.filesystem(f"s3://{name}")
        fs.mkdir(name)
        store.upload(model, f"s3://{name}/models/tiny")
        fs.put_file(str(train_file), f"{name}/arithmetic/train.parquet")
        fs.put_file(str(val_file), f"{name}/arithmetic/val.parquet")
    return f"s3://{name}", root


def test_train_checkpoint_resume_and_export_through_s3(s3_server, bucket, tmp_path):
    url, _ = bucket
    cache = tmp_path / "model-cache"
    files = [f"model.path={url}/models/tiny", f"data.train_files=[{url}/arithmetic/train.parquet]",
             f"data.val_files=[{url}/arithmetic/val.parquet]", f"storage.cache_dir={cache}",
             f"trainer.checkpoint_dir={url}/run/checkpoints"]
    first = train(s3_server, tmp_path / "first", *files, "trainer.total_training_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "downloading s3://" in first.stderr and "uploaded checkpoint" in first.stderr

    # A second run on a fresh output folder (another machine, say) finds step 2 in the bucket.
    second = train(s3_server, tmp_path / "second", *files, "trainer.total_training_steps=3")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "using the cached copy of" in second.stderr and "downloading s3://" not in second.stderr
    assert f"downloaded checkpoint {url}/run/checkpoints/global_step_2" in second.stderr
    assert "resumed from" in second.stderr and "at step 2" in second.stderr
    steps = [line for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines() if '"step": 3' in line]
    assert steps, "the resumed run did not train step 3"

    export = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "export", f"{url}/run/checkpoints", f"{url}/export/policy",
         "--endpoint-url", s3_server.endpoint_url],
        capture_output=True, text=True, timeout=300, env=s3_server.env(),
    )
    assert export.returncode == 0, export.stderr[-3000:]
    assert export.stdout.strip() == f"{url}/export/policy"
    with aws_test_env(s3_server) as store:
        assert [s for s in store.listdir(f"{url}/run/checkpoints") if s.startswith("global_step_")] == \
            ["global_step_2", "global_step_3"]
        exported = set(store.listing(f"{url}/export/policy"))
    assert {"config.json", "model.safetensors"} <= exported and not any("optim" in f for f in exported)


def test_a_missing_bucket_or_missing_credentials_fail_at_set_up_in_one_line(s3_server, bucket, tmp_path):
    url, root = bucket
    missing = train(s3_server, tmp_path / "a", f"model.path={root / 'model'}",
                    "data.train_files=[s3://no-such-bucket-e2e/train.parquet]")
    assert missing.returncode == 2
    last = missing.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: data.train_files[0]=s3://no-such-bucket-e2e/train.parquet: ")
    assert "does not exist: create it or fix the URL" in last

    env = {k: v for k, v in s3_server.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    no_credentials = train(s3_server, tmp_path / "b", f"model.path={url}/models/tiny", env=env)
    assert no_credentials.returncode == 2
    last = no_credentials.stderr.strip().splitlines()[-1]
    assert last.startswith(f"config error: model.path={url}/models/tiny: ") and "no credentials" in last
    assert "AWS_ACCESS_KEY_ID" in last
    assert not (tmp_path / "b").exists()  # failed before the run folder or any model
