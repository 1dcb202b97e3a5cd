"""The memory planner's prediction against the measured peak of a real training step, on a CPU.

For each configuration: the built-in tiny model family at some shape, a batch of full-length
samples cut into token-budget micro-batches as the actor cuts them, and two optimizer steps of
the real ``TrainEngine`` (packed or padded forward, chunked LM head with entropy, backward, AdamW; the second
step runs with the optimizer state allocated, as every step after the first does). Measured: the
bytes alive before (parameters, buffers, the batch; ``hybridflow.utils.memory.live_bytes``) plus
the peak of the tensor storage allocated and not yet freed during the two steps, from
``torch.profiler``'s allocation events (``hybridflow.utils.memory.peak_allocated_bytes``).
Predicted: the actor's update phase of ``hybridflow.config.plan.plan_memory`` for the same config
(its own terms, without the other roles on the device).

The second table does the same for the logprob forward (``compute_logprobs`` of a frozen engine
at the logprob budget, 2x the training one): predicted is that phase's parameters and the larger
of its layers' working set and its head's (its gradients and AdamW state, which the actor's
forward also carries, are exact sizes and left out of both sides).

The third table checks the rollout's KV cache (slot rows and prefix cache) as the native engine
sizes it under a given budget: predicted ``kv_cache_bytes`` against the engine's own accounting
of its cache tensors after a round (``kv_cache_bytes + prefix_cache_bytes``). Not a profiler
measurement: the engine runs its forwards in a worker thread, and the profiler records the
allocations of the calling thread only. Samples may end early at EOS (a random model), so the
prediction, made for full-length samples, is an upper bound there.

    PYTHONPATH=. python bench/memory_planner.py

Goal: predicted / measured within 0.85-1.15 for every configuration.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.config.budget import ModelShape
from hybridflow.config.loader import load_config
from hybridflow.config.plan import kv_cache_bytes, plan_memory, prefix_cache_tokens
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.inference.native import NativeEngine
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.training.micro_batches import token_budget_micro_batches
from hybridflow.types import GenerationRequest, SamplingParams, TrainBatch
from hybridflow.utils.memory import live_bytes, peak_allocated_bytes

MIB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    spec: TinyModelSpec
    samples: int
    prompt: int
    response: int
    token_budget: int
    gradient_checkpointing: bool = False
    dtype: str = "float32"  # model.dtype: bfloat16 is mixed precision (autocast over fp32 weights on one rank)
    packed: bool = True  # actor.use_remove_padding: false runs padded micro-batches (padded slots count)


CASES = [
    Case("tiny", TinyModelSpec(), 16, 32, 32, 1024),
    Case("tiny, gradient checkpointing", TinyModelSpec(), 16, 32, 32, 1024, gradient_checkpointing=True),
    Case("hidden 256", TinyModelSpec(hidden_size=256, intermediate_size=768), 16, 32, 32, 1024),
    Case("8 layers", TinyModelSpec(num_hidden_layers=8), 16, 32, 32, 1024),
    Case("vocab 8192", TinyModelSpec(vocab_size=8192), 16, 32, 32, 1024),
    Case("vocab 8192, 2048 response rows", TinyModelSpec(vocab_size=8192), 16, 64, 128, 4096),
    Case("4096 tokens, 4 micro-batches", TinyModelSpec(), 64, 32, 32, 1024),
    Case("4096-token micro-batch", TinyModelSpec(), 32, 64, 64, 4096),
    Case("8 layers, 4096 tokens, checkpointing", TinyModelSpec(num_hidden_layers=8), 32, 64, 64, 4096,
         gradient_checkpointing=True),
    Case("bf16 mixed precision", TinyModelSpec(), 16, 32, 32, 1024, dtype="bfloat16"),
    Case("bf16, hidden 256, checkpointing", TinyModelSpec(hidden_size=256, intermediate_size=768), 16, 32, 32, 1024,
         gradient_checkpointing=True, dtype="bfloat16"),
    Case("bf16, vocab 8192, 2048 response rows", TinyModelSpec(vocab_size=8192), 16, 64, 128, 4096, dtype="bfloat16"),
    Case("padded", TinyModelSpec(), 16, 32, 32, 1024, packed=False),
    Case("padded, 4096-token micro-batch", TinyModelSpec(), 32, 64, 64, 4096, packed=False),
]
DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def shape_of(spec: TinyModelSpec) -> ModelShape:
    return ModelShape(
        model_type="qwen2", hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, vocab_size=spec.vocab_size, tie_word_embeddings=True,
        attention_bias=True,
    )


def config_of(case: Case):
    return load_config("grpo", None, [
        f"data.max_prompt_length={case.prompt}", f"data.max_response_length={case.response}",
        f"data.train_batch_size={case.samples}", "rollout.n=1", f"actor.ppo_mini_batch_size={case.samples}",
        f"actor.ppo_max_token_len_per_gpu={case.token_budget}", "trainer.device=cpu",
        f"model.enable_gradient_checkpointing={str(case.gradient_checkpointing).lower()}", f"model.dtype={case.dtype}",
        f"actor.use_remove_padding={str(case.packed).lower()}",
    ])


def predicted_bytes(case: Case, phase: str = "update") -> int:
    plan = plan_memory(config_of(case), shape_of(case.spec), device_bytes=None, find_fixes=False)
    found = next(p for p in plan.phases if (p.role, p.phase) == ("actor", phase))
    if phase == "update":
        return found.peak - found.others
    return found.peak - found.others - found.grads - found.optimizer


def full_length_batch(samples: int, prompt: int, response: int, vocab: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, prompt + response), generator=g)
    return TrainBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(prompt + response).expand(
            samples, -1).clone(), response_mask=torch.ones(samples, response), group_ids=torch.arange(samples),
        rewards=torch.zeros(samples), rollout_logprobs=torch.zeros(samples, response), prompt_length=prompt,
        advantages=torch.randn(samples, response, generator=g),
    )


def measured_bytes(spec: TinyModelSpec, samples: int, prompt: int, response: int, token_budget: int,
                   gradient_checkpointing: bool, steps: int = 2, dtype: str = "float32", packed: bool = True) -> int:
    """Peak bytes of tensor storage over ``steps`` optimizer steps of the real engine (one rank, CPU,
    fp32 weights; ``dtype=bfloat16`` computes under autocast as the actor does on one rank)."""
    model = build_tiny_model(spec, seed=0)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    engine = TrainEngine(model, OptimSpec(lr=1e-3), torch.device("cpu"), mixed_precision=DTYPES[dtype])
    batch = full_length_batch(samples, prompt, response, spec.vocab_size)
    micro_batches, _ = token_budget_micro_batches(batch, token_budget, padded=not packed)
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        return agg_loss(-logprobs * mb.advantages, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    def steps_fn() -> None:
        for _ in range(steps):
            engine.optimizer_step(micro_batches, loss_fn, temperature=1.0, with_entropy=True, use_remove_padding=packed)

    before = live_bytes([*engine.model.parameters(), *engine.model.buffers(),
                         *(t for mb in micro_batches for t in vars(mb).values() if isinstance(t, torch.Tensor))])
    return before + peak_allocated_bytes(steps_fn)


def measured_forward_bytes(spec: TinyModelSpec, samples: int, prompt: int, response: int, token_budget: int,
                           dtype: str = "float32", packed: bool = True) -> int:
    """Peak bytes of a logprob forward (``compute_logprobs``, packed, one rank, CPU) of a frozen
    engine with fp32 weights, as the actor's."""
    engine = TrainEngine(build_tiny_model(spec, seed=0), None, torch.device("cpu"), mixed_precision=DTYPES[dtype])
    batch = full_length_batch(samples, prompt, response, spec.vocab_size)
    before = live_bytes([*engine.model.parameters(), *engine.model.buffers(),
                         *(t for t in vars(batch).values() if isinstance(t, torch.Tensor))])
    return before + peak_allocated_bytes(lambda: engine.compute_logprobs(
        batch, temperature=1.0, use_remove_padding=packed, max_token_len=token_budget))


@dataclass(frozen=True)
class RolloutCase:
    name: str
    spec: TinyModelSpec
    prompts: int
    n: int
    prompt: int
    response: int
    max_batch_size: int
    budget_mib: int


ROLLOUT_CASES = [
    RolloutCase("budget-bound slots", TinyModelSpec(), 16, 8, 64, 32, 256, 64),
    RolloutCase("max_batch_size-bound + prefix cache", TinyModelSpec(), 16, 8, 64, 32, 256, 256),
    RolloutCase("hidden 256, 21 decode rows", TinyModelSpec(hidden_size=256, intermediate_size=768), 8, 4, 128, 64, 32,
                64),
    RolloutCase("long responses + prefix cache", TinyModelSpec(), 32, 4, 48, 80, 64, 512),
]


def engine_kv_bytes(case: RolloutCase) -> int:
    """The native engine's KV cache and prefix cache after one round of ``case``'s requests."""
    engine = NativeEngine(model=build_tiny_model(case.spec, seed=0), eos_token_ids=[258], pad_token_id=256,
                          max_batch_size=case.max_batch_size, kv_cache_memory_bytes=case.budget_mib * MIB)
    g = torch.Generator().manual_seed(0)
    engine.generate_batch([
        GenerationRequest(torch.randint(0, 256, (case.prompt,), generator=g).tolist(),
                          SamplingParams(n=case.n, temperature=1.0, max_tokens=case.response, seed=i))
        for i in range(case.prompts)
    ])
    return engine.kv_cache_bytes + engine.prefix_cache_bytes


def main() -> int:
    torch.set_num_threads(1)
    ratios = []
    for phase in ("update", "logprob forward"):
        print(f"\nactor {phase}")
        print(f"{'configuration':<40}{'tokens':>8}{'predicted MiB':>15}{'measured MiB':>14}{'pred/meas':>11}{'s':>6}")
        for case in CASES:
            start = time.perf_counter()
            if phase == "update":
                measured = measured_bytes(case.spec, case.samples, case.prompt, case.response, case.token_budget,
                                          case.gradient_checkpointing, dtype=case.dtype, packed=case.packed)
            else:  # the logprob budget: 2x the training one, as the actor derives it
                measured = measured_forward_bytes(case.spec, case.samples, case.prompt, case.response,
                                                  2 * case.token_budget, dtype=case.dtype, packed=case.packed)
            predicted = predicted_bytes(case, phase)
            ratio = predicted / measured
            ratios.append(ratio)
            tokens = case.samples * (case.prompt + case.response)
            print(f"{case.name:<40}{tokens:>8}{predicted / MIB:>15.1f}{measured / MIB:>14.1f}{ratio:>11.3f}"
                  f"{time.perf_counter() - start:>6.1f}")
    print("\nrollout KV cache (slot rows + prefix cache), the engine's own accounting")
    print(f"{'configuration':<40}{'budget':>8}{'predicted MiB':>15}{'engine MiB':>14}{'pred/eng':>11}{'s':>6}")
    for rc in ROLLOUT_CASES:
        start = time.perf_counter()
        held = engine_kv_bytes(rc)
        predicted, _ = kv_cache_bytes(shape_of(rc.spec), budget=rc.budget_mib * MIB, dtype_bytes=4,
                                      longest=rc.prompt + rc.response, max_batch_size=rc.max_batch_size,
                                      prefix_tokens=prefix_cache_tokens(rc.prompt, rc.response, rc.n, rc.prompts))
        ratios.append(predicted / held)
        print(f"{rc.name:<40}{rc.budget_mib:>8}{predicted / MIB:>15.1f}{held / MIB:>14.1f}{predicted / held:>11.3f}"
              f"{time.perf_counter() - start:>6.1f}")
    inside = sum(0.85 <= r <= 1.15 for r in ratios)
    print(f"\nwithin ±15%: {inside} of {len(ratios)}; predicted/measured from {min(ratios):.3f} to {max(ratios):.3f}")
    return 0 if inside == len(ratios) else 1


if __name__ == "__main__":
    sys.exit(main())
