"""verl's rollout-correction examples as one tiny GRPO/RLOO step each: batch-normalised sequence
importance weights (run_with_rollout_corr.sh) and chained rejection criteria
(run_with_rollout_corr_multi_rs.sh), in bypass mode as verl runs them and with the trainer's
old-logprob forward (decoupled)."""

import math

import pytest

from hybridflow import api
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model

pytestmark = pytest.mark.slow

RC = "algorithm.rollout_correction"
SMALL = [
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4",
    "data.max_response_length=4", "trainer.total_training_steps=1", "trainer.num_threads=1",
    "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
    "trainer.save_final=false", "trainer.test_freq=0", "actor.optim.lr=1e-6",
]
# verl's examples/rollout_correction/*.sh, their rollout_correction lines.
SELF_NORMALISED = ["algorithm.adv_estimator=rloo", f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=2.0",
                   f"{RC}.rollout_is_batch_normalize=true", f"{RC}.rollout_rs=null", f"{RC}.rollout_rs_threshold=null",
                   f"{RC}.loss_type=reinforce"]
MULTI_RS = [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0", f"{RC}.rollout_is_batch_normalize=false",
            f"{RC}.rollout_rs='token_k1,seq_max_k2'", f"{RC}.rollout_rs_threshold='0.6_1.6,2.5'",
            f"{RC}.loss_type=ppo_clip"]
NORM = "rollout_corr/rollout_is_batch_norm_factor"
RS = ["rollout_corr/rollout_rs_token_k1_mean", "rollout_corr/rollout_rs_seq_max_k2_mean",
      "rollout_corr/rollout_rs_masked_fraction"]


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rc")
    train, _ = write_arithmetic_task(root / "data", train_size=16, val_size=4)
    return write_tiny_model(root / "model"), train


@pytest.mark.parametrize(("lines", "bypass", "expected"), [
    (SELF_NORMALISED, True, [NORM]),
    (MULTI_RS, True, RS),
    # Decoupled: the old-logprob forward runs (two updates per batch) and the actor normalises and
    # rejects over the whole batch before the update.
    ([*SELF_NORMALISED[1:4], *MULTI_RS[3:5]], False, [NORM, *RS]),
], ids=["batch_normalize-bypass", "multi_rs-bypass", "both-decoupled"])
def test_verls_rollout_correction_examples_train_a_step(model_and_data, tmp_path, lines, bypass, expected):
    model_dir, train = model_and_data
    cfg = api.make_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"trainer.output_dir={tmp_path / 'run'}",
        *SMALL, *lines, f"{RC}.bypass_mode={str(bypass).lower()}",
    ])
    metrics = api.train(cfg).final_metrics
    assert metrics["training/global_step"] == 1
    assert ("timing_s/old_log_prob" in metrics) is not bypass
    for key in ("actor/pg_loss", "actor/grad_norm", *expected):
        assert key in metrics and math.isfinite(metrics[key]), (key, metrics.get(key))
    if NORM in expected:
        assert metrics[NORM] > 0
