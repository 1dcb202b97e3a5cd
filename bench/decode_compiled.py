"""Would a compiled decode step lift batch-8 decode toward batch 128's tokens per CPU-second?

At batch 8 the native engine's bf16 decode step (~20M Qwen2-shaped model, ``static`` mode, weights packed
for oneDNN) spends about half of its CPU time outside the matmuls, in ~250 small tensor ops (RMS norms,
rotary, attention, KV writes; ``decode_batch_scaling.py --phases 8``). Fusing them is what a compiled
step does. This bench compiles the engine's own decode forward (``CompactCausalLM.forward`` over the static
decoder's padded rows and the engine's KV cache) with torch.compile's inductor backend on the CPU and times
it against the eager forward, both at batch 8 and at batch 128, in CPU-seconds of this thread, medians of
``--repeats`` interleaved rounds.

Three things inductor cannot take as they are, so the compiled forward wraps them as opaque custom ops:
the packed oneDNN linears (inductor lowers ``mkldnn._linear_pointwise`` only for weights it packed itself
under freezing) and the KV cache write (an ``index_put_`` into a view of the whole cache, which
functionalisation turns into a copy of the whole cache per layer: 340 ms a step). The eager forward with
the same wrappers is timed too (``eager+wrappers``): the wrappers' own cost.

Printed: compile CPU-seconds per shape (inductor compiles in this process: ``compile_threads=1``, as on a
2-core machine), peak RSS, how far the compiled logprobs move from the eager ones (bf16 rounds differently
once ops fuse), whether the greedy tokens agree, and the ratio batch 8 / batch 128 of the forwards alone,
eager and compiled.

    python bench/decode_compiled.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import time

import torch
import torch._inductor.config as inductor_config
from decode_batch_scaling import build_engine
from rollout_compute_bound import build_prompts, engine_run
from torch import Tensor

from hybridflow.inference.compact import CompactCausalLM


@torch.library.custom_op("hfbench::packed_linear", mutates_args=())
def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("hfbench::packed_linear_add", mutates_args=())
def packed_linear_add(x: Tensor, residual: Tensor, packed: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")


@packed_linear_add.register_fake
def _(x: Tensor, residual: Tensor, packed: Tensor) -> Tensor:
    return torch.empty_like(residual)


@torch.library.custom_op("hfbench::kv_write", mutates_args=("keys", "values"))
def kv_write(keys: Tensor, values: Tensor, layer: int, rows: Tensor, positions: Tensor,
             new_keys: Tensor, new_values: Tensor) -> None:
    keys[layer, rows, :, :, positions] = new_keys
    values[layer, rows, :, positions] = new_values


@kv_write.register_fake
def _(keys: Tensor, values: Tensor, layer: int, rows: Tensor, positions: Tensor,
      new_keys: Tensor, new_values: Tensor) -> None:
    return None


class Compilable(CompactCausalLM):
    """The engine's forward with the packed linears as opaque ops (the same kernels, so the same numbers)."""

    def _linear(self, x, weight, bias, packed):
        if packed is None:
            return torch.nn.functional.linear(x, weight, bias)
        return packed_linear(x, packed, bias, weight.shape[0])

    def _add_linear_(self, residual, x, weight, bias, packed):
        if packed is not None and bias is None and residual.dtype == torch.bfloat16:
            residual.copy_(packed_linear_add(x, residual, packed))
        else:
            residual.add_(self._linear(x, weight, bias, packed))


def thread_seconds(run) -> float:
    start = time.thread_time()
    run()
    return time.thread_time() - start


def thread_ms(run, calls: int) -> float:
    """CPU-ms of this thread per call of ``run``: the median of ``calls`` after an untimed one."""
    run()
    return statistics.median(thread_seconds(run) for _ in range(calls)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs=2, default=[8, 128])
    parser.add_argument("--keys", type=int, default=128, help="key positions read (a static key bucket)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inductor_config.compile_threads = 1

    engine = build_engine("qwen2-20m", "bfloat16", max(args.batches), "auto")
    prompts = build_prompts(max(args.batches), 16)
    engine_run(engine, prompts[:8], args.keys + 8)  # the cache sized for --keys positions
    runner = engine._runner
    decoder, model = runner.static_decoder, runner.compact
    assert decoder is not None, "the bench needs the static decode mode (bf16 on a CPU)"
    wrapped = copy.copy(model)
    wrapped.__class__ = Compilable
    cache_keys, cache_values = decoder.cache._tensors()
    keys = args.keys

    def eager(tokens: Tensor, positions: Tensor) -> Tensor:
        access = decoder.cache.decode_access(tokens.shape[0], positions[:, 0], keys)
        return model.forward(tokens, positions, access, keys)

    def step(tokens: Tensor, positions: Tensor, cache_keys: Tensor, cache_values: Tensor) -> Tensor:
        rows, at = torch.arange(tokens.shape[0]), positions[:, 0]

        def access(layer: int, new_keys: Tensor, new_values: Tensor) -> tuple[Tensor, Tensor]:
            kv_write(cache_keys, cache_values, layer, rows, at, new_keys[:, 0], new_values[:, 0])
            return cache_keys[layer, : tokens.shape[0], :, :, :keys], cache_values[layer, : tokens.shape[0], :, :keys]

        return wrapped.forward(tokens, positions, access, keys)

    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    inputs = {}
    print(f"qwen2-20m bfloat16, weights {model.weight_layout}, {args.threads} thread(s), {keys} key positions")
    with torch.inference_mode():
        for batch in args.batches:
            tokens = torch.randint(1, 4000, (batch, 1), generator=generator)
            positions = torch.randint(0, keys, (batch, 1), generator=generator)
            inputs[batch] = (tokens, positions)
            reference = eager(tokens, positions).float().log_softmax(-1)
            cpu = time.process_time()
            got = compiled(tokens, positions, cache_keys, cache_values).float().log_softmax(-1)
            diff = (got - reference).abs()
            print(f"batch {batch}: compile {time.process_time() - cpu:.1f} CPU-s; logprobs vs eager: mean abs diff "
                  f"{diff.mean():.5f}, max {diff.max():.4f}; greedy tokens agree in "
                  f"{int((got.argmax(-1) == reference.argmax(-1)).sum())}/{batch} rows")
        times = {(b, kind): [] for b in args.batches for kind in ("eager", "wrappers", "compiled")}
        loads = [os.getloadavg()[0]]
        for _ in range(args.repeats):
            for batch in args.batches:
                tokens, positions = inputs[batch]
                calls = max(5, 400 // batch)
                times[batch, "eager"].append(thread_ms(lambda: eager(tokens, positions), calls))
                times[batch, "wrappers"].append(thread_ms(lambda: step(tokens, positions, cache_keys, cache_values), calls))
                times[batch, "compiled"].append(
                    thread_ms(lambda: compiled(tokens, positions, cache_keys, cache_values), calls))
            loads.append(os.getloadavg()[0])
    print(f"load average {min(loads):.1f}-{max(loads):.1f}; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    median = {key: statistics.median(value) for key, value in times.items()}
    for batch in args.batches:
        print(f"batch {batch:4d} forward CPU-ms: eager {median[batch, 'eager']:7.2f}, eager+wrappers "
              f"{median[batch, 'wrappers']:7.2f}, compiled {median[batch, 'compiled']:7.2f} "
              f"({median[batch, 'compiled'] / median[batch, 'eager']:.2f}x eager)")
    small, large = args.batches
    for kind in ("eager", "compiled"):
        ratio = (small / median[small, kind]) / (large / median[large, kind])
        print(f"{kind:8s} forward tokens per CPU-second, batch {small} / batch {large}: {ratio:.2f}")


if __name__ == "__main__":
    main()
