"""Fixed-length decode at a large batch against the compute bound: NativeEngine vs HF ``generate``.

Workload: ``--batch`` prompts of ``--prompt-tokens`` random tokens, each sampled once (temperature
1) for exactly ``--max-tokens`` tokens (``ignore_eos`` for the engine; ``min_new_tokens`` equal to
``max_new_tokens`` for HF, which forbids EOS until the end), on the ~20M-parameter Qwen2-shaped
model of ``rollout_long_tail.py``, with fixed torch threads.

Fraction of the compute bound, per side:

    fraction = generated tokens/s x FLOPs per token / matmul FLOP/s

    FLOPs per token = 2 x N_matmul + 4 x L x H x D x c
      N_matmul = weights of every matmul a token runs through: q/k/v/o and gate/up/down of each
                 layer, plus the LM head (V x h; tied to the embedding, whose lookup is no matmul)
      4 L H D c = attention: q.K^T and p.V, each 2 x H x D x c FLOPs per layer, where c is
                 the number of keys the token attends to; c is averaged over the generated tokens:
                 c = P + (T - 1) / 2 for prompt length P and T generated tokens
    matmul FLOP/s = a big square matmul (``--matmul-size``) in the side's dtype, same threads,
                    measured (median of 3) just before each run; the fraction is taken per run and
                    the median over runs is reported

Prefill, sampling, norms, rotary and softmax are not counted as useful work: they are what keeps
a side below 1. So is the memory traffic of attention, whose few FLOPs per byte of cached keys and
values make it bandwidth-bound. The *ceiling* line prints the best fraction any engine could reach
on this machine under this accounting: the matmul FLOPs of every decoded and prefilled token at
the measured matmul rate, plus the cached keys and values each decode step must read at the
measured copy bandwidth (weights streaming assumed perfectly overlapped with compute):

    ceiling = useful FLOPs / (rate x (matmul FLOPs incl. prefill / rate + KV bytes read / bandwidth))

The bf16 engine (``--dtypes float32 bfloat16``) is compared with the bf16 matmul rate; HF runs in
fp32 only (the reference figure of the issue). fp32 engines run once per ``--weight-layouts``
entry (``dense``: F.linear on the fused weights; ``onednn``: a packed copy, see
``hybridflow.inference.compact``), bf16 ones dense.

The header names the CPU (vendor, torch's dispatch level, avx512_bf16/amx_bf16) and what the
``auto`` settings resolve to on it: the weight layout, and ``rollout.dtype=auto`` with its reason,
next to the figures of a bf16-vs-fp32 decode probe of this model (``inference.precision``; printed on
every CPU, although ``auto`` measures only on CPUs with bf16 hardware).

    python bench/rollout_compute_bound.py --threads 2
    python bench/rollout_compute_bound.py --threads 1 --profile   # where the engine's time goes

Profile with one thread on a shared machine: with two, any parallel op can wait a scheduler tick
for a thread another process has displaced, and the table then shows those waits, not the work.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rollout_long_tail import (  # the ~20M shape, one definition
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    build_model,
)

from hybridflow.rollout.base import choose_rollout_dtype
from hybridflow.inference.compact import WEIGHT_LAYOUTS, onednn_packing_available, resolve_weight_layout
from hybridflow.inference.native import NativeEngine, resolve_dtype
from hybridflow.inference.precision import probe_decode_precision
from hybridflow.types import GenerationRequest, SamplingParams
from hybridflow.utils.device import cpu_features

WARM_UP_TOKENS = 8  # the warm-up run: first-call allocations and the KV cache sizing


@dataclass(frozen=True)
class FlopModel:
    matmul_params: int  # N_matmul
    layers: int  # L
    heads: int  # H
    head_dim: int  # D

    @staticmethod
    def of(model: torch.nn.Module) -> FlopModel:
        config: Any = model.config  # a PretrainedConfig; nn.Module's typing says Tensor | Module
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]  # includes lm_head
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return FlopModel(
            matmul_params=sum(m.weight.numel() for m in linears),
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            head_dim=head_dim,
        )

    def per_token(self, context: float) -> float:
        return 2.0 * self.matmul_params + 4.0 * self.layers * self.heads * self.head_dim * context


def matmul_flops_per_s(size: int, dtype: torch.dtype, repeats: int) -> float:
    """Median FLOP/s of ``size``-square matmuls with the current threads."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    torch.matmul(a, b)  # warm-up: thread pool and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
    return 2.0 * size**3 / statistics.median(times)


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes read + written per second by a large tensor copy, current threads (median)."""
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return 2.0 * nbytes / statistics.median(times)


def ceiling_fraction(flops: FlopModel, kv_bytes_per_position: int, batch: int, prompt: int, tokens: int,
                     rate: float, bandwidth: float) -> float:
    """The best compute-bound fraction of the workload (see the module docstring)."""
    context = prompt + (tokens - 1) / 2
    useful = batch * tokens * flops.per_token(context)
    matmul = 2.0 * flops.matmul_params * batch * (tokens + prompt - 1)  # decode + prefill tokens
    kv_bytes = batch * tokens * context * kv_bytes_per_position
    return useful / (matmul + kv_bytes / bandwidth * rate)


def build_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of one length (no EOS or padding id), so every row does the same work."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, PAD_TOKEN_ID, (batch, length), generator=generator).tolist()


def engine_run(engine: NativeEngine, prompts: list[list[int]], max_tokens: int) -> int:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [GenerationRequest(prompt_ids=p, params=params, request_id=str(i)) for i, p in enumerate(prompts)]
    return sum(len(t.response_ids) for trajectories in engine.generate_batch(requests) for t in trajectories)


@torch.inference_mode()
def hf_run(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> int:
    input_ids = torch.tensor(prompts)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    return int(output[:, input_ids.shape[1] :].numel())


@dataclass
class Side:
    """One contender: its runs' tokens/s, and the matmul rate measured just before each run."""

    label: str
    dtype: str
    run: Callable[[], int]
    tokens_per_s: list[float] = field(default_factory=list)
    matmul_rates: list[float] = field(default_factory=list)

    def fractions(self, per_token: float) -> list[float]:
        return [t * per_token / r for t, r in zip(self.tokens_per_s, self.matmul_rates, strict=True)]


def measure(sides: list[Side], repeats: int, matmul_size: int) -> None:
    """Round-robin over the sides, each run right after a matmul measurement in its dtype.

    Others share the machine: pairing every run with a bound measured moments before, and
    interleaving the sides, keeps a burst of load from favouring one side or one ratio.
    """
    for _ in range(repeats):
        for side in sides:
            side.matmul_rates.append(matmul_flops_per_s(matmul_size, resolve_dtype(side.dtype), repeats=3))
            start = time.perf_counter()
            tokens = side.run()
            side.tokens_per_s.append(tokens / (time.perf_counter() - start))


def build_engine(dtype: str, batch: int, weight_layout: str = "auto") -> NativeEngine:
    return NativeEngine(
        model=build_model("qwen2-20m"),
        eos_token_ids=[EOS_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
        max_batch_size=batch,
        dtype=dtype,
        seed=0,
        weight_layout=weight_layout,
    )


def print_machine(batch: int) -> None:
    """The CPU, what the ``auto`` settings resolve to on it, and the bf16-vs-fp32 probe's figures."""
    cpu = cpu_features()
    print(f"cpu: {cpu.describe()}")
    print(f"weight_layout=auto -> {resolve_weight_layout('auto', 'cpu', torch.float32)} (float32)")
    model = build_model("qwen2-20m")
    choice = choose_rollout_dtype("auto", "cpu", model=model, batch=batch)
    print(f"rollout.dtype=auto -> {choice.dtype}: {choice.reason}")
    probe = choice.probe or probe_decode_precision(model, batch=min(batch, 32))
    print(f"bf16 probe (batch {probe.batch}, decode): fp32 {probe.float32_step_s * 1e3:.1f} ms/step, bf16 "
          f"{probe.bfloat16_step_s * 1e3:.1f} ms/step (bf16 {probe.bfloat16_speedup:.2f}x fp32), mean |logprob "
          f"difference| {probe.logprob_mismatch:.4f} (max {probe.logprob_mismatch_max:.3f})")


def profile_engine(engine: NativeEngine, prompts: list[list[int]], max_tokens: int, rows: int) -> None:
    """Self CPU time per op over one run: which kernels the engine's time goes to.

    The engine runs its steps in a worker thread (``asyncio.to_thread``), where the profiler, whose
    callbacks are per thread, sees nothing; here the steps run inline on the profiled thread.
    """
    from unittest import mock

    from torch.profiler import ProfilerActivity, profile

    async def inline(function: Callable[..., object], *args: object) -> object:
        return function(*args)

    with mock.patch("asyncio.to_thread", inline), profile(activities=[ProfilerActivity.CPU]) as prof:
        engine_run(engine, prompts, max_tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (fixed for comparability)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--weight-layouts", nargs="+", default=["dense", "onednn"],
                        choices=[w for w in WEIGHT_LAYOUTS if w != "auto"], help="fp32 engine sides (onednn where available)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print the engine's top ops (first dtype)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    print_machine(args.batch)
    prompts = build_prompts(args.batch, args.prompt_tokens)
    flops = FlopModel.of(build_model("qwen2-20m"))
    context = args.prompt_tokens + (args.max_tokens - 1) / 2
    per_token = flops.per_token(context)
    print(
        f"workload: qwen2-20m (N_matmul {flops.matmul_params / 1e6:.2f}M), batch {args.batch}, prompt "
        f"{args.prompt_tokens}, {args.max_tokens} tokens each, {args.threads} threads, median of {args.repeats}"
    )
    print(
        f"FLOPs/token = 2 x {flops.matmul_params} + 4 x {flops.layers} x {flops.heads} x {flops.head_dim} x "
        f"{context:.1f} = {per_token / 1e6:.2f} MFLOP"
    )
    layouts = [w for w in args.weight_layouts
               if w == "dense" or onednn_packing_available(torch.device("cpu"), torch.float32)]
    sides = [engine_side(dtype, layout, prompts, args) for dtype in args.dtypes
             for layout in (layouts if dtype == "float32" else ["dense"])]
    if not args.skip_hf:
        sides.append(hf_side(prompts, args))
    measure(sides, args.repeats, args.matmul_size)
    for side in sides:
        print(
            f"{side.label:29s} {statistics.median(side.tokens_per_s):9.1f} tokens/s  matmul {side.dtype} "
            f"{statistics.median(side.matmul_rates) / 1e9:6.1f} GFLOP/s  fraction {statistics.median(side.fractions(per_token)):.2f}"
            f"  (runs: {' '.join(f'{f:.2f}' for f in side.fractions(per_token))})"
        )
    config: Any = build_model("qwen2-20m").config
    kv_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * flops.head_dim * 4  # fp32
    fp32_rates = [r for side in sides if side.dtype == "float32" for r in side.matmul_rates]
    if fp32_rates:
        bandwidth = copy_bandwidth()
        ceiling = ceiling_fraction(flops, kv_per_position, args.batch, args.prompt_tokens, args.max_tokens,
                                   statistics.median(fp32_rates), bandwidth)
        print(f"ceiling (float32)             fraction {ceiling:.2f}  (copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
              f"prefill and KV reads at their bounds)")
    if args.profile:
        profile_engine(build_engine(args.dtypes[0], args.batch), prompts, args.max_tokens, rows=25)


def engine_side(dtype: str, layout: str, prompts: list[list[int]], args: argparse.Namespace) -> Side:
    engine = build_engine(dtype, len(prompts), layout)
    engine_run(engine, prompts[:4], WARM_UP_TOKENS)  # first-call allocations, KV cache sizing
    return Side(f"native_engine {dtype} {layout}", dtype, lambda: engine_run(engine, prompts, args.max_tokens))


def hf_side(prompts: list[list[int]], args: argparse.Namespace) -> Side:
    model = build_model("qwen2-20m").eval()
    hf_run(model, prompts[:4], WARM_UP_TOKENS)
    return Side("hf_generate float32", "float32", lambda: hf_run(model, prompts, args.max_tokens))


if __name__ == "__main__":
    main()
