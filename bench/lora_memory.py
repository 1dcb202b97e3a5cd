"""Training memory of the actor with LoRA (``actor.lora.rank``) against full fine-tuning: the bytes
of its parameters (trainable and frozen), gradients and Adam state after one real update
(``ActorWorker.update_actor``), on a ~20M-parameter Qwen2-shaped model, fp32 on the CPU.

What is counted is what the actor holds, not activations (those scale with the batch, alike for
both, and ``model.enable_gradient_checkpointing`` bounds them). Full fine-tuning holds 16 bytes
per parameter in fp32 (weight 4, gradient 4, Adam's two moments 8); LoRA holds the frozen base (4
bytes per parameter by default, ``actor.lora.base_dtype=float32``; 2 with
``actor.lora.base_dtype=bfloat16``, which loads the base in bf16 and keeps only the adapters in
fp32) plus 16 bytes per adapter parameter. An adapter on a linear layer
``in -> out`` has ``r * (in + out)`` parameters.

Llama-2-7B (hidden 4096, MLP 11008, 32 layers, vocabulary 32000; 6.74e9 parameters), rank 16 on
every linear layer of the decoder (q, k, v, o: r * (4096 + 4096) each; gate, up, down:
r * (4096 + 11008) each) has 32 * 16 * (4 * 8192 + 3 * 15104) = 39,976,960 adapter parameters
(0.59%):

    full fine-tuning   16 B x 6.74e9                          = 107.8 GB
    LoRA, fp32 base     4 B x 6.74e9 + 16 B x 4.00e7 = 27.0 + 0.64 = 27.6 GB   (3.9x less)
    LoRA, bf16 base     2 B x 6.74e9 + 16 B x 4.00e7 = 13.5 + 0.64 = 14.1 GB   (7.6x less;
                                                                               actor.lora.base_dtype=bfloat16)

A weight sync sends the whole model merged (``actor.lora.sync=merged``: every engine takes it), or
only A, B and a scaling per adapted layer (``actor.lora.sync=adapter``); the bench prints both.

    python bench/lora_memory.py            # ~30 s on 2 cores
    python bench/lora_memory.py --rank 8
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

LLAMA2_7B = dict(hidden=4096, intermediate=11008, layers=32, vocab=32000, heads=32, kv_heads=32)


def llama2_7b_figures(rank: int) -> dict[str, float]:
    """The docstring's formula: parameters, adapter parameters and bytes for full and LoRA training."""
    h, i, n, v = (LLAMA2_7B[k] for k in ("hidden", "intermediate", "layers", "vocab"))
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # attention, MLP, two RMSNorms
    params = n * per_layer + 2 * v * h + h  # untied embeddings and head, final norm
    adapter = n * rank * (4 * (h + h) + 3 * (h + i))
    return {"params": params, "adapter": adapter, "full_gb": 16 * params / 1e9,
            "lora_fp32_gb": (4 * params + 16 * adapter) / 1e9, "lora_bf16_gb": (2 * params + 16 * adapter) / 1e9}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(model_dir: str, rank: int, base_dtype: str = "float32") -> dict[str, int]:
    from hybridflow.config.schema import ActorConfig
    from hybridflow.types import Trajectory, collate_trajectories
    from hybridflow.workers.actor import ActorSetup, ActorWorker

    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False)
    cfg.lora.rank, cfg.lora.alpha, cfg.lora.base_dtype = rank, 2.0 * max(rank, 1), base_dtype
    setup = ActorSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                       rollout_n=4, total_optimizer_steps=1, max_response_length=16, max_prompt_length=8)
    actor = ActorWorker(0, 1, cfg, setup)
    g = torch.Generator().manual_seed(0)
    trajectories = [Trajectory(torch.randint(0, 256, (8,), generator=g).tolist(),
                               torch.randint(0, 256, (16,), generator=g).tolist(), [1] * 16, [-1.0] * 16, "stop",
                               group_id=k // 4) for k in range(8)]
    batch = collate_trajectories(trajectories, pad_token_id=256)
    batch.advantages = torch.randn(8, 1, generator=g) * batch.response_mask
    actor.update_actor(batch)
    model, optimizer = actor.engine.model, actor.engine.optimizer
    params = list(model.parameters())
    sync = {"sync_merged_bytes": _nbytes(t for _, t in actor.weights_for_sync())}
    if actor.lora is not None:
        sync["sync_adapter_bytes"] = _nbytes(t for _, t in actor.adapter_for_sync())
    return sync | {
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "trainable_bytes": _nbytes(p for p in params if p.requires_grad),
        "frozen_bytes": _nbytes(p for p in params if not p.requires_grad),
        "grad_bytes": _nbytes(p.grad for p in params if p.grad is not None),
        "adam_bytes": _nbytes(v for state in optimizer.state.values() for v in state.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0),
    }


def main() -> None:
    from hybridflow.models.tiny import TinyModelSpec, write_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=7, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=272)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "model", spec, seed=0))
        rows = {"full fine-tuning": measure(model_dir, 0), f"LoRA rank {args.rank}": measure(model_dir, args.rank),
                f"LoRA r{args.rank} bf16 base": measure(model_dir, args.rank, "bfloat16")}
    print(f"model: {rows['full fine-tuning']['params'] / 1e6:.1f}M parameters, fp32 compute, CPU; bytes after one "
          f"update")
    print(f"{'':18s} {'trainable':>12s} {'params MiB':>11s} {'frozen MiB':>11s} {'grads MiB':>10s} {'Adam MiB':>9s} "
          f"{'train MiB':>10s} {'total MiB':>10s}")
    totals = {}
    for name, r in rows.items():
        mib = {k: v / 2**20 for k, v in r.items() if k.endswith("bytes")}
        train = mib["trainable_bytes"] + mib["grad_bytes"] + mib["adam_bytes"]
        totals[name] = (train, train + mib["frozen_bytes"])
        print(f"{name:18s} {r['trainable_params']:>12,d} {mib['trainable_bytes']:>11.2f} {mib['frozen_bytes']:>11.2f} "
              f"{mib['grad_bytes']:>10.2f} {mib['adam_bytes']:>9.2f} {train:>10.2f} {train + mib['frozen_bytes']:>10.2f}")
    full, lora = totals["full fine-tuning"], totals[f"LoRA rank {args.rank}"]
    bf16 = totals[f"LoRA r{args.rank} bf16 base"]
    print(f"ratio full / LoRA: trainable params + grads + Adam {full[0] / lora[0]:.1f}x; "
          f"with the frozen base {full[1] / lora[1]:.2f}x (fp32 base), {full[1] / bf16[1]:.2f}x (bf16 base)")
    lora_row = rows[f"LoRA rank {args.rank}"]
    merged_mib, adapter_mib = lora_row["sync_merged_bytes"] / 2**20, lora_row["sync_adapter_bytes"] / 2**20
    merged_bf16_mib = rows[f"LoRA r{args.rank} bf16 base"]["sync_merged_bytes"] / 2**20
    print(f"one weight sync to the rollout: merged {merged_mib:.2f} MiB (the whole model; {merged_bf16_mib:.2f} MiB "
          f"from a bf16 base), actor.lora.sync=adapter {adapter_mib:.2f} MiB ({merged_mib / adapter_mib:.1f}x less)")
    f7 = llama2_7b_figures(args.rank)
    print(f"Llama-2-7B shapes, rank {args.rank} on every decoder linear layer: {f7['adapter']:,} adapter parameters "
          f"({100 * f7['adapter'] / f7['params']:.2f}% of {f7['params'] / 1e9:.2f}B); full {f7['full_gb']:.1f} GB, "
          f"LoRA {f7['lora_fp32_gb']:.1f} GB with an fp32 base ({f7['full_gb'] / f7['lora_fp32_gb']:.1f}x), "
          f"{f7['lora_bf16_gb']:.1f} GB with a bf16 one ({f7['full_gb'] / f7['lora_bf16_gb']:.1f}x)")


if __name__ == "__main__":
    main()
