"""The memory planner: the arithmetic by hand, the plan's structure, its fixes, and one check
against the real engine's measured peak (a planner that flags a configuration that then really
runs out of the budget, and passes one that fits)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.cli import main
from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.utils.shapes import bucketed_length
from hybridflow.config.budget import BUILTIN_TINY_SHAPE, BUILTIN_TINY_VL_SHAPE, ModelShape, read_model_shape, training_bytes_per_token
from hybridflow.config.plan import (
    HEAD_FORWARD_TEMPORARIES,
    KV_CACHE_MEMORY_FRACTION,
    KV_CAPACITY_ALIGN,
    KV_PROMPT_ROWS,
    LM_HEAD_CHUNK_LOGIT_BYTES,
    LM_HEAD_MAX_CHUNK_ROWS,
    LM_HEAD_MIN_CHUNK_ROWS,
    ONEDNN_PACKED_VENDORS,
    PREFIX_BLOCK_TOKENS,
    PREFILL_TOKENS,
    forward_activation_bytes,
    kv_cache_bytes,
    logits_bytes,
    plan_memory,
    prefix_cache_tokens,
    train_activation_bytes,
)

MIB, GIB = 2**20, 2**30
QWEN25_7B = ModelShape(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, attention_bias=True)


def phase(plan, role, name):
    return next(p for p in plan.phases if (p.role, p.phase) == (role, name))


def test_parameter_count_is_the_models():
    import torch

    from hybridflow.models.tiny import TinyModelSpec, build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(TinyModelSpec(), seed=0)
    assert BUILTIN_TINY_SHAPE.num_parameters == sum(p.numel() for p in model.parameters()) == 823_424
    # Qwen2.5-7B: 7.62B parameters (its model card), untied head included.
    assert QWEN25_7B.num_parameters == 7_615_616_512


def test_constants_are_the_engines():
    from hybridflow.inference import compact, kv_cache, native, prefix_cache
    from hybridflow.training import lm_head

    assert (LM_HEAD_CHUNK_LOGIT_BYTES, LM_HEAD_MIN_CHUNK_ROWS, LM_HEAD_MAX_CHUNK_ROWS) == (
        lm_head.CHUNK_LOGIT_BYTES, lm_head.MIN_CHUNK_ROWS, lm_head.MAX_CHUNK_ROWS)
    assert KV_CACHE_MEMORY_FRACTION == native.KV_CACHE_MEMORY_FRACTION
    assert KV_PROMPT_ROWS == native.DEFAULT_MAX_PREFILL_PROMPTS
    assert PREFILL_TOKENS == native.DEFAULT_MAX_PREFILL_TOKENS
    assert KV_CAPACITY_ALIGN == kv_cache.CAPACITY_ALIGN
    assert PREFIX_BLOCK_TOKENS == prefix_cache.DEFAULT_BLOCK_SIZE
    assert ONEDNN_PACKED_VENDORS == compact.ONEDNN_FASTER_VENDORS


def test_logits_of_the_chunked_head_by_hand():
    v, h = BUILTIN_TINY_SHAPE.vocab_size, BUILTIN_TINY_SHAPE.hidden_size
    # 512 rows fit one chunk: 2 float32 (512, V) temporaries forward; backward 2 (4 when the entropy
    # has a gradient) and the head's fp32 gradient.
    assert logits_bytes(BUILTIN_TINY_SHAPE, 512, fused=True, backward=False) == HEAD_FORWARD_TEMPORARIES * 512 * v * 4
    assert logits_bytes(BUILTIN_TINY_SHAPE, 512, fused=True, backward=True) == 2 * 512 * v * 4 + v * h * 4
    assert logits_bytes(BUILTIN_TINY_SHAPE, 512, fused=True, backward=True, entropy_grad=True) == (
        4 * 512 * v * 4 + v * h * 4)
    # More rows than a chunk (128 MiB of logits: 220 rows at V = 152064) cost one chunk's
    # temporaries, whatever their number: that is the point of the chunked head.
    rows = (128 << 20) // (4 * 152064)
    assert rows == 220
    chunked = 2 * rows * 152064 * 4 + 152064 * 3584 * 4
    assert logits_bytes(QWEN25_7B, 10_000, fused=True, backward=True) == chunked
    assert logits_bytes(QWEN25_7B, 100_000, fused=True, backward=True) == chunked
    # bf16 compute adds the head's weight and a chunk's dz cast to bf16.
    assert logits_bytes(QWEN25_7B, 10_000, fused=True, backward=True, compute_bytes=2) == (
        chunked + (152064 * 3584 + rows * 152064) * 2)
    # The model's own head (sharded ranks) keeps every row's logits, their gradient and a softmax temporary.
    assert logits_bytes(QWEN25_7B, 10_000, fused=False, backward=True) == 10_000 * 152064 * 4 * 3


def test_activations_reuse_the_budget_formula():
    s = BUILTIN_TINY_SHAPE
    backward = (2 * s.hidden_size + 3 * s.intermediate_size) * 4  # a layer's gradients of its intermediates
    per_token = training_bytes_per_token(s, compute_bytes=4) + backward
    assert train_activation_bytes(s, 1000, compute_bytes=4, gradient_checkpointing=False) == 1000 * per_token
    checkpointed = train_activation_bytes(s, 1000, compute_bytes=4, gradient_checkpointing=True)
    assert checkpointed < 0.5 * 1000 * per_token
    # Autocast: 4 more float32 hidden-sized values per layer and token, and the layers' bf16 weight copies.
    autocast = train_activation_bytes(s, 1000, compute_bytes=2, gradient_checkpointing=False, autocast=True)
    plain = train_activation_bytes(s, 1000, compute_bytes=2, gradient_checkpointing=False)
    layers = s.num_parameters - s.vocab_size * s.hidden_size
    assert autocast - plain == 1000 * s.num_hidden_layers * 4 * s.hidden_size * 4 + layers // 4 * 4 * 2


def test_kv_cache_by_hand():
    # Tiny model, fp32: 2 x 4 layers x 64 x 4 B = 2048 B per position; 72 tokens -> rows of 128 positions (256 KiB).
    row = 128 * 2048
    kv, rows = kv_cache_bytes(BUILTIN_TINY_SHAPE, budget=100 * row, dtype_bytes=4, longest=72, max_batch_size=256)
    assert (kv, rows) == (100 * row, 36)  # 100 rows fit: 64 prompt rows, 36 decode rows
    kv, rows = kv_cache_bytes(BUILTIN_TINY_SHAPE, budget=1000 * row, dtype_bytes=4, longest=72, max_batch_size=256)
    assert (kv, rows) == ((256 + 64) * row, 256)  # max_batch_size bounds it below the budget
    # The prefix cache fills what the budget leaves, up to the positions a step generates.
    kv, _ = kv_cache_bytes(BUILTIN_TINY_SHAPE, budget=1000 * row, dtype_bytes=4, longest=72, max_batch_size=256,
                           prefix_tokens=1000)
    assert kv == (256 + 64) * row + 1000 * 2048
    assert kv_cache_bytes(BUILTIN_TINY_SHAPE, budget=64 * row, dtype_bytes=4, longest=72, max_batch_size=256) == (0, 0)
    # Prefix cache: whole 16-token blocks of each finished sequence but its last token, the prompt's shared.
    # 64-token prompts (4 blocks), 95 positions with keys per sample (5 blocks: 1 of its own), n=8: 12 blocks.
    assert prefix_cache_tokens(64, 32, 8, 1) == (4 + 8 * 1) * 16
    assert prefix_cache_tokens(48, 80, 4, 32) == 32 * (3 + 4 * 4) * 16


def test_plan_terms_follow_the_config():
    base = load_config(overrides=["trainer.device=cpu", "trainer.device_memory_gb=8"])
    plan = plan_memory(base, BUILTIN_TINY_SHAPE)
    assert [(p.role, p.phase) for p in plan.phases] == [
        ("rollout", "generation"), ("actor", "logprob forward"), ("actor", "update")]
    n = BUILTIN_TINY_SHAPE.num_parameters
    update = phase(plan, "actor", "update")
    assert (update.params, update.optimizer) == (4 * n, 8 * n)
    checkpointed = plan_memory(dataclasses.replace(base, model=dataclasses.replace(
        base.model, enable_gradient_checkpointing=True)), BUILTIN_TINY_SHAPE)
    assert phase(checkpointed, "actor", "update").activations < update.activations / 2  # 4 layers: ~0.37x
    # Offloaded optimizer state leaves the device outside the step.
    offload = load_config(overrides=["trainer.device=cpu", "trainer.device_memory_gb=8",
                                     "actor.fsdp_config.optimizer_offload=true"])
    assert phase(plan_memory(offload, BUILTIN_TINY_SHAPE), "actor", "logprob forward").optimizer == 0
    # A KL term adds the reference's phase; gae the critic's two.
    # The reference loads in model.dtype (auto: bf16 on a CPU with bf16 hardware, fp32 elsewhere): both, pinned.
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        kl = plan_memory(load_config(overrides=["trainer.device=cpu", "actor.use_kl_loss=true", f"model.dtype={dtype}"]),
                         BUILTIN_TINY_SHAPE)
        assert phase(kl, "reference", "logprob forward").params == size * n
    critic = plan_memory(load_config("ppo", overrides=["trainer.device=cpu"]), BUILTIN_TINY_SHAPE, with_critic=True)
    assert {p.phase for p in critic.phases if p.role == "critic"} == {"values forward", "update"}


def test_a_cpu_in_reduced_precision_plans_the_shape_bucket_of_a_micro_batch():
    """Packed micro-batches of a bf16 CPU run at their bucketed token count and the head at bucketed
    rows (``ModelForward``'s bucket_shapes): 2500 tokens run as 2560, their 2000 response rows as
    2048; float32 and padded micro-batches run as they are."""
    common = ["trainer.device=cpu", "data.max_prompt_length=100", "data.max_response_length=400",
              "actor.ppo_max_token_len_per_gpu=2500", "actor.log_prob_max_token_len_per_gpu=2500"]
    assert (bucketed_length(2500), bucketed_length(2000)) == (2560, 2048)
    s = BUILTIN_TINY_SHAPE

    def update_and_forward(*extra):
        plan = plan_memory(load_config(overrides=[*common, *extra]), s)
        return phase(plan, "actor", "update"), phase(plan, "actor", "logprob forward")

    bf16, bf16_forward = update_and_forward("model.dtype=bfloat16")
    assert bf16.activations == train_activation_bytes(s, 2560, compute_bytes=2, gradient_checkpointing=False,
                                                      autocast=True)
    assert bf16.logits == logits_bytes(s, 2048, fused=True, backward=True, compute_bytes=2)
    assert bf16_forward.activations == forward_activation_bytes(s, 2560, compute_bytes=2, autocast=True)
    f32, _ = update_and_forward("model.dtype=float32")
    assert f32.activations == train_activation_bytes(s, 2500, compute_bytes=4, gradient_checkpointing=False)
    padded, _ = update_and_forward("model.dtype=bfloat16", "actor.use_remove_padding=false")
    assert padded.activations == train_activation_bytes(s, 2500, compute_bytes=2, gradient_checkpointing=False,
                                                        autocast=True)


def test_sharding_divides_the_model_state():
    one = load_config(overrides=["trainer.device=cuda", "model.dtype=bfloat16", "trainer.device_memory_gb=80",
                                 "data.max_prompt_length=1024", "data.max_response_length=2048"])
    eight = load_config(overrides=["trainer.device=cuda", "model.dtype=bfloat16", "trainer.device_memory_gb=80",
                                   "data.max_prompt_length=1024", "data.max_response_length=2048",
                                   "trainer.backend=ray", "trainer.n_gpus_per_node=8"])
    single, sharded = plan_memory(one, QWEN25_7B), plan_memory(eight, QWEN25_7B)
    n = QWEN25_7B.num_parameters
    assert phase(single, "actor", "logprob forward").grads == 4 * n
    assert phase(sharded, "actor", "logprob forward").grads == 4 * (n // 8)
    # 7B with full AdamW state does not fit one 80 GB GPU; over 8 it does.
    assert phase(single, "actor", "update").peak > 80 * GIB and single.fixes[("actor", "update")]
    assert not sharded.too_big()
    # Sharded ranks use the model's own head: full logits of every response row.
    assert phase(sharded, "actor", "logprob forward").logits > phase(single, "actor", "logprob forward").logits


def test_a_phase_that_does_not_fit_gets_the_cheapest_fix_and_it_fits():
    overrides = ["trainer.device=cpu", "actor.ppo_max_token_len_per_gpu=4096", "trainer.device_memory_gb=0.1"]
    plan = plan_memory(load_config(overrides=overrides), BUILTIN_TINY_SHAPE)
    assert [(p.role, p.phase) for p in plan.too_big()] == [("actor", "update")]
    fix = plan.fixes[("actor", "update")]
    assert fix.startswith("actor.ppo_max_token_len_per_gpu=")  # the cheapest: a smaller micro-batch
    budget = int(fix.split("=", 1)[1].split(":", 1)[0])
    fixed = plan_memory(load_config(overrides=[*overrides, f"actor.ppo_max_token_len_per_gpu={budget}"]),
                        BUILTIN_TINY_SHAPE)
    assert not fixed.too_big()
    # Twice that budget would not have fitted: the fix is the largest budget that does.
    bigger = plan_memory(load_config(overrides=[*overrides, f"actor.ppo_max_token_len_per_gpu={2 * budget}"]),
                         BUILTIN_TINY_SHAPE, find_fixes=False)
    assert bigger.too_big()


def test_sequences_longer_than_a_rank_holds_get_sequence_parallelism():
    """64k-token samples of a 7B model on 8 x 80 GB: one sample's activations do not fit a rank
    whatever the budget (a micro-batch holds at least one sample), so the fix splits sequences;
    with it each rank holds half of each micro-batch's tokens and response rows."""
    overrides = ["trainer.device=cuda", "model.dtype=bfloat16", "trainer.device_memory_gb=80", "trainer.backend=ray",
                 "trainer.n_gpus_per_node=8", "data.max_prompt_length=1024", "data.max_response_length=65536",
                 "model.enable_gradient_checkpointing=true", "actor.ppo_max_token_len_per_gpu=8192",
                 "actor.log_prob_max_token_len_per_gpu=8192", "rollout.free_cache_engine=true",
                 "rollout.sleep_level=2", "actor.fsdp_config.optimizer_offload=true"]
    plan = plan_memory(load_config(overrides=overrides), QWEN25_7B)
    update = phase(plan, "actor", "update")
    assert update.peak > 80 * GIB
    assert plan.fixes[("actor", "update")].startswith("actor.ulysses_sequence_parallel_size=")
    sp = int(plan.fixes[("actor", "update")].split("=", 1)[1].split(":", 1)[0])
    split = plan_memory(load_config(overrides=[*overrides, f"actor.ulysses_sequence_parallel_size={sp}"]), QWEN25_7B,
                        find_fixes=False)
    assert phase(split, "actor", "update").peak <= 80 * GIB
    two = plan_memory(load_config(overrides=[*overrides, "actor.ulysses_sequence_parallel_size=2"]), QWEN25_7B,
                      find_fixes=False)
    assert phase(two, "actor", "update").activations * 2 == pytest.approx(update.activations, rel=0.01)


@settings(max_examples=40, deadline=None)
@given(prompt=st.integers(1, 4096), response=st.integers(1, 8192), budget=st.sampled_from([None, 512, 8192, 65536]),
       dynamic=st.booleans(), checkpointing=st.booleans(), ranks=st.sampled_from([1, 2, 8]),
       kl=st.booleans(), device=st.sampled_from(["cpu", "cuda"]), memory=st.floats(0.01, 200),
       estimator=st.sampled_from(["grpo", "gae"]), offload=st.booleans())
def test_any_valid_config_is_planned_and_every_misfit_gets_an_answer(
    prompt, response, budget, dynamic, checkpointing, ranks, kl, device, memory, estimator, offload
):
    overrides = [f"data.max_prompt_length={prompt}", f"data.max_response_length={response}",
                 f"actor.use_dynamic_bsz={str(dynamic).lower()}", f"critic.use_dynamic_bsz={str(dynamic).lower()}",
                 f"model.enable_gradient_checkpointing={str(checkpointing).lower()}", f"actor.use_kl_loss={str(kl).lower()}",
                 f"trainer.device={device}", f"trainer.device_memory_gb={memory}", f"algorithm.adv_estimator={estimator}",
                 f"actor.fsdp_config.param_offload={str(offload).lower()}"]
    if budget is not None:
        overrides.append(f"actor.ppo_max_token_len_per_gpu={budget}")
    if ranks > 1:
        overrides += ["trainer.backend=ray", f"trainer.n_gpus_per_node={ranks}"]
    cfg = load_config(overrides=overrides)
    try:
        validate_config(cfg)
    except ConfigError:
        return
    plan = plan_memory(cfg, QWEN25_7B, with_critic=estimator == "gae")
    assert all(p.peak > 0 for p in plan.phases)
    assert set(plan.fixes) == {(p.role, p.phase) for p in plan.too_big()}
    assert all(plan.fixes.values())


def test_a_kv_cache_that_holds_no_sequence_blocks_generation():
    """10k-token sequences of a 7B model: the native engine's 64 reserved prompt rows alone outgrow
    its budget (0.4 of the memory free at start-up), so it would refuse every request; tensor
    parallelism halves each rank's rows."""
    overrides = ["trainer.device=cuda", "model.dtype=bfloat16", "trainer.device_memory_gb=80", "trainer.backend=ray",
                 "trainer.n_gpus_per_node=8", "data.max_prompt_length=2048", "data.max_response_length=8192"]
    plan = plan_memory(load_config(overrides=overrides), QWEN25_7B)
    generation = phase(plan, "rollout", "generation")
    assert generation.peak < 80 * GIB and "refuse every request" in generation.blocked
    assert generation in plan.too_big()
    assert plan.fixes[("rollout", "generation")].startswith("rollout.tensor_model_parallel_size=2")


def test_cli_plan_prints_the_table_and_the_warning(capsys):
    assert main(["plan", "trainer.device=cpu", "actor.ppo_max_token_len_per_gpu=4096",
                 "trainer.device_memory_gb=0.1"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak memory per rank, MiB; device 102.40 MiB (trainer.device_memory_gb)" in out
    assert "actor     update" in out and "  NO" in out
    assert "WARNING: actor update needs" in out and "Cheapest fix: actor.ppo_max_token_len_per_gpu=" in out
    assert main(["plan", "trainer.device_memory_gb=0"]) == 2  # a config error: must be > 0
    assert "trainer.device_memory_gb=0" in capsys.readouterr().err
    assert main(["plan", "trainer.device_memory_gb=1e308"]) == 2  # and finite, below 1 PiB
    assert "trainer.device_memory_gb=1e+308 must be a size in GiB" in capsys.readouterr().err


def test_explain_has_the_memory_section():
    from hybridflow.config import explain_config

    text = explain_config(load_config(overrides=["trainer.device=cpu", "trainer.device_memory_gb=8"]))
    memory = text.split("\nMemory (hybridflow plan)\n", 1)[1]
    assert "device 8192.00 MiB" in memory or "device 8.00 GiB" in memory
    assert "actor     update" in memory


# ---------------------------------------------------------------------------- against the real engine

def _bench():
    path = Path(__file__).resolve().parents[3] / "bench" / "memory_planner.py"
    spec = importlib.util.spec_from_file_location("memory_planner_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_flagged_config_really_runs_out_and_passed_one_fits():
    """A 100 MiB budget on the built-in model: 4096-token micro-batches are flagged and really peak
    above it in the real engine; the fix the planner names really peaks below it."""
    import torch

    torch.set_num_threads(1)
    bench = _bench()
    budget = 100 * MIB
    common = ["trainer.device=cpu", "data.max_prompt_length=64", "data.max_response_length=64",
              "data.train_batch_size=32", "rollout.n=1", "actor.ppo_mini_batch_size=32",
              # Nothing else on the device during the update: the rollout's weights and KV cache sleep.
              "rollout.free_cache_engine=true", "rollout.sleep_level=2"]
    big = plan_memory(load_config(overrides=[*common, "actor.ppo_max_token_len_per_gpu=4096"]), BUILTIN_TINY_SHAPE,
                      device_bytes=budget)
    assert phase(big, "actor", "update").others == 0
    assert ("actor", "update") in {(p.role, p.phase) for p in big.too_big()}
    fix = big.fixes[("actor", "update")]
    assert fix.startswith("actor.ppo_max_token_len_per_gpu=")
    fixed_budget = int(fix.split("=", 1)[1].split(":", 1)[0])
    fixed = plan_memory(load_config(overrides=[*common, f"actor.ppo_max_token_len_per_gpu={fixed_budget}"]),
                        BUILTIN_TINY_SHAPE, device_bytes=budget)
    assert phase(fixed, "actor", "update").peak <= budget

    # Measured in the dtype the plan is for: the config's model.dtype (auto: bf16-mixed on a CPU with bf16
    # hardware, where this budget measured 164 MiB flagged and 91 MiB fixed; float32 elsewhere).
    from hybridflow.utils.device import train_dtype

    spec, dtype = bench.TinyModelSpec(), train_dtype(load_config(overrides=common).model.dtype, "cpu")
    measured_big = bench.measured_bytes(spec, 32, 64, 64, 4096, gradient_checkpointing=False, dtype=dtype)
    measured_fixed = bench.measured_bytes(spec, 32, 64, 64, fixed_budget, gradient_checkpointing=False, dtype=dtype)
    assert measured_big > budget, f"flagged, yet measured {measured_big / MIB:.1f} MiB <= {budget / MIB:.0f} MiB"
    assert measured_fixed <= budget, f"passed, yet measured {measured_fixed / MIB:.1f} MiB > {budget / MIB:.0f} MiB"


def test_the_built_in_vision_language_model_is_planned_with_its_own_shape(tmp_path):
    """A visual built-in task with builtin:tiny trains the tiny Qwen2-VL (set-up's prepare_builtin_vl_model):
    the planner and config explain read that shape, which is the written model's."""
    import json

    from hybridflow.models.tiny import write_tiny_vl_model

    written = ModelShape.from_config(json.loads((write_tiny_vl_model(tmp_path / "vl") / "config.json").read_text()))
    assert written == BUILTIN_TINY_VL_SHAPE == read_model_shape("builtin:tiny", "colour_square")
    assert read_model_shape("builtin:tiny", "arithmetic") == read_model_shape("builtin:tiny") == BUILTIN_TINY_SHAPE


@pytest.mark.timeout(600)
def test_the_planner_predicts_the_default_runs_process_peak_within_15_percent(tmp_path):
    """``hybridflow train`` with no arguments, two steps in a fresh process: the planner's process
    peak (largest phase + interpreter and libraries) against ``perf/rss_peak_gb`` (issue 35)."""
    import json
    import os
    import subprocess

    bench = Path(__file__).resolve().parents[3] / "bench" / "memory_timeline.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(bench), "--worker", "default", "--steps", "2", "--work", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=580)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    measured = result["phases"]["step"]
    assert result["process_peak_gb"] >= measured
    assert 0.85 <= result["predicted_gb"] / measured <= 1.15, result


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_rollout_weights_count_the_packed_copy_where_the_engine_keeps_one(monkeypatch, dtype):
    from hybridflow.config import plan as planner

    shape, size = BUILTIN_TINY_SHAPE, {"float32": 4, "bfloat16": 2}[dtype]
    cfg = load_config(overrides=["trainer.device=cpu", f"rollout.dtype={dtype}"])
    # By hand, the built-in model (h 128, I 384, 4 heads and 2 KV heads of 32, V 272, 4 layers): q/k/v
    # 128 x 256, gate/up 768 x 128, o 128 x 128, down 128 x 384 a layer, and the head 272 x 128 (not
    # the norms or the q/k/v biases).
    assert (shape.hidden_size, shape.intermediate_size, shape.q_size, shape.kv_size, shape.vocab_size,
            shape.num_hidden_layers) == (128, 384, 128, 64, 272, 4)
    per_layer = 128 * 256 + 768 * 128 + 128 * 128 + 128 * 384
    packed = (4 * per_layer + 272 * 128) * size

    def rollout_params(vendor: str, avx512_bf16: bool) -> int:
        monkeypatch.setattr(planner, "cpu_vendor", lambda: vendor)
        monkeypatch.setattr(planner, "_cpu_has_avx512_bf16", lambda: avx512_bf16)
        return phase(plan_memory(cfg, shape), "rollout", "generation").params

    plain = rollout_params("GenuineIntel", True)
    assert plain == shape.num_parameters * size
    assert rollout_params("AuthenticAMD", True) == plain + packed
    # bf16 packs only with avx512_bf16 (compact.resolve_weight_layout); fp32 packs on any AMD CPU.
    assert rollout_params("AuthenticAMD", False) == plain + (packed if dtype == "float32" else 0)

    # The planned copy is the one the engine's forward keeps (where this torch can pack).
    import torch

    from hybridflow.inference.compact import CompactCausalLM, onednn_packing_available
    from hybridflow.models.tiny import TinyModelSpec, build_tiny_model

    if onednn_packing_available(torch.device("cpu"), getattr(torch, dtype)):
        compact = CompactCausalLM.from_hf(build_tiny_model(TinyModelSpec(), seed=0).to(getattr(torch, dtype)), 128)
        compact.set_weight_layout("onednn")
        assert sum(t.numel() * t.element_size() for t in compact.packed_tensors()) == packed
