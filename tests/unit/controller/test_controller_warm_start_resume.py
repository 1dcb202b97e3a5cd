"""A killed warm start goes on where it stopped: the next run resumes its SFT from the last saved
progress and ends in the weights an uninterrupted warm start writes, bitwise; scratch that killed
builds left under older names goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.controller import sft
from hybridflow.controller.sft import PROGRESS_FILE, SFTSpec, prepare_builtin_model
from hybridflow.data.tasks.arithmetic import arithmetic_sft_pairs, make_arithmetic_rows
from hybridflow.models.tiny import TinyModelSpec

torch.set_num_threads(1)

# 60 steps: progress is saved at step 50 (sft.PROGRESS_EVERY); the kill lands at 55.
SPEC = SFTSpec(steps=60, batch_size=8, lr=3e-3, seed=0)
SMALL = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
BUILD = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    sys.path.insert(0, str(Path(sys.argv[2])))
    torch.set_num_threads(1)
    from test_controller_warm_start_resume import build
    build(Path(sys.argv[1]))
""")


def build(cache: Path) -> Path:
    pairs = arithmetic_sft_pairs(make_arithmetic_rows(64, 0, "train"), 0.0)
    return prepare_builtin_model(cache, pairs=pairs, pairs_key="resume-test", spec=SPEC, device=torch.device("cpu"),
                                 model_spec=SMALL)


def killed_build(cache: Path, at_step: int) -> None:
    env = {**os.environ, "HYBRIDFLOW_FAULT": f"warm_start_step@{at_step}"}
    done = subprocess.run([sys.executable, "-c", BUILD, str(cache), str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights of the warm start run without interruption."""
    return weights(build(tmp_path_factory.mktemp("uninterrupted")))


def test_a_killed_warm_start_resumes_and_ends_in_the_uninterrupted_weights(tmp_path, caplog, reference):
    assert sft.PROGRESS_EVERY == 50
    cache = tmp_path / "killed"
    killed_build(cache, at_step=55)
    (scratch,) = cache.glob(".tmp-builtin-tiny-*")
    assert (scratch / "sft.progress" / PROGRESS_FILE).is_file()  # the progress of step 50
    with caplog.at_level("INFO"):
        resumed = build(cache)
    assert "goes on at step 51 of 60" in caplog.text
    got = weights(resumed)
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[name], reference[name]) for name in reference)
    assert not list(cache.glob(".tmp-*"))  # the scratch went with the finished build


def test_unusable_progress_starts_the_warm_start_over_and_older_scratch_goes(tmp_path, caplog, reference):
    cache = tmp_path / "damaged"
    killed_build(cache, at_step=55)
    (scratch,) = cache.glob(".tmp-builtin-tiny-*")
    (scratch / "sft.progress" / PROGRESS_FILE).write_bytes(b"not a torch file")
    older = cache / f"{scratch.name}-12345"  # a killed build from before the scratch kept its name
    (older / "init").mkdir(parents=True)
    with caplog.at_level("INFO"):
        again = build(cache)
    assert "cannot be used" in caplog.text and "starting it over" in caplog.text
    assert all(torch.equal(t, reference[name]) for name, t in weights(again).items())
    assert not older.exists() and not list(cache.glob(".tmp-*"))
