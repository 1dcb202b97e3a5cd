"""``hybridflow sft`` end to end on the built-in tiny model: conversations from a parquet file lower
the validation loss; a run killed after a step resumes and reproduces the uninterrupted run's
metrics; the export trains with ``hybridflow train model.path=<export>``; two FSDP2 ranks train
like one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data.tasks.arithmetic import arithmetic_sft_pairs, make_arithmetic_rows
from run_records import cli_in_process, per_step

pytestmark = pytest.mark.slow

# Ranks against one rank, cuts, resumes and servers are compared within 1e-4-1e-6: float32's sums.
# model.dtype=auto would train bf16-mixed on a CPU with bf16 hardware, whose rounding differs by path.
RUN = [
    "warm_start.enable=false", "data.train_batch_size=16", "trainer.total_training_steps=8", "trainer.test_freq=4",
    "trainer.save_freq=3", "actor.optim.lr=3e-3", "actor.optim.lr_scheduler_type=cosine",
    "actor.optim.lr_warmup_steps=2", "trainer.num_threads=1", "trainer.logger=[jsonl]",
    # Token-budget micro-batches, packed: the actor's speed path, not one padded batch.
    "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=256",
    "model.dtype=float32",
]
VOLATILE = ("train/tokens_per_s",)



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-data")
    files = {}
    for split, size in (("train", 256), ("test", 32)):
        pairs = arithmetic_sft_pairs(make_arithmetic_rows(size, 11, split), 0.0)
        conversations = [messages + [{"role": "assistant", "content": answer}] for messages, answer in pairs]
        pq.write_table(pa.table({"messages": conversations}), root / f"{split}.parquet")
        files[split] = root / f"{split}.parquet"
    return [f"data.train_files={files['train']}", f"data.val_files=[{files['test']}]"]


def cli(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """``hybridflow <args>``: a run killed at ``fault``, or one of ranks of their own (``trainer.n_workers``), in a
    process of its own; any other in this one (``cli_in_process``)."""
    if fault is None and not any(arg.startswith("trainer.n_workers=") for arg in args):
        return cli_in_process(list(args), env={"OMP_NUM_THREADS": "1"})
    env = {**os.environ, "HYBRIDFLOW_FAULT": fault or "", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_sft_lowers_val_loss_resumes_exactly_and_its_export_trains(data, tmp_path):
    reference = cli("sft", *data, *RUN, f"trainer.output_dir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = per_step(tmp_path / "ref", VOLATILE)
    assert sorted(expected) == list(range(0, 9))
    before, after = expected[0]["val/loss"], expected[8]["val/loss"]
    assert after < 0.7 * before, (before, after)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens"} <= set(expected[1])

    out = tmp_path / "killed"
    killed = cli("sft", *data, *RUN, f"trainer.output_dir={out}", fault="after_step@5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = cli("sft", *data, *RUN, f"trainer.output_dir={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "global_step_3" in resumed.stderr
    got = per_step(out, VOLATILE)
    assert sorted(got) == sorted(expected)
    for step in expected:
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, abs=1e-6), (step, key)

    export = out / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    trained = cli("train", f"model.path={export}", "trainer.total_training_steps=1", "trainer.val_before_train=false",
                  "trainer.test_freq=-1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
                  "data.builtin_val_size=8", "trainer.save_final=false", "trainer.num_threads=1",
                  "trainer.logger=[jsonl]", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'rl'}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    rl = per_step(tmp_path / "rl", VOLATILE)
    assert 1 in rl and "actor/grad_norm" in rl[1]


def test_two_ranks_train_like_one(data, tmp_path):
    steps = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_final=false", "sft.export=false"]
    one = cli("sft", *data, *RUN, *steps, f"trainer.output_dir={tmp_path / 'one'}")
    two = cli("sft", *data, *RUN, *steps, "trainer.n_workers=2", f"trainer.output_dir={tmp_path / 'two'}")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = per_step(tmp_path / "one", VOLATILE), per_step(tmp_path / "two", VOLATILE)
    for step in (1, 2):
        assert b[step]["train/tokens"] == a[step]["train/tokens"]
        assert b[step]["train/loss"] == pytest.approx(a[step]["train/loss"], abs=1e-5)
        assert b[step]["train/grad_norm"] == pytest.approx(a[step]["train/grad_norm"], rel=1e-4)
    assert b[2]["val/loss"] == pytest.approx(a[2]["val/loss"], abs=1e-4)
