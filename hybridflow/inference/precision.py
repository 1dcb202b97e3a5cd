"""Which dtype ``rollout.dtype=auto`` means on a CPU: a rule of the hardware and the model's size.

On a GPU the answer is bf16 (``base.choose_rollout_dtype``). On a CPU, bf16 matmuls are fast only
with bf16 hardware (``utils.device.NATIVE_BF16_FLAGS``: avx512_bf16 or AMX); elsewhere torch
converts to fp32 on the fly, which measured ~10x *slower* than fp32 decode on an AVX2 EPYC. And
even where bf16 hardware is present, a small model's decode is bound by per-op overheads, not by
reading its weights, and bf16 only adds conversions: measured (docs/figures.md, ``bench/rollout_compute_bound.py``)
bf16 decode on a Zen 4 with avx512_bf16 was 0.40-0.75x fp32 for the built-in 0.9M model, 1.36-1.81x
for a ~20M model and 1.55-1.95x for a ~100M one.

So on a CPU, ``auto`` is a rule (``rule_cpu_rollout_dtype``), never a measurement: the sampling
precision changes every sampled token and logprob, and a decision that changes results must be a
pure function of the hardware, the model and the config. A timing taken while other processes run
read "0.13x" in one run and "7.16x" in the next for the same 0.9M model, and the two runs of one
command then sampled in two precisions.

1. no avx512_bf16/amx_bf16 flag → float32;
2. a model of at least ``BF16_MIN_PARAMETERS`` parameters → bfloat16, a smaller one → float32.

``rollout.dtype=tune`` asks for the measurement instead (``tune_cpu_rollout_dtype``): a short probe
(``probe_decode_precision``) decodes the model itself at the rollout batch in both dtypes, from
the same prompts and the same tokens (drawn by the bf16 run, as a bf16 rollout would draw them;
the fp32 run is teacher-forced on them), and bf16 is chosen only when its decode step is at least
``MIN_BF16_SPEEDUP`` times faster *and* the mean |logprob difference| of those tokens stays within
the health check's threshold (``trainer.health.logprob_mismatch``, mean |log pi_trainer - log
pi_rollout| per token). The training run records the answer and its figures in its folder
(``controller.rollout_dtype``), so its resumes keep it and the user can pass it on explicitly.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.inference.compact import CompactCausalLM
from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.inference.sampling import counter_uniforms, sample_from_probs
from hybridflow.tracking.health import HealthThresholds
from hybridflow.utils.device import CpuFeatures

logger = logging.getLogger(__name__)

# rollout.dtype=auto on a CPU with bf16 hardware: bfloat16 from this many parameters up. bf16 was
# measured slower below 1M parameters (0.40-0.75x at 0.9M) and faster from 20M (1.36x at batch 8,
# 1.63-1.81x at 32; 1.55-1.95x at 100M); no size between was measured. 10M sits 11x above the
# slower side and 2x below the smallest measured gain: a model near 10M loses little either way.
BF16_MIN_PARAMETERS = 10_000_000
# rollout.dtype=tune: bf16 must beat fp32 by this factor: below it the gain does not pay for the
# logprob mismatch it adds, and timing noise on a shared machine could flip the choice.
MIN_BF16_SPEEDUP = 1.2
# The default ceiling on the mean |logprob difference|: the health check's own default.
DEFAULT_MAX_LOGPROB_MISMATCH = HealthThresholds().logprob_mismatch
# Probe workload: enough rows to be in the regime the rollout runs in, few enough steps to take
# seconds on a CPU even for a 1B model.
PROBE_PROMPT_TOKENS = 16
PROBE_DECODE_STEPS = 8
PROBE_MAX_BATCH = 32
# Decodes of each dtype, alternated: one round let a load burst land on one side only, and a
# 0.9M model whose bf16 decode is 0.4-0.75x fp32 once measured 1.2x under parallel test workers.
PROBE_ROUNDS = 3


@dataclass(frozen=True)
class PrecisionProbe:
    """fp32 against bf16 decode of one model: median step times and logprob agreement."""

    batch: int
    float32_step_s: float
    bfloat16_step_s: float
    logprob_mismatch: float  # mean |log p_bf16 - log p_fp32| over the probe's decoded tokens
    logprob_mismatch_max: float

    @property
    def bfloat16_speedup(self) -> float:
        return self.float32_step_s / self.bfloat16_step_s


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" or "bfloat16"
    reason: str
    probe: PrecisionProbe | None = None


def rule_cpu_rollout_dtype(cpu: CpuFeatures, num_parameters: int | None) -> DtypeChoice:
    """The CPU rollout dtype for ``auto`` (module docstring): the hardware's bf16 flags and the
    model's parameter count (None: unknown, or an engine whose decode the figures do not describe)."""
    if not cpu.native_bf16:
        return DtypeChoice("float32", f"{cpu.bf16_flags()} on {cpu.model_name or 'this CPU'}: bf16 would be "
                                      "emulated, far slower than fp32")
    if num_parameters is None:
        return DtypeChoice("float32", "bf16 hardware, but no model size to apply the rule to (an engine that does not "
                                      "decode through the native decoder, or a model without one)")
    size = f"{num_parameters / 1e6:.1f}M parameters"
    if num_parameters < BF16_MIN_PARAMETERS:
        return DtypeChoice("float32", f"bf16 hardware, {size}: below {BF16_MIN_PARAMETERS / 1e6:g}M bf16 decode was "
                                      "measured slower than fp32 (rollout.dtype=tune measures this model)")
    return DtypeChoice("bfloat16", f"bf16 hardware, {size}: from {BF16_MIN_PARAMETERS / 1e6:g}M up bf16 decode was "
                                   "measured 1.4-1.9x faster than fp32 (rollout.dtype=tune measures this model)")


def tune_cpu_rollout_dtype(
    cpu: CpuFeatures,
    probe: Callable[[], PrecisionProbe],
    max_logprob_mismatch: float = DEFAULT_MAX_LOGPROB_MISMATCH,
    min_speedup: float = MIN_BF16_SPEEDUP,
) -> DtypeChoice:
    """The CPU rollout dtype for ``tune`` (module docstring); ``probe`` runs only on bf16 hardware."""
    if not cpu.native_bf16:
        return rule_cpu_rollout_dtype(cpu, None)
    measured = probe()
    figures = (f"bf16 decode {measured.bfloat16_speedup:.2f}x fp32 at batch {measured.batch}, mean |logprob "
               f"difference| {measured.logprob_mismatch:.4f} (max {measured.logprob_mismatch_max:.3f})")
    if measured.bfloat16_speedup < min_speedup:
        return DtypeChoice("float32", f"{figures}: not at least {min_speedup:.2f}x faster", measured)
    if not measured.logprob_mismatch <= max_logprob_mismatch:  # NaN refuses too
        return DtypeChoice("float32", f"{figures}: above the logprob mismatch threshold {max_logprob_mismatch}",
                           measured)
    return DtypeChoice("bfloat16", f"{figures}: faster and within the logprob mismatch threshold "
                                   f"{max_logprob_mismatch}", measured)


@torch.inference_mode()
def probe_decode_precision(
    model: torch.nn.Module,
    batch: int,
    prompt_tokens: int = PROBE_PROMPT_TOKENS,
    steps: int = PROBE_DECODE_STEPS,
    seed: int = 0,
    rounds: int = PROBE_ROUNDS,
) -> PrecisionProbe:
    """Decode ``steps`` tokens for ``batch`` random prompts in bf16 (sampling at temperature 1),
    then teacher-force the same tokens in fp32; compare step times (medians over ``rounds``
    alternating decodes of each dtype) and the tokens' logprobs.

    ``model`` (a supported HF causal LM on the CPU) is not modified: each dtype runs on a copy.
    """
    config = model.config
    length = min(prompt_tokens + steps, int(config.max_position_embeddings))
    prompt_tokens = max(1, length - steps)
    generator = torch.Generator().manual_seed(seed)
    vocab = int(model.get_input_embeddings().num_embeddings)
    prompts = torch.randint(0, vocab, (batch, prompt_tokens), generator=generator)
    keys = torch.randint(0, 2**32, (batch, 2), generator=generator)
    bf16_times, bf16_logprobs, tokens = _decode(model, torch.bfloat16, prompts, steps, keys, forced=None)
    fp32_times, fp32_logprobs, _ = _decode(model, torch.float32, prompts, steps, keys, forced=tokens)
    # Timing alternates between the dtypes, so a burst of load from another process (a shared
    # machine, parallel test workers) slows both sides' steps rather than one side's decode whole.
    for _ in range(rounds - 1):
        bf16_times += _decode(model, torch.bfloat16, prompts, steps, keys, forced=tokens)[0]
        fp32_times += _decode(model, torch.float32, prompts, steps, keys, forced=tokens)[0]
    difference = (bf16_logprobs - fp32_logprobs).abs()
    return PrecisionProbe(
        batch=batch,
        float32_step_s=statistics.median(fp32_times),
        bfloat16_step_s=statistics.median(bf16_times),
        logprob_mismatch=float(difference.mean()),
        logprob_mismatch_max=float(difference.max()),
    )


def _decode(
    model: torch.nn.Module, dtype: torch.dtype, prompts: torch.Tensor, steps: int, keys: torch.Tensor,
    forced: torch.Tensor | None,
) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """Prefill ``prompts`` (B, P) and decode ``steps`` tokens (drawn, or ``forced`` (B, T)).

    Returns the decode step times (the first, which pays one-off allocations, left out), the
    tokens' logprobs (B, T) at temperature 1, and the tokens (B, T).
    """
    twin = copy.deepcopy(model)
    for parameter in twin.parameters():  # as the engine casts: parameters only, RoPE buffers stay fp32
        parameter.data = parameter.data.to(dtype=dtype)
    batch, prompt_length = prompts.shape
    capacity = prompt_length + steps
    compact = CompactCausalLM.from_hf(twin, max_positions=capacity)
    cache = SlotKVCache(
        num_layers=compact.num_layers, num_kv_heads=compact.shape.num_kv_heads, head_dim=compact.shape.head_dim,
        dtype=dtype, device=compact.device, max_decode_rows=batch, prompt_rows=batch, memory_budget_bytes=2**62,
        max_capacity=capacity,
    )
    cache.ensure_capacity(capacity, live_rows=0)
    rows = list(range(batch))
    if prompt_length > 1:  # all prompt tokens but the last, as the engine prefills them
        width = prompt_length - 1
        positions = torch.arange(width).repeat(batch, 1)
        access = cache.prefill_access(rows, torch.arange(batch * width), torch.arange(batch).repeat_interleave(width),
                                      positions.reshape(-1), width)
        compact.forward(prompts[:, :-1], positions, access, width, with_logits=False)
        cache.copy_prompts(rows, rows, width)
    tokens, logprobs, times = [], [], []
    feed = prompts[:, -1]
    for step in range(steps):
        position = prompt_length - 1 + step
        positions = torch.full((batch,), position)
        start = time.perf_counter()
        access = cache.decode_access(batch, positions, position + 1)
        logits = compact.forward(feed[:, None], positions[:, None], access, position + 1)
        assert logits is not None
        log_probs = logits.float().log_softmax(dim=-1)
        if forced is None:
            drawn = sample_from_probs(log_probs.exp(), counter_uniforms(keys, torch.full((batch,), step)))
        else:
            drawn = forced[:, step]
        times.append(time.perf_counter() - start)
        tokens.append(drawn)
        logprobs.append(log_probs.gather(-1, drawn[:, None]).squeeze(-1))
        feed = drawn
    return times[1:] or times, torch.stack(logprobs, dim=1), torch.stack(tokens, dim=1)
