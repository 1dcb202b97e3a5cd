"""End-to-end runs of the real pipeline on the CPU with a tiny model: the CLI a user types,
files written by the preprocessing path, a local HF model directory, metrics, plot, checkpoint
and resume."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow import api
from hybridflow.config import list_presets
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.tiny import write_tiny_model
from run_records import cli_in_process

pytestmark = pytest.mark.slow

SMALL = [
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "rollout.n=4",
    "data.max_response_length=4",
    "trainer.total_training_steps=3",
    "trainer.test_freq=2",
    "trainer.num_threads=1",
    "trainer.progress_bar=false",
    # These runs check fp32 rollout against the fp32 trainer (1e-4): on a CPU with bf16 hardware
    # rollout.dtype=auto may measure its way to bf16 (hybridflow.inference.precision), and
    # model.dtype=auto trains bf16-mixed (hybridflow.utils.device.rule_train_dtype).
    "rollout.dtype=float32", "model.dtype=float32",
]


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    model_dir = write_tiny_model(root / "model")
    train, val = write_arithmetic_task(root / "data", train_size=64, val_size=16)
    return model_dir, train, val


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_trains_a_local_model_on_parquet_files_and_resumes(model_and_data, tmp_path):
    model_dir, train, val = model_and_data
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", f"model.path={model_dir}",
           f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"trainer.output_dir={out}", *SMALL]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "val/score/mean" in records[0] and "val/hybridflow/arithmetic/score/mean" in records[0]
    step = records[1]
    for key in ("timing_s/gen", "timing_s/reward", "timing_s/adv", "timing_s/update_actor",
                "timing_s/update_weights", "timing_s/step", "timing_s/old_log_prob",
                "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "actor/lr", "critic/score/mean", "critic/score/max", "critic/score/min",
                "critic/advantages/mean", "response_length/mean", "response_length/max",
                "response_length/min", "response_length/clip_ratio", "prompt_length/mean", "perf/throughput"):
        assert key in step, key
    assert "val/score/mean" in records[2] and "val/score/mean" in records[3]  # test_freq=2 and the last step
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "global_step_3" / "actor" / "model" / "model.safetensors").is_file()
    assert (out / "config.yaml").is_file()
    trace = (out / "timeline.json").read_text()
    spans = [e for e in json.loads(trace)["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans].count("step") == 3 and {"gen", "update_actor", "testing", "serve"} <= {
        e["name"] for e in spans}
    # Starting the finished run again does nothing and says so (the same command, in this process: cli_in_process).
    again = cli_in_process(cmd[3:])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished" in again.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert (out / "timeline.json").read_text() == trace  # nothing ran, the trace stays


def test_resume_continues_from_the_latest_checkpoint(model_and_data, tmp_path):
    model_dir, train, val = model_and_data
    base = [f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            f"trainer.output_dir={tmp_path / 'run'}", "trainer.save_freq=1", "trainer.logger=[jsonl]", *SMALL]
    first = api.train(api.make_config("grpo", overrides=[*base, "trainer.total_training_steps=2"]))
    assert first.final_metrics["training/global_step"] == 2
    second = api.train(api.make_config("grpo", overrides=[*base, "trainer.total_training_steps=3"]))
    assert second.final_metrics["training/global_step"] == 3
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3]


def test_kl_loss_loads_a_reference_model_and_logs_kl(model_and_data, tmp_path):
    model_dir, train, val = model_and_data
    cfg = api.make_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", "actor.use_kl_loss=true", "actor.kl_loss_type=low_var_kl",
        "actor.optim.lr=1e-3", "trainer.logger=[jsonl]", "trainer.val_before_train=false", *SMALL,
    ])
    result = api.train(cfg)
    records = read_metrics(result.metrics_path)
    assert all("actor/kl_loss" in r and "timing_s/ref" in r for r in records)
    # Step 1 starts from the reference weights: KL 0; the updates then move the policy away.
    assert records[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert records[-1]["actor/kl_loss"] > 0


def test_kl_in_reward_with_adaptive_coefficient_survives_resume(model_and_data, tmp_path):
    """In-reward KL with the adaptive controller (and an entropy bonus): the coefficient moves each
    step, is saved in the checkpoint, and a resumed run continues from the saved value."""
    model_dir, train, val = model_and_data
    overrides = [
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.horizon=10", "algorithm.kl_ctrl.target_kl=0.001",
        "actor.entropy_coeff=0.01", "actor.optim.lr=3e-3", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        "trainer.save_freq=1", "trainer.max_ckpt_to_keep=null", *SMALL,
    ]
    first = read_metrics(api.train(api.make_config("grpo", overrides=overrides)).metrics_path)
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in first]
    assert coeffs[0] == pytest.approx(0.05)
    assert all("actor/entropy" in r and "timing_s/ref" in r for r in first)
    assert len(set(coeffs)) > 1, "the adaptive controller should move the coefficient"
    saved = json.loads((tmp_path / "run" / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())
    resumed = read_metrics(api.train(api.make_config("grpo", overrides=[
        *overrides, "trainer.total_training_steps=4"])).metrics_path)
    assert resumed[-1]["training/global_step"] == 4
    assert resumed[-1]["actor/reward_kl_penalty_coeff"] == pytest.approx(saved["kl_controller"]["value"])


def test_config_errors_exit_2_before_loading_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", "actor.optim.lrr=1e-5"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "actor.optim.lr" in done.stderr
    # A critic key set wrong is refused before anything loads, named.
    done = subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", "--preset", "ppo",
                           "critic.model.path=/no/such/critic", f"trainer.output_dir={tmp_path / 'gae'}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "critic.model.path" in done.stderr


def test_builtin_model_with_a_fresh_sft_warm_start(tmp_path):
    """warm_start.enable=true runs the project's own SFT from random init, then RL, all cached."""
    overrides = ["warm_start.enable=true", "warm_start.steps=4", "warm_start.batch_size=16",
                 f"warm_start.cache_dir={tmp_path / 'cache'}", "data.builtin_train_size=64",
                 "data.builtin_val_size=16", f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]",
                 *SMALL, "trainer.total_training_steps=1"]
    result = api.train(api.make_config("grpo", overrides=overrides))
    cached = list((tmp_path / "cache").glob("builtin-tiny-*"))
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()
    assert not list((tmp_path / "cache").glob(".tmp-*"))
    assert result.final_metrics["training/global_step"] == 1


def test_gsm8k_files_from_the_preprocessing_script_train_end_to_end(model_and_data, tmp_path):
    """A local GSM8K copy -> scripts/preprocess_gsm8k.py -> parquet -> hybridflow train."""
    model_dir, _, _ = model_and_data
    raw = tmp_path / "gsm8k_raw"
    raw.mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many now?",
                 "answer": f"He has {i} + {i + 1} = {2 * i + 1} apples.\n#### {2 * i + 1}"} for i in range(8)]
        (raw / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out_data = tmp_path / "gsm8k"
    done = subprocess.run([sys.executable, "scripts/preprocess_gsm8k.py", "--input_dir", str(raw),
                           "--local_save_dir", str(out_data)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    cfg = api.make_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{out_data / 'train.parquet'}]",
        f"data.val_files=[{out_data / 'test.parquet'}]", "data.max_prompt_length=256",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", *SMALL, "trainer.total_training_steps=1",
    ])
    result = api.train(cfg)
    records = read_metrics(result.metrics_path)
    assert "val/openai/gsm8k/score/mean" in records[0]
    assert records[-1]["reward/error_rate"] == 0.0


def test_default_run_rl_improves_the_held_out_greedy_score(tmp_path, builtin_cache):
    """The embedded default (built-in model, warm start, built-in task), shortened to 30 RL
    steps: RL must raise held-out greedy accuracy by at least 0.2 absolute. The full default
    (100 steps) measured 0.352 -> 0.668 on 2 cores."""
    cfg = api.make_config("grpo", overrides=[
        f"warm_start.cache_dir={builtin_cache}", f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.total_training_steps=30", "trainer.test_freq=10", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]",
    ])
    result = api.train(cfg)
    vals = [(r["step"], r["val/score/mean"]) for r in read_metrics(result.metrics_path) if "val/score/mean" in r]
    assert [s for s, _ in vals] == [0, 10, 20, 30]
    before, after = vals[0][1], vals[-1][1]
    assert 0.05 < before < 0.6, f"the warm start should sometimes succeed, not always: {before}"
    assert after - before >= 0.2, vals


LOSS_MODE_KEYS = {"dro": ["actor.policy_loss.dro_beta=0.1"]}  # its one required setting


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro"])
def test_every_policy_loss_trains_through_config_alone(model_and_data, tmp_path, mode):
    """A loss mode is a config name: no controller branch, the same loop trains with it. (The
    modes with a preset are covered by the preset test below.) Two optimizer steps per batch
    (ppo_mini_batch_size 4 of 8), so the second one sees a ratio that is not 1."""
    model_dir, train, val = model_and_data
    cfg = api.make_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        "trainer.save_final=false", "trainer.test_freq=0", f"actor.policy_loss.loss_mode={mode}", "actor.optim.lr=1e-6",
        *LOSS_MODE_KEYS.get(mode, []), *SMALL, "trainer.total_training_steps=1",
    ])
    metrics = api.train(cfg).final_metrics
    assert metrics["training/global_step"] == 1
    assert all(math.isfinite(metrics[k]) for k in ("actor/pg_loss", "actor/grad_norm"))


TEXT_PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 2)  # varies within a group: advantages are not all 0
"""


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_token_baseline_estimators_train_on_the_actors_sum_pi_squared(model_and_data, tmp_path, estimator):
    """The optimal-token-baseline estimators need Σπ² per token: with one optimizer step per batch
    (no old logprobs otherwise), the old-logprob forward runs for them and returns it too."""
    model_dir, train, val = model_and_data
    reward = tmp_path / "reward.py"
    reward.write_text(TEXT_PARITY_REWARD)
    cfg = api.make_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        "trainer.save_final=false", "trainer.test_freq=0", f"algorithm.adv_estimator={estimator}", "actor.optim.lr=1e-6",
        f"reward.custom_reward_function.path={reward}", *SMALL, "actor.ppo_mini_batch_size=8",
        "trainer.total_training_steps=2",
    ])
    records = read_metrics(api.train(cfg).metrics_path)
    assert [r["step"] for r in records] == [1, 2]
    for step in records:
        assert "timing_s/old_log_prob" in step  # the estimator alone asked for that forward
        assert step["critic/advantages/min"] < 0 < step["critic/advantages/max"]
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean", "critic/advantages/max",
                    "critic/advantages/min"):
            assert math.isfinite(step[key]), (key, step[key])


PRESET_METRICS = {
    "dapo": ["filter/gen_rounds", "filter/varied_group_fraction", "reward/overlong_penalty_mean"],
    "remax": ["critic/reward_baseline/mean", "timing_s/gen_baseline"],
    "ppo": ["critic/vf_loss", "critic/vf_explained_var", "critic/values/mean", "timing_s/update_critic"],
}


# colour_square trains a vision-language model on image rows: tests/e2e/test_e2e_vision_language.py runs it.
# online_dpo trains on pairs of differently rewarded samples, which this random model never gives (all score
# 0): tests/e2e/test_e2e_online_dpo.py runs it on the warm-started built-in model.
@pytest.mark.parametrize("preset", [p for p in list_presets() if p not in ("colour_square", "online_dpo")])
def test_every_preset_runs_end_to_end(model_and_data, tmp_path, preset):
    """Every shipped text preset trains two steps on the built-in task's files through the CLI's API."""
    model_dir, train, val = model_and_data
    cfg = api.make_config(preset, overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        "trainer.save_final=false", "trainer.test_freq=0", "actor.optim.lr=1e-6", "algorithm.filter_groups.max_num_gen_batches=2",
        *SMALL, "trainer.total_training_steps=2",
    ])
    metrics = api.train(cfg).final_metrics
    assert metrics["training/global_step"] == 2
    assert all(math.isfinite(metrics[k]) for k in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"))
    for key in PRESET_METRICS.get(preset, []):
        assert key in metrics, f"{preset} should log {key}"


ODD_IS_HARD_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Prompts whose answer ends in an even digit always score 0 (no signal); for the others the
    # score depends on the sampled text, so their groups usually vary.
    if int(ground_truth) % 2 == 0:
        return 0.0
    return float(sum(map(ord, solution_str)) % 2)
"""


def test_dapo_dynamic_sampling_keeps_only_varied_groups(model_and_data, tmp_path):
    model_dir, train, val = model_and_data
    reward = tmp_path / "reward.py"
    reward.write_text(ODD_IS_HARD_REWARD)
    cfg = api.make_config("dapo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        "trainer.save_final=false", "trainer.test_freq=0", f"reward.custom_reward_function.path={reward}",
        *SMALL, "trainer.total_training_steps=2", "data.gen_batch_size=4",
    ])
    result = api.train(cfg)
    for record in read_metrics(result.metrics_path):
        # About half the prompts are even and always filtered: a step needs >= 2 rounds of 4
        # prompts to keep 8 groups, and the kept batch holds only varied groups.
        assert record["filter/gen_rounds"] >= 2
        assert 0 < record["filter/varied_group_fraction"] < 1
        if not record["filter/exhausted"]:
            assert record["critic/score/min"] < record["critic/score/max"]


HOSTILE_REWARD = """
import math, os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    kind = sum(map(ord, solution_str)) % 6
    if kind == 0:
        raise RuntimeError("reward bug")
    if kind == 1:
        return float("nan")
    if kind == 2:
        return "not a number"
    if kind == 3 and len(solution_str) % 7 == 0:
        time.sleep(60)  # hangs: the per-sample timeout must end it
    if kind == 4 and len(solution_str) % 11 == 0:
        os._exit(3)  # kills its worker process
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
"""


def test_hostile_reward_functions_are_counted_and_never_reach_the_advantages(model_and_data, tmp_path):
    model_dir, train, val = model_and_data
    reward = tmp_path / "hostile.py"
    reward.write_text(HOSTILE_REWARD)
    cfg = api.make_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        "trainer.save_final=false", "trainer.test_freq=0", f"reward.custom_reward_function.path={reward}",
        "reward.timeout_s=1", *SMALL, "trainer.total_training_steps=2",
    ])
    records = read_metrics(api.train(cfg).metrics_path)
    assert len(records) == 2
    assert sum(r["reward/error_rate"] for r in records) > 0
    assert sum(r["reward/nonfinite_rate"] for r in records) > 0
    for r in records:
        assert all(math.isfinite(r[k]) for k in ("critic/advantages/max", "critic/advantages/min", "actor/pg_loss"))
        assert r["actor/skipped_steps"] == 0


def test_packed_token_budget_updates_match_padded_fixed_micro_batches(model_and_data, tmp_path):
    """Packing, token-budget micro-batches and balancing change how the work is cut, not the
    math: step 1 (same samples) gives the same loss and gradient norm as padded micro-batches."""
    model_dir, train, val = model_and_data
    common = [
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "trainer.logger=[jsonl]",
        "trainer.val_before_train=false", "trainer.save_final=false", "trainer.test_freq=0", "actor.ppo_epochs=2",
        *SMALL, "trainer.total_training_steps=1",
    ]
    padded = api.train(api.make_config("grpo", overrides=[
        *common, f"trainer.output_dir={tmp_path / 'padded'}", "trainer.balance_batch=false",
        "actor.use_remove_padding=false", "actor.use_dynamic_bsz=false"])).final_metrics
    packed = api.train(api.make_config("grpo", overrides=[
        *common, f"trainer.output_dir={tmp_path / 'packed'}", "actor.use_remove_padding=true",
        "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=96", "actor.log_prob_max_token_len_per_gpu=96",
        "trainer.balance_batch=true"])).final_metrics
    assert packed["critic/score/mean"] == padded["critic/score/mean"]
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-5), key
    assert "global_seqlen/balanced_max" in packed


def test_server_mode_generates_through_http_the_same_run_as_engine_mode(model_and_data, tmp_path):
    """rollout.mode=server: the replica's engine behind hybridflow's HTTP server, every request
    through POST /generate. The same seeds give the same trajectories, so the same metrics, on
    step 1 and, after a weight sync into the served engine, on step 2."""
    model_dir, train, val = model_and_data
    runs = {}
    for mode in ("engine", "server"):
        cfg = api.make_config("grpo", overrides=[
            f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            f"trainer.output_dir={tmp_path / mode}", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
            f"rollout.mode={mode}", *SMALL, "trainer.total_training_steps=2", "trainer.test_freq=0",
        ])
        records = read_metrics(api.train(cfg).metrics_path)
        runs[mode] = [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in records]
    engine, server = runs["engine"], runs["server"]
    assert [r["step"] for r in server] == [1, 2]
    assert server[0]["rollout/generated_tokens"] > 0
    for step_engine, step_server in zip(engine, server):
        assert step_server.keys() == step_engine.keys()
        for key, value in step_engine.items():
            if key.startswith("rollout_corr/"):
                # The rollout's own logprobs: requests reach the engine at other moments over HTTP, so
                # it batches them differently, and fp32 sums in another order move them by ~1e-7.
                assert step_server[key] == pytest.approx(value, abs=1e-6), key
            else:
                assert step_server[key] == value, key
    assert server[1]["rollout_corr/log_ratio_abs_mean"] < 1e-4  # the served engine got step 1's weights


def test_sampled_validation_logs_verls_val_core_metrics_and_dumps_generations(model_and_data, tmp_path):
    """rollout.val_kwargs sample N responses per held-out prompt; the val-core/val-aux bootstrap metrics
    are logged; validation and training samples land in bounded JSONL files, one per step."""
    model_dir, train, val = model_and_data
    run = tmp_path / "run"
    cfg = api.make_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={run}", "trainer.logger=[jsonl]", "trainer.save_final=false",
        "rollout.val_kwargs.n=4", "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0",
        "trainer.validation_data_dir=val_dump", f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        "trainer.dump_max_samples=5", *SMALL, "trainer.total_training_steps=1",
    ])
    records = read_metrics(api.train(cfg).metrics_path)
    validation = records[0]  # val_before_train, at step 0
    source = "hybridflow/arithmetic"  # its scorer returns a plain number: the core variable is reward
    for key in ("mean@4", "best@4/mean", "best@4/std"):
        assert f"val-core/{source}/reward/{key}" in validation, sorted(validation)
    for key in ("std@4", "best@2/mean", "worst@4/mean"):
        assert f"val-aux/{source}/reward/{key}" in validation
    assert validation[f"val-core/{source}/reward/mean@4"] == pytest.approx(validation["val/score/mean"])
    # the worst of 4 draws never beats their mean, which never beats the best
    assert validation[f"val-aux/{source}/reward/worst@4/mean"] <= validation[f"val-core/{source}/reward/mean@4"] \
        <= validation[f"val-core/{source}/reward/best@4/mean"]

    val_rows = [json.loads(line) for line in (run / "val_dump" / "0.jsonl").read_text().splitlines()]
    assert len(val_rows) == 5 and {"input", "output", "gts", "score", "step", "data_source"} <= set(val_rows[0])
    assert (run / "val_dump" / "1.jsonl").exists()  # the last step validates too
    rollout_rows = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(rollout_rows) == 5
    assert {"prompt", "response", "score", "advantage", "logprobs", "step"} <= set(rollout_rows[0])
    assert len(rollout_rows[0]["logprobs"]) == rollout_rows[0]["response_tokens"] <= 4
    assert len(rollout_rows[0]["tokens"]) == len(rollout_rows[0]["logprobs"])  # one text per token's logprob
