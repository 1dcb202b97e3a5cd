"""Semantic validation: batch arithmetic with its numbers, ranges, warnings, paths; speed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hybridflow.config import (
    Config,
    ConfigError,
    batch_plan,
    compute_batch_plan,
    load_config,
    validate_config,
)


def errors_for(*overrides: str) -> str:
    cfg = load_config(overrides=list(overrides))
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    return str(info.value)


def warnings_for(*overrides: str) -> list[str]:
    return validate_config(load_config(overrides=list(overrides)))


def test_defaults_are_valid_without_warnings() -> None:
    assert validate_config(Config()) == []


# --------------------------------------------------------------------------------------------
# Batch arithmetic: every error states its numbers


def test_train_batch_not_multiple_of_mini_batch() -> None:
    message = errors_for(
        "data.train_batch_size=32", "actor.ppo_mini_batch_size=12", "actor.ppo_micro_batch_size_per_gpu=8"
    )
    assert (
        "data.train_batch_size=32 prompts is not a multiple of actor.ppo_mini_batch_size=12 prompts: "
        "each step would leave 8 prompts untrained" in message
    )
    assert "divides 32 (e.g. 4, 8 or 16)" in message
    assert "multiple of 12 (e.g. 24 or 36)" in message


def test_mini_batch_larger_than_train_batch() -> None:
    message = errors_for("data.train_batch_size=16", "actor.ppo_mini_batch_size=64")
    assert "actor.ppo_mini_batch_size=64 prompts is larger than data.train_batch_size=16 prompts" in message
    assert "<= 16" in message


def test_mini_batch_samples_not_divisible_by_dp() -> None:
    message = errors_for(
        "data.train_batch_size=6",
        "actor.ppo_mini_batch_size=3",
        "rollout.n=1",
        "actor.ppo_micro_batch_size_per_gpu=1",
        "trainer.n_gpus_per_node=2",
    )
    assert "actor.ppo_mini_batch_size=3 prompts x rollout.n=1 = 3 samples" in message
    assert "dp=2 data-parallel ranks (trainer.n_gpus_per_node=2 x trainer.nnodes=1)" in message


def test_step_samples_not_divisible_by_dp() -> None:
    # The mini-batch splits over 4 ranks (4 x 1 samples) but the step (6 x 1) does not; the step
    # is also not a multiple of the mini-batch, which is reported alongside.
    message = errors_for(
        "data.train_batch_size=6",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=1",
        "actor.ppo_micro_batch_size_per_gpu=1",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=2",
    )
    assert "data.train_batch_size=6 prompts x rollout.n=1 = 6 samples cannot be split evenly" in message
    assert "dp=4" in message
    assert "trainer.nnodes=2" in message


def test_micro_batch_larger_than_rank_share() -> None:
    message = errors_for(
        "actor.ppo_mini_batch_size=4", "data.train_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=64",
        "actor.use_dynamic_bsz=false",
    )
    assert "actor.ppo_micro_batch_size_per_gpu=64 samples is larger than the 32 samples each rank gets" in message
    assert "ppo_mini_batch_size=4 prompts x rollout.n=8 / dp=1" in message
    assert "0 gradient-accumulation steps" in message


def test_micro_batch_larger_than_rank_share_with_dp() -> None:
    message = errors_for("actor.ppo_micro_batch_size_per_gpu=256", "trainer.n_gpus_per_node=2", "actor.use_dynamic_bsz=false")
    # 32 prompts x 8 samples / 2 ranks = 128 per rank.
    assert "ppo_micro_batch_size_per_gpu=256 samples is larger than the 128 samples" in message
    assert "/ dp=2" in message


def test_rank_share_not_multiple_of_micro_batch() -> None:
    message = errors_for("actor.ppo_micro_batch_size_per_gpu=48", "actor.use_dynamic_bsz=false")
    assert "each rank gets 256 samples per optimizer step" in message
    assert "not a multiple of actor.ppo_micro_batch_size_per_gpu=48" in message
    assert "the last micro-batch would hold 16 samples" in message
    assert "divides 256, e.g. 16, 32 or 64" in message


def test_builtin_split_smaller_than_train_batch() -> None:
    message = errors_for("data.builtin_train_size=16")
    assert "data.builtin_train_size=16 prompts is smaller than data.train_batch_size=32" in message


def test_all_errors_are_reported_together() -> None:
    message = errors_for("data.train_batch_size=0", "rollout.top_p=0", "actor.clip_ratio_c=1")
    assert message.startswith("3 config errors:")
    assert "data.train_batch_size=0 must be >= 1" in message
    assert "rollout.top_p=0.0" in message
    assert "actor.clip_ratio_c=1.0 must be > 1" in message


def test_batch_plan_numbers() -> None:
    plan = compute_batch_plan(
        train_batch_size=64,
        ppo_mini_batch_size=16,
        rollout_n=4,
        ppo_epochs=2,
        ppo_micro_batch_size_per_gpu=8,
        dp=2,
    )
    assert plan.samples_per_step == 256
    assert plan.samples_per_rank_per_step == 128
    assert plan.mini_batches_per_epoch == 4
    assert plan.optimizer_steps_per_step == 8
    assert plan.samples_per_mini_batch == 64
    assert plan.samples_per_rank_per_mini_batch == 32
    assert plan.grad_accum_steps == 4


def test_batch_plan_of_defaults() -> None:
    plan = batch_plan(Config())
    assert (plan.dp, plan.samples_per_step, plan.optimizer_steps_per_step, plan.grad_accum_steps) == (1, 256, 1, 4)


# --------------------------------------------------------------------------------------------
# Ranges and names


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.train_batch_size=-1", "data.train_batch_size=-1 must be >= 1"),
        ("actor.ppo_mini_batch_size=0", "actor.ppo_mini_batch_size=0 must be >= 1"),
        ("actor.ppo_micro_batch_size_per_gpu=0", "actor.ppo_micro_batch_size_per_gpu=0 must be >= 1"),
        ("actor.ppo_epochs=0", "actor.ppo_epochs=0 must be >= 1"),
        ("rollout.n=0", "rollout.n=0 must be >= 1"),
        ("trainer.total_epochs=0", "trainer.total_epochs=0 must be >= 1"),
        ("data.max_prompt_length=0", "data.max_prompt_length=0 must be >= 1"),
        ("data.max_response_length=-8", "data.max_response_length=-8 must be >= 1"),
        ("trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node=0 must be >= 1"),
        ("trainer.total_training_steps=0", "trainer.total_training_steps=0 must be >= 1 or null"),
        ("actor.clip_ratio=0", "actor.clip_ratio=0.0 must be > 0"),
        ("actor.clip_ratio_low=-0.1", "actor.clip_ratio_low=-0.1 must be > 0 or null"),
        ("actor.clip_ratio_high=0", "actor.clip_ratio_high=0.0 must be > 0 or null"),
        ("actor.clip_ratio=1.5", "the lower clip range is 1.5"),
        ("actor.clip_ratio_c=0.5", "actor.clip_ratio_c=0.5 must be > 1"),
        ("rollout.temperature=-1", "rollout.temperature=-1.0 must be >= 0"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5 must be in (0, 1]"),
        ("rollout.top_k=0", "rollout.top_k=0 must be -1 (off) or >= 1"),
        ("rollout.val_kwargs.top_p=0", "rollout.val_kwargs.top_p=0.0 must be in (0, 1]"),
        ("actor.optim.lr=0", "actor.optim.lr=0.0 must be > 0"),
        ("actor.optim.betas=[0.9]", "actor.optim.betas=[0.9] must be two numbers"),
        ("algorithm.gamma=1.5", "algorithm.gamma=1.5 must be in [0, 1]"),
        ("actor.loss_scale_factor=0", "actor.loss_scale_factor=0.0 must be > 0 or null"),
        ("trainer.max_ckpt_to_keep=0", "trainer.max_ckpt_to_keep=0 must be >= 1 or null"),
        ("rollout.tensor_model_parallel_size=0", "rollout.tensor_model_parallel_size=0 must be >= 1"),
        ("rollout.tensor_model_parallel_size=2048", "over the limit of 1024 ranks per rollout replica"),
        ("trainer.num_threads=0", "trainer.num_threads=0 must be from 1 to 4096 torch threads, null or 'follow'"),
        ("trainer.num_threads=40960", "trainer.num_threads=40960 must be from 1 to 4096"),
        ("trainer.num_threads=folow", "trainer.num_threads='folow' must be null, 'follow' or a whole number"),
    ],
)
def test_range_errors(override: str, expected: str) -> None:
    assert expected in errors_for(override)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actor.loss_agg_mode=token_mean", "did you mean 'token-mean'?"),
        ("actor.loss_agg_mode=mean", "is not one of: token-mean, token-sum, seq-mean-token-sum"),
        ("actor.kl_loss_type=k4", "actor.kl_loss_type='k4' is not one of"),
        ("algorithm.kl_penalty=lowvar_kl", "did you mean 'low_var_kl'?"),
        ("trainer.logger=[console, wandbb]", "trainer.logger[1]='wandbb' is not one of"),
    ],
)
def test_name_errors(override: str, expected: str) -> None:
    assert expected in errors_for(override)


@pytest.mark.parametrize("threads", ["trainer.num_threads=follow", "trainer.num_threads=3", "trainer.num_threads=null"])
def test_thread_settings_are_accepted(threads: str) -> None:
    assert warnings_for(threads) == []


@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_every_loss_agg_mode_is_accepted(mode: str) -> None:
    assert warnings_for(f"actor.loss_agg_mode={mode}") == []


@pytest.mark.parametrize("name", ["k1", "k3+", "mse", "low_var_kl+", "abs"])
def test_kl_estimators_are_accepted(name: str) -> None:
    assert warnings_for(f"actor.kl_loss_type={name}", f"algorithm.kl_penalty={name}") == []


# --------------------------------------------------------------------------------------------
# Algorithm and trainer rules


def test_rloo_with_one_sample_is_an_error() -> None:
    message = errors_for("algorithm.adv_estimator=rloo", "rollout.n=1", "actor.ppo_micro_batch_size_per_gpu=32")
    assert "rollout.n=1 with algorithm.adv_estimator=rloo" in message


def test_grpo_with_one_sample_is_a_warning() -> None:
    warnings = warnings_for("rollout.n=1", "actor.ppo_micro_batch_size_per_gpu=32")
    assert any("rollout.n=1 with algorithm.adv_estimator=grpo" in w and "reward / (1 + 1e-6)" in w for w in warnings)


@pytest.mark.parametrize("temperature", ["0", "1e-45", "0.009"])
def test_training_refuses_a_temperature_whose_logprobs_are_undefined(temperature: str) -> None:
    # At 0 (greedy) the trainer's logprobs of logits / T are undefined and every loss was NaN.
    message = errors_for(f"rollout.temperature={temperature}")
    assert f"rollout.temperature={float(temperature)} must be >= 0.01 for training" in message
    assert "rollout.val_kwargs.temperature=0" in message  # where greedy decoding belongs


def test_validation_may_decode_greedily_but_not_at_an_overflowing_temperature() -> None:
    assert warnings_for("rollout.val_kwargs.temperature=0") == []
    assert "must be 0 (greedy) or >= 0.01" in errors_for("rollout.val_kwargs.temperature=1e-45")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.n=100000000"], "rollout.n=100000000 is over the limit of 4096 samples per prompt"),
        (["data.max_response_length=100000000"], "data.max_response_length=100000000 is over the limit"),
        (["reward.num_workers=100000"], "reward.num_workers=100000 is over the limit of 256"),
        (["data.train_batch_size=4096", "rollout.n=4096", "data.builtin_train_size=8192"],
         "4096 x rollout.n=4096 = 16777216 samples per step is over the limit"),
    ],
)
def test_sizes_are_bounded(overrides: list[str], expected: str) -> None:
    assert expected in errors_for(*overrides)


def test_a_programmatic_config_with_a_non_finite_float_is_refused() -> None:
    cfg = load_config()
    cfg.actor.optim.lr = float("nan")  # the loader refuses .nan; an API caller can still set it
    with pytest.raises(ConfigError, match="actor.optim.lr=nan must be a finite number"):
        validate_config(cfg)


def test_both_kl_terms_warn() -> None:
    warnings = warnings_for("actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true")
    assert any("penalised twice" in w for w in warnings)


def test_settings_without_effect_warn() -> None:
    warnings = warnings_for(
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.adv_estimator=rloo",
        "algorithm.norm_adv_by_std_in_grpo=false",
        "actor.loss_scale_factor=8",
        "trainer.resume_from_path=/ckpt",
        "trainer.save_final=false",
    )
    joined = "\n".join(warnings)
    assert "algorithm.kl_ctrl.type=adaptive has no effect" in joined
    assert "norm_adv_by_std_in_grpo=false has no effect with algorithm.adv_estimator=rloo" in joined
    assert "actor.loss_scale_factor=8.0 has no effect" in joined
    assert "trainer.resume_from_path is set but trainer.resume_mode=auto" in joined
    assert "writes no checkpoint" in joined


def test_resume_mode_path_needs_a_path() -> None:
    message = errors_for("trainer.resume_mode=path")
    assert "trainer.resume_mode=path needs trainer.resume_from_path" in message


def test_resume_mode_path_needs_an_existing_folder(tmp_path: Path) -> None:
    message = errors_for("trainer.resume_mode=path", f"trainer.resume_from_path={tmp_path / 'missing'}")
    assert "trainer.resume_from_path=" in message
    assert "is not an existing directory" in message
    validate_config(load_config(overrides=["trainer.resume_mode=path", f"trainer.resume_from_path={tmp_path}"]))


# --------------------------------------------------------------------------------------------
# Paths the run will open


def test_missing_model_and_data_files(tmp_path: Path) -> None:
    message = errors_for(f"model.path={tmp_path / 'no-model'}", f"data.train_files=[{tmp_path / 'train.parquet'}]")
    assert "model.path=" in message and "is not an existing directory" in message
    assert "data.train_files[0]=" in message and "does not exist" in message


def test_existing_model_and_data_files_pass(tmp_path: Path) -> None:
    (tmp_path / "train.parquet").write_bytes(b"")
    (tmp_path / "reward.py").write_text("def compute_score(*a): return 0.0\n")
    warnings = warnings_for(
        f"model.path={tmp_path}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
        "actor.optim.lr=1e-6",
    )
    assert warnings == []


def test_tiny_model_learning_rate_on_a_real_model_warns(tmp_path: Path) -> None:
    warnings = warnings_for(f"model.path={tmp_path}")
    assert any(w.startswith("actor.optim.lr=0.0003 is tuned for the built-in tiny model") for w in warnings)


def test_missing_custom_reward_file(tmp_path: Path) -> None:
    message = errors_for(f"reward.custom_reward_function.path={tmp_path / 'reward.py'}")
    assert "reward.custom_reward_function.path=" in message


# --------------------------------------------------------------------------------------------
# Config fuzzing (reliability.md #11): each mutation fails fast with the dotted key


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["actor.optim.lrr=1e-5"], "actor.optim.lrr"),
        (["data.train_batch_size=0"], "data.train_batch_size"),
        (["actor.ppo_micro_batch_size_per_gpu=512", "actor.use_dynamic_bsz=false"], "actor.ppo_micro_batch_size_per_gpu"),
        (["data.shuffle=maybe"], "data.shuffle"),
        (
            ["rollout.n=3", "trainer.n_gpus_per_node=2", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"],
            "rollout.n",
        ),
    ],
)
def test_mutated_config_fails_fast_with_key(overrides: list[str], key: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(overrides=overrides))
    assert time.perf_counter() - start < 5.0
    assert key in str(info.value)


def test_validation_is_fast() -> None:
    cfg = Config()
    start = time.perf_counter()
    for _ in range(100):
        validate_config(cfg)
    assert (time.perf_counter() - start) / 100 < 0.05


# --------------------------------------------------------------------------------------------
# DAPO dynamic sampling, overlong shaping and rollout correction


def test_dapo_and_rollout_correction_keys_are_checked() -> None:
    assert "max_num_gen_batches=-1 must be >= 0" in errors_for(
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=-1"
    )
    assert "reward.overlong_buffer.len=9 must be in [1, data.max_response_length=8]" in errors_for(
        "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=9"
    )
    assert "rollout_rs_threshold_lower (3) <= rollout_rs_threshold (2)" in errors_for(
        "algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold_lower=3"
    )
    assert any("data.gen_batch_size=16 has no effect" in w for w in warnings_for("data.gen_batch_size=16"))
    assert any("nothing is filtered" in w for w in warnings_for("algorithm.filter_groups.enable=true", "rollout.n=1",
                                                                "actor.ppo_micro_batch_size_per_gpu=32"))


def test_a_lower_clip_range_of_one_is_only_allowed_for_cispo() -> None:
    assert "clips nothing" in errors_for("actor.clip_ratio_low=1.0")
    assert validate_config(load_config(overrides=["actor.clip_ratio_low=1.0", "actor.policy_loss.loss_mode=cispo"])) == []


def test_rollout_correction_level_must_be_a_known_choice() -> None:
    with pytest.raises(ConfigError, match="allowed values: token, sequence"):
        load_config(overrides=["algorithm.rollout_correction.rollout_is=tokens"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.adv_estimator=gdpo"], "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys"),
        (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,len]", "algorithm.gdpo_reward_weights=[1]"],
         "gdpo_reward_weights has 1 entries for 2"),
        (["actor.policy_loss.loss_mode=dro"], "needs actor.policy_loss.dro_beta > 0, got None"),
        (["actor.policy_loss.loss_mode=bypass_mode"], "set that instead"),
        (["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss.loss_mode=gspo"],
         "replaces the policy loss by bypass_mode"),
    ],
)
def test_verl_estimator_and_loss_settings_are_checked(overrides: list[str], message: str) -> None:
    assert message in errors_for(*overrides)


def test_verl_estimator_and_loss_settings_that_fit_are_accepted() -> None:
    assert warnings_for("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]") == []
    assert warnings_for("actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1") == []
    assert warnings_for("algorithm.rollout_correction.bypass_mode=true",
                        "algorithm.rollout_correction.loss_type=reinforce") == []


def test_greedy_validation_warns_that_its_sampling_settings_are_unused() -> None:
    (warning,) = warnings_for("rollout.val_kwargs.temperature=1.0")
    assert "do_sample" in warning
    assert warnings_for("rollout.val_kwargs.temperature=1.0", "rollout.val_kwargs.do_sample=true") == []


def test_ulysses_sequence_parallel_size_must_divide_the_ranks_and_needs_packing() -> None:
    message = errors_for("trainer.backend=ray", "trainer.n_workers=4", "actor.ulysses_sequence_parallel_size=3",
                         "critic.ulysses_sequence_parallel_size=0")
    assert "actor.ulysses_sequence_parallel_size=3 must divide the 4 ranks (trainer.n_workers=4)" in message
    # The reference follows the actor unless set.
    assert "ref.ulysses_sequence_parallel_size=3 must divide the 4 ranks" in message
    assert "critic.ulysses_sequence_parallel_size=0 must be >= 1" in message
    message = errors_for("trainer.backend=ray", "trainer.n_workers=4", "actor.ulysses_sequence_parallel_size=2",
                         "ref.ulysses_sequence_parallel_size=1", "actor.use_remove_padding=false")
    assert "actor.ulysses_sequence_parallel_size=2 splits packed sequences; it needs actor.use_remove_padding=true" \
        in message
    assert "ref.ulysses_sequence_parallel_size" not in message
    validate_config(load_config(overrides=["trainer.backend=ray", "trainer.n_workers=4",
                                           "actor.ulysses_sequence_parallel_size=2",
                                           "critic.ulysses_sequence_parallel_size=4"]))


def test_ulysses_sequence_parallel_size_must_split_the_model_heads() -> None:
    # The built-in model has 4 attention heads and 2 key-value heads.
    message = errors_for("trainer.backend=ray", "trainer.n_workers=8", "actor.ulysses_sequence_parallel_size=8")
    assert "actor.ulysses_sequence_parallel_size=8 must divide the 4 attention heads of builtin:tiny" in message
    validate_config(load_config(overrides=["trainer.backend=ray", "trainer.n_workers=4",
                                           "actor.ulysses_sequence_parallel_size=4"]))  # 2 KV heads, repeated


def test_the_by_reference_data_plane_refuses_what_reads_tokens_in_the_controller() -> None:
    refs = ("trainer.data_plane=refs",)
    for mode in ("sync", "one_step_off", "fully_async"):
        validate_config(load_config(overrides=[*refs, f"trainer.mode={mode}"]))  # every loop
    assert "with reward_model.enable=true" in errors_for(*refs, "reward_model.enable=true",
                                                         "reward_model.model.path=/rm")


def test_the_by_reference_data_plane_refuses_an_estimator_input_made_from_tokens() -> None:
    from hybridflow.controller.preflight import resolve_plugins

    with pytest.raises(ConfigError, match="rollout_is_weights, made in the controller from the samples' tokens") as error:
        resolve_plugins(load_config(overrides=["algorithm.adv_estimator=optimal_token_baseline", "trainer.mode=fully_async",
                                               "trainer.data_plane=refs"]))
    assert error.value.key == "trainer.data_plane"


def test_fsdp_size_at_least_the_ranks_shards_over_all_of_them() -> None:
    """verl's create_device_mesh shards over every rank when fsdp_size >= the ranks (its 64-GPU
    example's fsdp_size=32, run on 8); a smaller size must divide them."""
    warnings_for("trainer.backend=ray", "trainer.n_workers=4", "actor.fsdp_config.fsdp_size=32")  # valid
    warnings_for("trainer.backend=ray", "trainer.n_workers=4", "actor.fsdp_config.fsdp_size=2")
    assert "actor.fsdp_config.fsdp_size=3 must divide the 4 data-parallel ranks" in errors_for(
        "trainer.backend=ray", "trainer.n_workers=4", "actor.fsdp_config.fsdp_size=3")


# --------------------------------------------------------------------------------------------
# Online DPO (actor.loss=dpo)


def test_online_dpo_needs_two_samples_and_valid_loss_settings() -> None:
    message = errors_for("actor.loss=dpo", "rollout.n=1", "algorithm.online_dpo.beta=0",
                         "algorithm.online_dpo.label_smoothing=0.5", "algorithm.online_dpo.margin=-1")
    assert "actor.loss=dpo needs rollout.n >= 2" in message
    assert "algorithm.online_dpo.beta=0" in message and "must be > 0" in message
    assert "algorithm.online_dpo.label_smoothing=0.5 must be in [0, 0.5)" in message
    assert "algorithm.online_dpo.margin=-1" in message


@pytest.mark.parametrize("override, named", [
    ("algorithm.adv_estimator=gae", "algorithm.adv_estimator=gae"),
    ("algorithm.use_kl_in_reward=true", "algorithm.use_kl_in_reward=true"),
    ("actor.use_kl_loss=true", "actor.use_kl_loss=true"),
    ("trainer.data_plane=refs", "trainer.data_plane=refs"),
    ("distillation.enable=true", "distillation.enable=true"),
    ("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction"),
])
def test_online_dpo_refuses_the_policy_gradient_keys_it_cannot_honour(override: str, named: str) -> None:
    assert f"actor.loss=dpo cannot run with {named}" in errors_for("actor.loss=dpo", override)


def test_online_dpo_keys_without_actor_loss_dpo_warn_and_the_preset_is_valid() -> None:
    assert any("algorithm.online_dpo.* is set but has no effect" in w
               for w in warnings_for("algorithm.online_dpo.beta=0.5"))
    assert warnings_for("actor.loss=dpo") == []
    with pytest.raises(ConfigError, match="actor.loss"):
        load_config(overrides=["actor.loss=sgd"])
