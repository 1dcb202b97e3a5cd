"""A reward model's score of a token sequence: its one-label head on the sequence's last real token.

One home for the scoring rule, so that a reward model scores the same way where it is trained
(``hybridflow rm``: ``TrainEngine``'s ``output="scores"``) and where it serves a run
(``reward_model.enable``: ``hybridflow.workers.reward_model``).

The pooling is ours, not the classifier's: transformers' ``*ForSequenceClassification`` finds the
last token by looking for ``pad_token_id``, which misreads an answer that ends in the pad token
(often EOS). The whole model's forward runs (not the backbone and the head apart), so a model
sharded with FSDP2 gathers its head and embeddings with the root module and reduces their
gradients; the head's output at every position is read off by a forward hook and the classifier's
own pooled output is discarded.

The head runs in fp32 whatever the model's precision (as TRL's and verl's value and score heads do):
under bf16 autocast, or with bf16 weights, a bf16 score has 8 significant bits, so two answers that
differ in one digit often score exactly alike (50 of 256 held-out built-in pairs tied after 30 steps
of ``hybridflow rm`` on an AMD EPYC Zen 4, each counted wrong by ``rm/accuracy``), and the
Bradley-Terry loss sees the margin rounded. Only the head's one output per position is computed in
fp32; the body keeps its precision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybridflow.models.loading import value_head


def fp32_head_output(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``head`` on ``hidden`` computed in fp32, outside any autocast (the weights are cast, not changed:
    their gradients reach the parameters as they are).  # (..., H) -> (..., 1) float32"""
    bias = None if head.bias is None else head.bias.float()
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)


def per_token_scores(model: torch.nn.Module, inputs: Mapping[str, Any],
                     forward: Callable[..., Any] | None = None) -> torch.Tensor:
    """The head's score at every position of one whole forward of ``model`` on ``inputs``, in fp32
    (``forward``: how to call it, e.g. under autocast; default ``model`` itself).  # (B, L)"""
    captured: list[torch.Tensor] = []

    def fp32_head(module: torch.nn.Module, args: tuple[Any, ...], _out: torch.Tensor) -> torch.Tensor:
        # Replaces the head's output (a forward hook's return value does), so the classifier's own
        # pooling, discarded, reads the same fp32 scores.
        out = fp32_head_output(module, args[0])
        captured.append(out)
        return out

    handle = value_head(model).register_forward_hook(fp32_head)
    try:
        (forward or model)(**inputs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"{type(model).__name__}'s forward ran its head {len(captured)} times; expected once")
    return captured[0][..., 0]


def last_token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last real column, for left or right padding.  # (B, L) -> (B,)"""
    width = attention_mask.shape[1]
    return width - 1 - attention_mask.flip(1).int().argmax(dim=1)


def last_token_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None,
                      forward: Callable[..., Any] | None = None) -> torch.Tensor:
    """The score of each padded row: the head at its last real token, in fp32.  # (B, L) -> (B,)"""
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    scores = per_token_scores(model, inputs, forward)  # (B, L)
    rows = torch.arange(input_ids.shape[0], device=scores.device)
    return scores[rows, last_token_positions(attention_mask).to(scores.device)].float()


__all__ = ["fp32_head_output", "last_token_positions", "last_token_scores", "per_token_scores"]
