"""The training engine's optimizer and learning-rate schedule: AdamW over the parameters that
require grad, a constant or cosine schedule after a linear warm-up, and the step itself (global
gradient clipping; a non-finite norm skips the step and holds the schedule).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.training import distributed


@dataclass
class OptimSpec:
    lr: float
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    scheduler: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    total_steps: int = 1
    grad_clip: float = 1.0
    # Parameter-name prefix -> its own peak lr (the schedule scales it alike): a new, zero-initialised head
    # (a reward model's ``score``) learns at a higher rate than the pretrained body it reads.
    group_lrs: tuple[tuple[str, float], ...] = ()


def lr_lambda(spec: OptimSpec) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if spec.warmup_steps > 0 and step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        if spec.scheduler == "constant":
            return 1.0
        if spec.scheduler == "cosine":
            span = max(1, spec.total_steps - spec.warmup_steps)
            progress = min(1.0, (step - spec.warmup_steps) / span)
            cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
            return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine
        raise ValueError(f"unknown lr scheduler {spec.scheduler!r}; expected constant or cosine")

    return factor


def build_optimizer(
    model: torch.nn.Module, spec: OptimSpec
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the parameters that require grad (a LoRA model's adapters only), and its schedule; the
    parameters named by ``spec.group_lrs`` form groups of their own lr after the rest."""
    optimizer = torch.optim.AdamW(
        param_groups(model, spec),
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        betas=tuple(spec.betas),
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))


def param_groups(model: torch.nn.Module, spec: OptimSpec) -> list[dict]:
    """The trained parameters as AdamW's groups: the rest at ``spec.lr`` first (one group, as without
    ``group_lrs``), then one group per ``group_lrs`` prefix. A prefix that names no trained parameter is
    an error: the lr it sets would silently not apply."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups: list[dict] = []
    taken: set[str] = set()
    for prefix, lr in spec.group_lrs:
        params = [p for n, p in named if n.startswith(prefix) and n not in taken]
        if not params:
            raise ValueError(f"optimizer group {prefix!r}: no trained parameter's name starts with it")
        taken.update(n for n, _ in named if n.startswith(prefix))
        groups.append({"params": params, "lr": lr})
    return [{"params": [p for n, p in named if n not in taken]}, *groups]


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Adam's moments to ``device`` (no-op where they already are)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and key != "step":
                state[key] = value.to(device, non_blocking=True)


def clip_and_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
    grad_clip: float, device: torch.device, offload_optimizer: bool,
) -> tuple[torch.Tensor, bool]:
    """Clip the accumulated gradients to ``grad_clip`` (none when <= 0) and step the optimizer and
    schedule: (the global gradient norm, whether the step was taken). With ``offload_optimizer``
    Adam's moments come to ``device`` for the step only."""
    params = [p for p in model.parameters() if p.grad is not None]
    # Sharded gradients (DTensors) give the norm over every rank's shard: the global norm.
    grad_norm = distributed.full_tensor(
        torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf")))
    if not torch.isfinite(grad_norm):
        # A non-finite gradient would poison the weights and Adam's moments: skip the step.
        # The LR schedule holds too, so a skipped step costs nothing but its data.
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, False
    move_optimizer_state(optimizer, device)
    optimizer.step()
    scheduler.step()
    if offload_optimizer:
        move_optimizer_state(optimizer, torch.device("cpu"))
    return grad_norm, True
