"""The offline trainers on ``trainer.backend=ray``: ``hybridflow dpo`` and ``hybridflow rm`` on two Ray ranks
(FSDP2 over gloo) give step one's metrics of one local rank; a Ray dpo run whose ranks die is stopped
naming them, resumes from its checkpoint on Ray and ends where the local run does, and its export loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.cluster.ray_group import LOOPBACK_ONLY_ENV
from hybridflow.config import WarmStartConfig
from run_records import cli_in_process, per_step

# Ray decides at import whether a local head binds 127.0.0.1 only; ask before importing it.
os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

# The built-in pairs (DPO's and the reward model's prompts alike), token-budget micro-batches cut by pairs
# (packed), no validation: step one's figures. Ranks against one rank and resumes are compared within
# 1e-4-1e-6: float32's sums (model.dtype=auto trains bf16-mixed on a CPU with bf16 hardware, whose
# rounding differs by path).
# Every run reads the built-in model's warm start and the pairs sampled from it from one cache: the one of the user
# running the tests (warm_start.cache_dir's default), which the in-process runs use. A run on the shared cluster has
# that cluster's HOME (tests/e2e/ray_cluster.py), whose default cache is empty: there it warm-started the built-in
# model again (500 SFT steps, 160 of the DPO test's 180 CPU-seconds), to the same weights.
USER_CACHE = Path(WarmStartConfig().cache_dir).expanduser()
RUN = [
    f"warm_start.cache_dir={USER_CACHE}", "dpo.builtin_prompts=128", "rm.builtin_prompts=128",
    "dpo.builtin_val_prompts=32", "data.train_batch_size=16",
    "trainer.num_threads=1", "trainer.logger=[jsonl]", "actor.use_dynamic_bsz=true",
    "actor.ppo_max_token_len_per_gpu=256", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "model.dtype=float32",
]
RAY = ["trainer.backend=ray", "trainer.n_workers=2"]
VOLATILE = ("train/pairs_per_s",)


def cli(*args: str, ray_head, fault: str = "", by_env: bool = False) -> subprocess.CompletedProcess:
    """A CLI run on the shared cluster (tests/e2e/conftest.py ``ray_head``), named by ``trainer.ray_address``
    or, ``by_env``, by ``RAY_ADDRESS`` alone. A ``fault`` reaches the ranks in the job's runtime environment
    (``hybridflow.cluster.ray_group.init_ray``), as on a cluster the run starts itself."""
    env = {**ray_head.env, "OMP_NUM_THREADS": "1", "HYBRIDFLOW_FAULT": fault}
    if by_env:
        env["RAY_ADDRESS"] = ray_head.address
    else:
        args = (*args, f"trainer.ray_address={ray_head.address}")
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_dpo_on_two_ray_ranks_trains_like_one_local_rank_and_a_run_whose_ranks_died_resumes(
    tmp_path: Path, ray_head
) -> None:
    steps = ["dpo.sft_weight=1.0", "trainer.total_training_steps=4", "trainer.save_freq=2"]
    local = cli_in_process(["dpo", *RUN, *steps, "trainer.save_final=false", "dpo.export=false",
                            f"trainer.output_dir={tmp_path / 'local'}"])
    assert local.returncode == 0, local.stderr[-3000:]
    expected = per_step(tmp_path / "local", VOLATILE)

    # Every rank dies after step 3 (SIGKILL), its newest checkpoint step 2's: the controller names a dead rank
    # and stops, not hangs. (On the shared cluster: the ranks read the fault from the job's runtime environment.)
    out = tmp_path / "ray"
    killed = cli("dpo", *RUN, *steps, *RAY, f"trainer.output_dir={out}", fault="after_step@3", ray_head=ray_head)
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert "dpo rank" in killed.stderr and "died in RankRun.run" in killed.stderr, killed.stderr[-3000:]
    placement = json.loads((out / "placement.json").read_text())
    assert [r["rank"] for r in placement["dpo"]] == [0, 1]
    assert sorted(p.name for p in (out / "checkpoints" / "global_step_2" / "actor" / "dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # each Ray rank wrote its shard

    # Resumed on Ray from step 2 (sharded checkpoint, sampler), it ends with the export the local backend makes.
    resumed = cli("dpo", *RUN, *steps, *RAY, f"trainer.output_dir={out}", ray_head=ray_head)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "global_step_2" in resumed.stderr
    got = per_step(out, VOLATILE)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        for key in ("train/loss", "rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected",
                    "rewards/accuracies"):
            assert got[step][key] == pytest.approx(expected[step][key], abs=1e-5), (step, key)
        assert got[step]["train/grad_norm"] == pytest.approx(expected[step]["train/grad_norm"], rel=1e-4)
    assert (out / "export" / "model.safetensors").is_file()


def test_rm_on_two_ray_ranks_trains_like_one_local_rank(tmp_path: Path, ray_head) -> None:
    steps = ["trainer.total_training_steps=1", "trainer.save_final=false", "rm.export=false"]
    one = cli_in_process(["rm", *RUN, *steps, f"trainer.output_dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    # This run finds the cluster the way `ray job submit` hands it to a driver: RAY_ADDRESS only.
    two = cli("rm", *RUN, *steps, *RAY, f"trainer.output_dir={tmp_path / 'two'}", ray_head=ray_head, by_env=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert f"joining the Ray cluster at {ray_head.address}" in two.stderr, two.stderr[-3000:]
    a, b = per_step(tmp_path / "one", VOLATILE)[1], per_step(tmp_path / "two", VOLATILE)[1]
    for key in ("train/loss", "rm/margin", "rm/chosen", "rm/rejected", "rm/accuracy"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
