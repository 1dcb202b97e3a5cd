"""Step 3 of the GPU kit: one GRPO actor update on the Qwen2.5-0.5B shape: tokens/s, MFU and peak
memory, on one rank as a one-GPU run trains and on FSDP2 over a one-rank NCCL group, with and
without the chunked LM head and gradient checkpointing.

Workload: ``samples`` sequences of ``prompt + response`` random tokens (all full length), GRPO
advantages (random, one per sequence), the vanilla clipped policy loss with token-mean
aggregation, packed token-budget micro-batches, bf16 compute over fp32 master weights, AdamW.
One optimizer step per timing; median of ``repeats`` after a warm-up step.

    FLOPs/step = 6 N T + 6 x sum(L^2) x hidden x layers     (N: matmul parameters incl. the LM head;
                                                             T tokens; the attention term is verl's)
    MFU = FLOPs/step / time / peak,  peak = 989 TFLOP/s (H100/H200 SXM dense bf16 datasheet); the
    fraction of the bf16 matrix rate measured here is reported beside it.

Anchor: prime-rl reports 11% MFU for Qwen3-0.6B at 16k tokens on one H100.

    python -m bench.gpu.update --json update.json [--dry-run]
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from bench.gpu.common import (
    QWEN25_05B, Results, Shape, build_qwen2, matmul_flops, median_time, pick_device, step_arguments,
)
from hybridflow.algorithms import batch_counts
from hybridflow.algorithms.policy_loss import LossInputs, PPOClipParams, get_policy_loss
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.training.micro_batches import token_budget_micro_batches
from hybridflow.types import TrainBatch

DATASHEET_BF16_FLOPS = 989e12


@dataclass(frozen=True)
class Variant:
    name: str
    fsdp2: bool = False
    fused_lm_head: bool = True
    checkpointing: bool = False


VARIANTS = [
    Variant("one rank"),
    Variant("one rank, no chunked LM head", fused_lm_head=False),
    Variant("one rank, gradient checkpointing", checkpointing=True),
    Variant("fsdp2 (1 rank)", fsdp2=True),
    Variant("fsdp2 (1 rank), gradient checkpointing", fsdp2=True, checkpointing=True),
]


def full_batch(samples: int, prompt: int, response: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (samples, prompt + response), generator=g)
    return TrainBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(prompt + response).expand(samples, -1).clone(),
        response_mask=torch.ones(samples, response), group_ids=torch.arange(samples) // 4,
        rewards=torch.zeros(samples), rollout_logprobs=torch.full((samples, response), -2.0), prompt_length=prompt,
        advantages=torch.randn(samples, 1, generator=g).expand(-1, response).clone(),
        old_logprobs=torch.full((samples, response), -2.0),
    )


def grpo_loss(batch: TrainBatch):
    num_tokens, _ = batch_counts(batch.response_mask)
    loss = get_policy_loss("vanilla")
    params = PPOClipParams(clip_ratio_low=0.2, clip_ratio_high=0.28)

    def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        return loss(LossInputs(old_logprobs=mb.old_logprobs, logprobs=logprobs, advantages=mb.advantages,
                               response_mask=mb.response_mask, global_num_tokens=num_tokens), params)

    return loss_fn


def step_flops(matmul_params: int, shape: Shape, samples: int, length: int) -> float:
    tokens = samples * length
    return 6 * matmul_params * tokens + 6 * samples * length**2 * shape.hidden_size * shape.num_hidden_layers


def run_variant(variant: Variant, shape: Shape, batch: TrainBatch, token_budget: int, repeats: int,
                device: torch.device) -> dict[str, float]:
    with torch.device(device):
        model = build_qwen2(shape, batch.input_ids.shape[1])
    if variant.checkpointing:
        model.gradient_checkpointing_enable()
    engine = TrainEngine(model, OptimSpec(lr=1e-6), device, mixed_precision=torch.bfloat16,
                         data_parallel=variant.fsdp2, fused_lm_head=variant.fused_lm_head)
    micro_batches, _ = token_budget_micro_batches(batch, token_budget)
    loss_fn = grpo_loss(batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        engine.optimizer_step(micro_batches, loss_fn, temperature=1.0, with_entropy=True, use_remove_padding=True)

    seconds = median_time(step, device, repeats)
    out = {"step_s": round(seconds, 4), "micro_batches": len(micro_batches)}
    if device.type == "cuda":
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out  # the engine goes with this frame; the caller frees the device's cache


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    args = step_arguments(__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    results = Results(args.json, "update", args.dry_run)
    device = pick_device(args.dry_run)
    if args.dry_run:
        shape, samples, prompt, response, budget, repeats = QWEN25_05B.toy(), 4, 8, 24, 64, 1
    else:
        shape, samples, prompt, response, budget, repeats = QWEN25_05B, 16, 256, 768, 8192, 3
    length = prompt + response
    distributed.init_process_group(rank=0, world_size=1, master_addr="127.0.0.1",
                                   master_port=distributed.free_port(), device=device)
    with torch.device("meta"):
        meta = build_qwen2(shape, length)
    # Parameters in matmuls: all but the input embedding, plus the LM head (tied: the same matrix).
    matmul_params = sum(p.numel() for p in meta.parameters()) - (0 if shape.tie_word_embeddings else
                                                                 meta.get_input_embeddings().weight.numel())
    flops = step_flops(matmul_params, shape, samples, length)
    measured_peak = None
    with results.guard("bf16 matmul rate"):
        measured_peak = matmul_flops(device, 8192 if device.type == "cuda" else 256, torch.bfloat16)
    results.put("settings", {"shape": shape.name, "samples": samples, "prompt": prompt, "response": response,
                             "tokens_per_step": samples * length, "token_budget": budget, "repeats": repeats,
                             "flops_per_step": flops, "matmul_params": matmul_params,
                             "measured_bf16_matmul_tflop_s": round(measured_peak / 1e12, 1) if measured_peak else None})
    batch = full_batch(samples, prompt, response, shape.vocab_size)
    for variant in VARIANTS:
        with results.guard(f"update {variant.name}"):
            out = run_variant(variant, shape, batch, budget, repeats, device)
            release(device)
            out["tokens_s"] = round(samples * length / out["step_s"], 1)
            achieved = flops / out["step_s"]
            out["tflop_s"] = round(achieved / 1e12, 2)
            if device.type == "cuda":
                out["mfu_datasheet"] = round(achieved / DATASHEET_BF16_FLOPS, 4)
            if measured_peak:
                out["fraction_of_measured_matmul"] = round(achieved / measured_peak, 4)
            results.put(f"update/{variant.name}", out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
