"""The actor update against the machine's matmul bound: where an optimizer step's time goes, per phase.

The bound is this CPU's own matmul rate, measured by a short probe of ``torch.mm`` at the update's
shapes (tokens of a micro-batch x hidden, times each linear layer's weight; float32 and bf16), so
the figures say how far the update is from what the hardware does with the same matmuls. The
update is the engine's own code (``TrainEngine.forward_pass.run``, the loss, ``backward``,
``optimizer.clip_and_step``), cut at its seams into phases:

- forward: the model without its head (``base_model``), all tokens of the pack;
- head: the LM head over the response-predicting rows, forward and backward (its backward
  recomputes each chunk's logits: ``training.lm_head``), timed to the moment the gradient of its
  input rows exists (a tensor hook);
- backward: the rest of ``loss.backward()``, the decoder layers;
- optimizer: gradient clipping and AdamW's step (no matmul: seconds only).

FLOPs are those of the real token count: 2 per weight per token in the forward of each decoder
linear layer, the causal attention's 2·L²·hidden per layer per sequence (half the square: the
masked half is work no kernel needs), 2·H·V per response row in the head; a backward is twice its
forward (the head's is three times: one more for the recompute). The bound of a phase is the time
the probe's rate needs for its matmuls, shape by shape; the fraction is bound / measured. The
whole ``TrainEngine.optimizer_step`` is timed too, to show the phases add up to the real update.

Each precision runs alternately in one process, ``--repeats`` times after a warm-up; times are
medians; CPU-seconds are the process's (every thread of it: on a loaded machine they move less
than wall time, which others' processes stretch). Precisions: ``float32``; ``bfloat16``, the
engine's mixed precision (fp32 master weights and AdamW, the forward under ``torch.autocast``:
what ``model.dtype=bfloat16`` gives the actor). The agreement line is the mean and max |logprob
difference| of the response tokens between the two (a PPO clip of 0.2 is |log ratio| 0.18).

Workloads: ``default``, the default run's update (the built-in ~0.9M model; 32 prompts x 8
samples, prompts of ~35 tokens, responses of 2-4: what ``hybridflow train`` logs); ``longtail``,
the ~18M Qwen2 shape of ``bench/grpo_step_vs_trl.py`` on its long-tailed lengths (16 prompts x 8,
lognormal median 32, sigma 1, cap 256), packed in token-budget micro-batches.

Peak memory of a phase is the rise of the process's peak RSS over its start (``VmHWM``, reset
before each phase through ``/proc/self/clear_refs``).

    python bench/update_bound.py --threads 2                     # both workloads (~3 min on 2 cores)
    python bench/update_bound.py --workloads longtail --optimizers   # + AdamW's for-loop / foreach / fused
    python bench/update_bound.py --workloads longtail --precisions bfloat16 bfloat16:torch   # the CPU kernels' gain
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training import cpu_attention, cpu_layer_ops, cpu_lm_head
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.training.micro_batches import token_budget_micro_batches
from hybridflow.training.optimizer import clip_and_step
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories
from hybridflow.utils import native_build
from hybridflow.utils.device import cpu_features

PAD_TOKEN_ID = 256
PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16}
# A precision with ":torch" runs with the trainer's CPU kernels off (HYBRIDFLOW_CPU_KERNELS=0: torch's SDPA, softmax,
# RMSNorm and activation ops), in the same process as the kernels: the before and after of those kernels.
VARIANTS = [*PRECISIONS, *(f"{p}:torch" for p in PRECISIONS)]
PHASES = ("forward", "head", "backward", "optimizer")


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    model: Callable[[], torch.nn.Module]
    prompts: list[int]  # prompt length of each sample
    responses: list[int]  # response length of each sample
    group_size: int


def longtail_model() -> torch.nn.Module:
    """The ~18M Qwen2 shape of bench/grpo_step_vs_trl.py (random weights)."""
    return build_tiny_model(TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                          num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                                          max_position_embeddings=1024))


def workloads() -> dict[str, Workload]:
    g = torch.Generator().manual_seed(0)
    # The default run (trainer logs prompt_length/mean 34.8, response_length 2-4, mean 3.0).
    default = Workload("default", build_tiny_model, torch.randint(34, 36, (256,), generator=g).tolist(),
                       torch.randint(2, 5, (256,), generator=g).tolist(), 8)
    # grpo_step_vs_trl.py's target_lengths: lognormal(log 32, 1) in [1, 256], 16 prompts x 8.
    normal = torch.randn((16, 8), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lengths = (math.log(32.0) + normal).exp().round().clamp(1, 256).long().flatten().tolist()
    longtail = Workload("longtail", longtail_model, torch.randint(20, 41, (128,), generator=g).tolist(), lengths, 8)
    return {"default": default, "longtail": longtail}


def build_batch(w: Workload, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    trajectories = []
    for i, (p, r) in enumerate(zip(w.prompts, w.responses, strict=True)):
        ids = torch.randint(0, min(vocab, 256), (p + r,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [1] * r, [0.0] * r, "bench", group_id=i // w.group_size))
    batch = collate_trajectories(trajectories, pad_token_id=PAD_TOKEN_ID)
    batch.advantages = torch.randn(batch.batch_size, 1, generator=g) * batch.response_mask
    return batch


def loss_for(batch: TrainBatch) -> Callable:
    """The policy-gradient token-mean loss with an entropy bonus (the actor's shape of loss)."""
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        per_token = -mb.advantages * logprobs - 1e-3 * entropy
        return agg_loss(per_token, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    return loss_fn


# --------------------------------------------------------------------------------------------
# FLOPs and the matmul bound
# --------------------------------------------------------------------------------------------


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(in, out) of every decoder linear layer (the head excluded)."""
    head = model.get_output_embeddings()
    return [(m.in_features, m.out_features) for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m is not head]


@dataclass
class Flops:
    """Matmul FLOPs of one optimizer step, by phase, as (rows, in, out, count) GEMMs for the bound."""

    gemms: dict[str, list[tuple[int, int, int, float]]] = field(default_factory=dict)
    attention: dict[str, float] = field(default_factory=dict)  # attention FLOPs (bmm-shaped), by phase

    def total(self, phase: str) -> float:
        return sum(2.0 * m * k * n * c for m, k, n, c in self.gemms.get(phase, ())) + self.attention.get(phase, 0.0)


def update_flops(model: torch.nn.Module, micro_batches: list[TrainBatch]) -> Flops:
    hidden = model.config.hidden_size
    vocab = model.get_output_embeddings().out_features
    layers = model.config.num_hidden_layers
    shapes = linear_shapes(model)
    f = Flops({p: [] for p in ("forward", "head", "backward")}, {p: 0.0 for p in ("forward", "backward")})
    for mb in micro_batches:
        lengths = mb.attention_mask.sum(-1)
        tokens = int(lengths.sum())
        rows = int(mb.response_mask.sum())
        for k, n in shapes:
            f.gemms["forward"].append((tokens, k, n, 1.0))
            f.gemms["backward"].append((tokens, k, n, 2.0))  # grad of the input and of the weight
        attention = float(layers * 2 * (lengths.double() ** 2).sum() * hidden)  # QKᵀ and AV, causal half
        f.attention["forward"] += attention
        f.attention["backward"] += 2 * attention
        f.gemms["head"].append((rows, hidden, vocab, 4.0))  # forward, recompute, two gradients
    return f


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.15) -> tuple[float, float]:
    """(FLOP per wall second, FLOP per CPU-second) of (m, k) @ (k, n) in ``dtype``."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(2):
        a @ b
    count, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        a @ b
        count += 1
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    flops = 2.0 * m * k * n * count
    return flops / wall, flops / max(cpu, 1e-9)


class Bound:
    """The probe's rate at each GEMM shape of the update, per dtype (cached by shape)."""

    def __init__(self) -> None:
        self.rates: dict[tuple[int, int, int, torch.dtype], tuple[float, float]] = {}

    def rate(self, m: int, k: int, n: int, dtype: torch.dtype) -> tuple[float, float]:
        key = (m, k, n, dtype)
        if key not in self.rates:
            self.rates[key] = matmul_rate(max(1, m), k, n, dtype)
        return self.rates[key]

    def seconds(self, flops: Flops, phase: str, dtype: torch.dtype) -> tuple[float, float]:
        """(wall, CPU) seconds the probe's rate needs for the phase's matmuls. Attention is bounded
        at the rate of the largest GEMM of the phase (its bmm is no faster)."""
        wall = cpu = 0.0
        gemms = flops.gemms.get(phase, ())
        for m, k, n, count in gemms:
            rw, rc = self.rate(m, k, n, dtype)
            wall += 2.0 * m * k * n * count / rw
            cpu += 2.0 * m * k * n * count / rc
        if flops.attention.get(phase) and gemms:
            m, k, n, _ = max(gemms, key=lambda g: g[0] * g[1] * g[2])
            rw, rc = self.rate(m, k, n, dtype)
            wall += flops.attention[phase] / rw
            cpu += flops.attention[phase] / rc
        return wall, cpu


# --------------------------------------------------------------------------------------------
# The update, cut into phases
# --------------------------------------------------------------------------------------------


def reset_peak_rss() -> int:
    """Reset the process's peak RSS to its current RSS (Linux); returns the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass
    return _status_kb("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kb("VmHWM") * 1024


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class Clock:
    """Wall and CPU seconds, and peak RSS rise, per phase of one update."""

    def __init__(self) -> None:
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.memory = dict.fromkeys(PHASES, 0)
        self._phase: str | None = None

    def start(self, phase: str) -> None:
        self.stop()
        self._phase, self._base = phase, reset_peak_rss()
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        if self._phase is None:
            return
        self.wall[self._phase] += time.perf_counter() - self._wall0
        self.cpu[self._phase] += time.process_time() - self._cpu0
        self.memory[self._phase] = max(self.memory[self._phase], peak_rss() - self._base)
        self._phase = None


def phased_update(engine: TrainEngine, micro_batches: list[TrainBatch], loss_fn: Callable) -> Clock:
    """One optimizer step through the engine's own pieces, timed per phase."""
    clock = Clock()
    forward = engine.forward_pass
    hidden_states, head = type(forward)._hidden_states, type(forward)._head

    def timed_hidden(self, **inputs):
        clock.start("forward")
        return hidden_states(self, **inputs)

    def timed_head(self, rows, *args, **kwargs):
        clock.start("head")  # the forward's last op ends here
        if rows.requires_grad:
            rows.register_hook(lambda grad: clock.start("backward"))  # the head's backward ends here
        return head(self, rows, *args, **kwargs)

    forward._hidden_states = timed_hidden.__get__(forward)
    forward._head = timed_head.__get__(forward)
    try:
        engine.model.train()
        engine.optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches:
            stats = forward.run(mb, "logprobs", 1.0, True, True)
            loss, _ = loss_fn(mb, stats.logprobs, stats.entropy)
            loss.backward()  # the head's backward is timed as head, the layers' as backward
            clock.stop()
        clock.start("optimizer")
        clip_and_step(engine.model, engine.optimizer, engine.scheduler, engine.optim_spec.grad_clip, engine.device,
                      engine.offload_optimizer)
        clock.stop()
    finally:
        del forward._hidden_states, forward._head
    return clock


def whole_update(engine: TrainEngine, micro_batches: list[TrainBatch], loss_fn: Callable) -> tuple[float, float]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    engine.optimizer_step(micro_batches, loss_fn, temperature=1.0, with_entropy=True, use_remove_padding=True)
    return time.perf_counter() - wall0, time.process_time() - cpu0


def dtype_of(variant: str) -> torch.dtype | None:
    return PRECISIONS[variant.split(":")[0]]


@contextlib.contextmanager
def kernels_for(variant: str):
    """The trainer's CPU kernels on, or off for a ":torch" variant (the libraries are looked up again each way)."""
    off = variant.endswith(":torch")
    saved = os.environ.get(native_build.DISABLE_ENV)

    def reset():
        for module in (cpu_attention, cpu_lm_head, cpu_layer_ops):
            module._library.cache_clear()

    if off:
        os.environ[native_build.DISABLE_ENV] = "0"
    reset()
    try:
        yield
    finally:
        if off:
            if saved is None:
                del os.environ[native_build.DISABLE_ENV]
            else:
                os.environ[native_build.DISABLE_ENV] = saved
        reset()


def build_engine(w: Workload, precision: str, optimizer: str = "default") -> TrainEngine:
    torch.manual_seed(0)
    with kernels_for(precision):
        engine = TrainEngine(w.model(), OptimSpec(lr=1e-6), torch.device("cpu"), mixed_precision=dtype_of(precision))
    if optimizer != "default":
        engine.optimizer.defaults[optimizer] = True
        for group in engine.optimizer.param_groups:
            group[optimizer] = True
    return engine


@dataclass
class Measured:
    clocks: list[Clock] = field(default_factory=list)
    whole: list[tuple[float, float]] = field(default_factory=list)

    def median(self, what: str, phase: str) -> float:
        return statistics.median(getattr(c, what)[phase] for c in self.clocks)

    def whole_median(self, index: int) -> float:
        return statistics.median(w[index] for w in self.whole)


def run_workload(w: Workload, args: argparse.Namespace, bound: Bound) -> None:
    probe_model = w.model()
    batch = build_batch(w, probe_model.get_output_embeddings().out_features)
    micro_batches, _ = token_budget_micro_batches(batch, args.max_token_len)
    loss_fn = loss_for(batch)
    flops = update_flops(probe_model, micro_batches)
    tokens = int(batch.attention_mask.sum())
    params = sum(p.numel() for p in probe_model.parameters())
    print(f"\n== {w.name}: {params / 1e6:.1f}M parameters, {batch.batch_size} samples, {tokens} tokens "
          f"({int(batch.response_mask.sum())} response) in {len(micro_batches)} micro-batch(es) of at most "
          f"{args.max_token_len} tokens; update matmul FLOPs {sum(flops.total(p) for p in flops.gemms) / 1e9:.2f} G")
    engines = {p: build_engine(w, p) for p in args.precisions}
    measured = {p: Measured() for p in args.precisions}
    for p, engine in engines.items():  # warm-up: first calls allocate, pick kernels
        with kernels_for(p):
            phased_update(engine, micro_batches, loss_fn)
            whole_update(engine, micro_batches, loss_fn)
    for _ in range(args.repeats):
        for p, engine in engines.items():
            with kernels_for(p):
                measured[p].clocks.append(phased_update(engine, micro_batches, loss_fn))
                measured[p].whole.append(whole_update(engine, micro_batches, loss_fn))
    header = f"{'precision':<14} {'phase':<10} {'s':>7} {'CPU-s':>7} {'GFLOP':>7} {'GFLOP/CPU-s':>11} " \
             f"{'bound':>11} {'fraction':>8} {'peak MB':>8}"
    print(header)
    for p in args.precisions:
        dtype = dtype_of(p) or torch.float32
        m = measured[p]
        flop_total = bound_cpu_total = 0.0
        for phase in PHASES:
            cpu = m.median("cpu", phase)
            gflop = flops.total(phase) / 1e9 if phase != "optimizer" else 0.0
            if phase != "optimizer":
                _, bound_cpu = bound.seconds(flops, phase, dtype)
                flop_total += gflop
                bound_cpu_total += bound_cpu
                rate = f"{gflop / cpu:11.1f}" if cpu else f"{'-':>11}"
                fraction = f"{bound_cpu / cpu:8.2f}" if cpu else f"{'-':>8}"
                bound_rate = f"{gflop / bound_cpu:11.1f}" if bound_cpu else f"{'-':>11}"
            else:
                rate, bound_rate, fraction = f"{'-':>11}", f"{'-':>11}", f"{'-':>8}"
            print(f"{p:<14} {phase:<10} {m.median('wall', phase):7.3f} {cpu:7.3f} {gflop:7.2f} {rate} {bound_rate} "
                  f"{fraction} {m.median('memory', phase) / 2**20:8.1f}")
        phases_cpu = sum(m.median("cpu", phase) for phase in PHASES)
        whole_wall, whole_cpu = m.whole_median(0), m.whole_median(1)
        print(f"{p:<14} {'sum':<10} {sum(m.median('wall', ph) for ph in PHASES):7.3f} {phases_cpu:7.3f} "
              f"{flop_total:7.2f} {flop_total / phases_cpu:11.1f} {flop_total / bound_cpu_total:11.1f} "
              f"{bound_cpu_total / phases_cpu:8.2f}")
        print(f"{p:<14} {'update':<10} {whole_wall:7.3f} {whole_cpu:7.3f} {flop_total:7.2f} "
              f"{flop_total / whole_cpu:11.1f} {flop_total / bound_cpu_total:11.1f} {bound_cpu_total / whole_cpu:8.2f}"
              "   (TrainEngine.optimizer_step, whole)")
    if "float32" in measured and "bfloat16" in measured:
        f32, b16 = measured["float32"], measured["bfloat16"]
        print(f"bf16-mixed / fp32, same process: update {f32.whole_median(1) / b16.whole_median(1):.2f}x by CPU-seconds"
              f" ({f32.whole_median(0) / b16.whole_median(0):.2f}x by wall); per phase by CPU-seconds: "
              + ", ".join(f"{ph} {f32.median('cpu', ph) / max(b16.median('cpu', ph), 1e-9):.2f}x" for ph in PHASES))
        agreement(engines, micro_batches)
    if args.optimizers:
        compare_optimizers(w, micro_batches, loss_fn, args.repeats)


@torch.no_grad()
def agreement(engines: dict[str, TrainEngine], micro_batches: list[TrainBatch]) -> None:
    """|logprob difference| of bf16-mixed against fp32 on the same weights."""
    f32, b16 = engines["float32"], engines["bfloat16"]
    b16.model.load_state_dict(f32.model.state_dict())
    diffs = []
    for mb in micro_batches:
        a = f32.forward_pass.run(mb, "logprobs", 1.0, False, True).logprobs
        b = b16.forward_pass.run(mb, "logprobs", 1.0, False, True).logprobs
        diffs.append((a - b).abs()[mb.response_mask.bool()])
    d = torch.cat(diffs)
    print(f"bf16-mixed vs fp32 logprobs of the response tokens: mean |diff| {float(d.mean()):.4f}, max "
          f"{float(d.max()):.4f} (a 0.2 clip is |log ratio| {math.log(1.2):.3f})")


def compare_optimizers(w: Workload, micro_batches: list[TrainBatch], loss_fn: Callable, repeats: int) -> None:
    """AdamW's step: torch's CPU default (a for-loop over parameters), foreach, fused; same gradients."""
    engines = {name: build_engine(w, "float32", name) for name in ("default", "foreach", "fused")}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats + 1):
        for name, engine in engines.items():
            times[name].append(phased_update(engine, micro_batches, loss_fn).cpu["optimizer"])
    same = all(torch.equal(a, b) for a, b in zip(engines["default"].model.parameters(),
                                                  engines["foreach"].model.parameters(), strict=True))
    same_fused = all(torch.equal(a, b) for a, b in zip(engines["default"].model.parameters(),
                                                        engines["fused"].model.parameters(), strict=True))
    base = statistics.median(times["default"][1:])
    print("AdamW step (clip + step), CPU-seconds: " + ", ".join(
        f"{name} {statistics.median(t[1:]):.4f} ({base / statistics.median(t[1:]):.2f}x)" for name, t in times.items())
        + f"; weights after {repeats + 1} steps bitwise equal to the for-loop: foreach {same}, fused {same_fused}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["default", "longtail"], choices=["default", "longtail"])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=VARIANTS,
                        help="float32, bfloat16 (bf16-mixed); with :torch, the trainer's CPU kernels off")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-token-len", type=int, default=8192, help="token budget of a micro-batch")
    parser.add_argument("--optimizers", action="store_true", help="also time AdamW for-loop / foreach / fused")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_features().describe()}; torch {torch.__version__}, {args.threads} thread(s)")
    bound = Bound()
    probe_shapes = [(4096, 512, 1536), (4096, 1536, 512), (4096, 128, 384)]
    for m, k, n in probe_shapes:
        rates = {p: bound.rate(m, k, n, PRECISIONS[p] or torch.float32) for p in PRECISIONS}
        print(f"matmul ({m}x{k}) @ ({k}x{n}): " + ", ".join(
            f"{p} {r[1] / 1e9:.1f} GFLOP per CPU-s ({r[0] / 1e9:.1f}/s wall)" for p, r in rates.items())
              + f"; bf16 {rates['bfloat16'][1] / rates['float32'][1]:.2f}x")
    all_workloads = workloads()
    for name in args.workloads:
        run_workload(all_workloads[name], args, bound)


if __name__ == "__main__":
    main()
