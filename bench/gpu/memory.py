"""Step 4 of the GPU kit: memory, predicted against measured on the device.

1. The memory planner (``hybridflow.config.plan.plan_memory``, the actor's update phase) against
   ``torch.cuda.max_memory_allocated`` over two optimizer steps of the real ``TrainEngine`` (the
   second with AdamW's state allocated), for three configurations of the Qwen2.5-0.5B shape.
2. Rollout sleep: level 1 frees the KV cache, level 2 the weights too. Freed = the device's free
   memory after ``sleep`` minus before (``torch.cuda.mem_get_info``); claimed = what the engine
   held (``kv_cache_bytes + prefix_cache_bytes``, plus ``weight_bytes`` at level 2). After
   ``wake_up`` (and, at level 2, a full weight update) the engine must generate the same greedy
   tokens as before it slept.
3. Offload: the optimizer state off the device between steps (``actor.fsdp_config.optimizer_offload``:
   allocated bytes after a step drop by Adam's two fp32 moments), and FSDP2's parameter offload
   over a one-rank group (``param_offload``: the parameters' shards live on the CPU).

    python -m bench.gpu.memory --json memory.json [--dry-run]
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from bench.gpu.common import (
    EOS_TOKEN_ID, PAD_TOKEN_ID, QWEN25_05B, Results, Shape, build_qwen2, free_device_memory, pick_device,
    step_arguments,
)
from bench.gpu.update import full_batch, grpo_loss
from hybridflow.config.budget import ModelShape
from hybridflow.config.loader import load_config
from hybridflow.config.plan import plan_memory
from hybridflow.inference.native import NativeEngine
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.training.micro_batches import token_budget_micro_batches
from hybridflow.types import GenerationRequest, SamplingParams
from hybridflow.utils.memory import live_bytes, peak_allocated_bytes

GIB = 2**30


@dataclass(frozen=True)
class PlanCase:
    name: str
    samples: int
    prompt: int
    response: int
    token_budget: int
    dtype: str = "bfloat16"
    checkpointing: bool = False


def plan_cases(dry_run: bool) -> list[PlanCase]:
    if dry_run:
        return [PlanCase("toy bf16", 4, 8, 24, 64), PlanCase("toy fp32", 4, 8, 24, 64, dtype="float32")]
    return [
        PlanCase("bf16, 8k-token micro-batches", 16, 256, 768, 8192),
        PlanCase("bf16, 16k-token micro-batch, checkpointing", 16, 256, 768, 16384, checkpointing=True),
        PlanCase("fp32, 4k-token micro-batches", 8, 256, 768, 4096, dtype="float32"),
    ]


def model_shape(shape: Shape) -> ModelShape:
    return ModelShape(model_type="qwen2", hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                      num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
                      num_key_value_heads=shape.num_key_value_heads, vocab_size=shape.vocab_size,
                      tie_word_embeddings=shape.tie_word_embeddings, attention_bias=True)


def predicted_update_bytes(case: PlanCase, shape: Shape, device: torch.device) -> int:
    cfg = load_config("grpo", None, [
        f"data.max_prompt_length={case.prompt}", f"data.max_response_length={case.response}",
        f"data.train_batch_size={case.samples}", "rollout.n=1", f"actor.ppo_mini_batch_size={case.samples}",
        f"actor.ppo_max_token_len_per_gpu={case.token_budget}", f"trainer.device={device.type}",
        f"model.enable_gradient_checkpointing={str(case.checkpointing).lower()}", f"model.dtype={case.dtype}",
        "actor.use_remove_padding=true",
    ])
    plan = plan_memory(cfg, model_shape(shape), device_bytes=None, find_fixes=False)
    found = next(p for p in plan.phases if (p.role, p.phase) == ("actor", "update"))
    return found.peak - found.others


def measured_update_bytes(case: PlanCase, shape: Shape, device: torch.device) -> int:
    release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device):
        model = build_qwen2(shape, case.prompt + case.response)
    if case.checkpointing:
        model.gradient_checkpointing_enable()
    mixed = torch.bfloat16 if case.dtype == "bfloat16" else None
    engine = TrainEngine(model, OptimSpec(lr=1e-6), device, mixed_precision=mixed)
    batch = full_batch(case.samples, case.prompt, case.response, shape.vocab_size)
    micro_batches, _ = token_budget_micro_batches(batch, case.token_budget)
    loss_fn = grpo_loss(batch)

    def steps() -> None:
        for _ in range(2):
            engine.optimizer_step(micro_batches, loss_fn, temperature=1.0, with_entropy=True, use_remove_padding=True)

    if device.type == "cuda":
        steps()
        peak = torch.cuda.max_memory_allocated(device)
    else:
        before = live_bytes([*engine.model.parameters(), *engine.model.buffers()])
        peak = before + peak_allocated_bytes(steps)
    return int(peak)  # the engine goes with this frame; the caller's release() frees its memory


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def greedy(engine: NativeEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = engine.generate_batch([GenerationRequest(prompt_ids=p, params=params, request_id=str(i))
                                 for i, p in enumerate(prompts)])
    return [group[0].response_ids for group in out]


def sleep_check(results: Results, shape: Shape, device: torch.device, batch: int, prompt: int, max_tokens: int) -> None:
    with torch.device(device):
        model = build_qwen2(shape, prompt + max_tokens)
    weights = {k: v.detach().to("cpu", torch.bfloat16, copy=True) for k, v in model.state_dict().items()}
    engine = NativeEngine(model=model, eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
                          max_batch_size=batch, device=device, dtype=torch.bfloat16)
    prompts = torch.randint(2, shape.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    reference = greedy(engine, prompts, max_tokens)
    for level in (1, 2):
        claimed = engine.kv_cache_bytes + engine.prefix_cache_bytes + (engine.weight_bytes if level == 2 else 0)
        free_before = free_device_memory(device)
        engine.sleep(level=level)
        free_after = free_device_memory(device)
        figures: dict[str, object] = {"claimed_gib": round(claimed / GIB, 3)}
        if free_before is not None and free_after is not None:
            freed = free_after - free_before
            figures.update(freed_gib=round(freed / GIB, 3), freed_over_claimed=round(freed / max(claimed, 1), 3))
        engine.wake_up()
        if level == 2:
            engine.update_weights(weights.items())
        figures["same_greedy_tokens_after_wake"] = greedy(engine, prompts, max_tokens) == reference
        results.put(f"sleep/level_{level}", figures)
    del engine, model
    release(device)


def optimizer_offload_check(results: Results, shape: Shape, device: torch.device) -> None:
    batch = full_batch(4, 16, 48, shape.vocab_size)
    micro_batches, _ = token_budget_micro_batches(batch, 256)
    figures = {}
    for offload in (False, True):
        release(device)
        with torch.device(device):
            model = build_qwen2(shape, 64)
        engine = TrainEngine(model, OptimSpec(lr=1e-6), device, mixed_precision=torch.bfloat16,
                             offload_optimizer=offload)
        engine.optimizer_step(micro_batches, grpo_loss(batch), temperature=1.0, with_entropy=False,
                              use_remove_padding=True)
        state_devices = sorted({v.device.type for s in engine.optimizer.state.values() for k, v in s.items()
                                if isinstance(v, torch.Tensor) and k != "step"})
        key = "offload" if offload else "resident"
        figures[f"{key}_state_devices"] = state_devices
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            figures[f"{key}_allocated_after_step_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 3)
        params = sum(p.numel() for p in engine.model.parameters())
        figures["adam_moments_gib"] = round(params * 8 / GIB, 3)
        del engine, model
    if device.type == "cuda":
        figures["moved_off_gib"] = round(figures["resident_allocated_after_step_gib"]
                                         - figures["offload_allocated_after_step_gib"], 3)
    results.put("offload/optimizer", figures)


def param_offload_check(results: Results, shape: Shape, device: torch.device) -> None:
    """FSDP2's CPUOffloadPolicy over a one-rank group: parameters live on the CPU between uses."""
    distributed.init_process_group(rank=0, world_size=1, master_addr="127.0.0.1",
                                   master_port=distributed.free_port(), device=device)
    try:
        release(device)
        allocated_before = torch.cuda.memory_allocated(device)
        model = build_qwen2(shape, 64)
        engine = TrainEngine(model, OptimSpec(lr=1e-6), device, mixed_precision=torch.bfloat16, data_parallel=True,
                             offload_params=True)
        batch = full_batch(4, 16, 48, shape.vocab_size)
        micro_batches, _ = token_budget_micro_batches(batch, 256)
        engine.optimizer_step(micro_batches, grpo_loss(batch), temperature=1.0, with_entropy=False,
                              use_remove_padding=True)
        torch.cuda.synchronize(device)
        devices = sorted({p.to_local().device.type if hasattr(p, "to_local") else p.device.type
                          for p in engine.model.parameters()})
        params = sum(p.numel() for p in engine.model.parameters())
        results.put("offload/params_fsdp2", {
            "parameter_devices": devices, "fp32_params_gib": round(params * 4 / GIB, 3),
            "allocated_after_step_gib": round((torch.cuda.memory_allocated(device) - allocated_before) / GIB, 3)})
        del engine, model
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    args = step_arguments(__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    results = Results(args.json, "memory", args.dry_run)
    device = pick_device(args.dry_run)
    shape = QWEN25_05B.toy() if args.dry_run else QWEN25_05B
    for case in plan_cases(args.dry_run):
        with results.guard(f"planner {case.name}"):
            predicted = predicted_update_bytes(case, shape, device)
            measured = measured_update_bytes(case, shape, device)
            release(device)
            results.put(f"planner/{case.name}", {"predicted_gib": round(predicted / GIB, 3),
                                                 "measured_gib": round(measured / GIB, 3),
                                                 "predicted_over_measured": round(predicted / measured, 3)})
    with results.guard("sleep levels"):
        sleep_check(results, shape, device, *((4, 8, 4) if args.dry_run else (64, 256, 32)))
    with results.guard("optimizer offload"):
        optimizer_offload_check(results, shape, device)
    if device.type == "cuda":
        with results.guard("param offload (fsdp2)"):
            param_offload_check(results, shape, device)
    else:
        results.put("offload/params_fsdp2", "needs CUDA (CPUOffloadPolicy moves device parameters to the host)")


if __name__ == "__main__":
    main()
