"""Ulysses sequence parallelism (DeepSpeed-Ulysses, verl's ``ulysses_sequence_parallel_size``).

The ``sp`` ranks of a sequence-parallel group run the same packed micro-batch, each on a
contiguous 1/sp of its tokens: embeddings, MLPs, norms and the LM head only ever see the local
chunk, so activations per rank shrink by sp. Attention needs every token, so around it an
all-to-all switches from the sequence split to a head split (each rank gets all N tokens for
H/sp of the heads), the model's own varlen attention runs on that with the pack's full
``cu_seqlens``, and a second all-to-all switches back. Heads are independent, so this is the
same maths as one rank; the exchanges are permutations, so their backward is the opposite
exchange.

- ``shard_pack``: the pack padded to a multiple of sp (the padding is one extra sequence that
  no logit reads) and this rank's chunk: its tokens, their *global* position ids (rotary sees
  the same positions as on one rank, restarting per packed sequence), the full cu_seqlens, and
  the response-predicting positions that fall in the chunk.
- ``enable_ulysses_attention``: wraps the model's varlen attention (``VARLEN_ATTENTION`` on
  CPU, flash-attention on GPU) in the exchanges; calls without a group are handed to it unchanged.
- ``UlyssesShard.gather``: per-token results of the local chunk gathered in pack order on every
  rank of the group, so losses see the whole micro-batch as on one rank.

Gradients. Every rank of the group computes the same loss from the gathered tokens; a token's
gradient enters the backward only on the rank that computed it, so the group's gradients sum to
the gradient of one copy of the loss. FSDP averages gradients over the whole world, sp copies
included, while the actor's loss normalisation counts tokens over the whole world too (each
group's tokens sp times) and multiplies by the world size: ``gather``'s backward scales by sp so
that the two conventions meet, and N ranks at any sp train like one rank on the same batch.

Communication: ``all_to_all_single`` runs on gloo (checked with torch 2.13, as ``all_to_all``)
and NCCL alike, so one code path serves CPU and GPU.

Shapes: N packed tokens (padded to a multiple of sp), n = N/sp local tokens, H heads, D head
dim, M response tokens in the pack, m of them predicted in the local chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.training.packing import VARLEN_ATTENTION, PackedBatch, append_pad_sequence, packed_model_inputs
from hybridflow.types import TrainBatch

ULYSSES_PREFIX = "hybridflow_ulysses_"
# The inner implementations that can run a packed row from cu_seqlens alone (no N×N mask).
VARLEN_IMPLEMENTATIONS = (VARLEN_ATTENTION, "flash_attention_2", "flash_attention_3")
GROUP_KWARG = "sequence_parallel_group"


# ------------------------------------------------------------------------------ exchanges
def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut ``x`` into sp equal pieces along ``scatter_dim``, send piece j to rank j of ``group``,
    and concatenate what every rank sent here along ``gather_dim``, in rank order."""
    sp = dist.get_world_size(group)
    # One buffer with the pieces stacked on a leading dim, exchanged in place of a list of
    # pieces (which the backends copy into one buffer and back again).
    pieces = x.unflatten(scatter_dim, (sp, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)
    # received[j] is rank j's piece: put the rank dim before gather_dim and merge them (rank-major).
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # A permutation of the group's elements: its adjoint is the opposite exchange.
        return all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """(1, H, n, D) local tokens, all heads -> (1, H/sp, N, D) all tokens, this rank's heads."""
    return _AllToAll.apply(x, group, 1, 2)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(1, N, H/sp, D) attention output -> (1, n, H, D): back to the local tokens, all heads."""
    return _AllToAll.apply(x, group, 1, 2)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group, grad_scale: float) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.grad_scale = counts, rank, grad_scale
        longest = max(max(counts), 1)  # a group with no response token still sends a row
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]] * ctx.grad_scale, None, None, None, None


# ------------------------------------------------------------------------------- attention
def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, n, D)
    key: torch.Tensor,  # (1, H_kv, n, D)
    value: torch.Tensor,  # (1, H_kv, n, D)
    attention_mask: torch.Tensor | None,
    *args: Any,
    inner: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: ``inner`` between the two exchanges when the forward
    carries a ``sequence_parallel_group``, else ``inner`` alone."""
    group = kwargs.pop(GROUP_KWARG, None)
    if group is None:
        return inner(module, query, key, value, attention_mask, *args, **kwargs)
    if attention_mask is not None:
        raise ValueError("Ulysses attention runs packed rows only (no attention mask)")
    sp = dist.get_world_size(group)
    if key.shape[1] < sp:
        # Fewer KV heads than ranks (GQA): each rank needs the KV head of its query heads, so
        # every KV head is repeated sp/H_kv times (rank j's query heads read KV head j*H_kv/sp).
        key, value = (x.repeat_interleave(sp // x.shape[1], dim=1) for x in (key, value))
    q, k, v = (seq_to_head(x, group) for x in (query, key, value))
    out, _ = inner(module, q, k, v, None, *args, **kwargs)  # (1, N, H/sp, D)
    return head_to_seq(out, group), None


def check_heads(config: Any, sp: int) -> None:
    """The attention heads must split evenly over the group (KV heads: or repeat evenly)."""
    heads = int(getattr(config, "num_attention_heads"))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % sp or (kv_heads % sp and sp % kv_heads):
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} must divide the model's {heads} attention heads and divide or be "
            f"a multiple of its {kv_heads} key-value heads"
        )


def enable_ulysses_attention(model: Any, sp: int) -> str:
    """Wrap the model's attention in the Ulysses exchanges; returns the implementation's name.
    The model must already run a varlen implementation (``VARLEN_IMPLEMENTATIONS``): after the
    exchange each rank attends over the whole pack with its cu_seqlens, never an N×N mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    check_heads(model.config, sp)
    current = model.config._attn_implementation
    if current.startswith(ULYSSES_PREFIX):
        return current
    if current not in VARLEN_IMPLEMENTATIONS:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} needs a varlen attention ({', '.join(VARLEN_IMPLEMENTATIONS)}); "
            f"the model runs {current!r} (load it with sdpa or flash_attention_2)"
        )
    name = ULYSSES_PREFIX + current
    AttentionInterface.register(name, functools.partial(ulysses_attention, inner=ALL_ATTENTION_FUNCTIONS[current]))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)
    return name


# ---------------------------------------------------------------------------------- shards
@dataclass
class UlyssesShard:
    """This rank's chunk of a pack (``shard_pack``)."""

    input_ids: torch.Tensor  # (1, n)
    position_ids: torch.Tensor  # (1, n) global positions of the chunk, restarting per sequence
    cu_seqlens: torch.Tensor  # (S+1,) int32 of the whole padded pack
    max_seqlen: int
    logit_positions: torch.Tensor  # (m,) local positions whose logits predict a response token
    labels: torch.Tensor  # (m,)
    counts: list[int]  # m of every rank of the group, in rank order (they sum to M)
    rank: int
    group: Any

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the model's forward over the chunk (``PackedBatch.model_inputs``
        for the local tokens, the whole pack's cu_seqlens, and the group for the attention)."""
        return packed_model_inputs(self.input_ids, self.position_ids, self.logit_positions, self.cu_seqlens,
                                   self.max_seqlen) | {GROUP_KWARG: self.group}

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token results of the chunk (m, ...) -> the whole pack's (M, ...) on every rank,
        in ``PackedBatch.logit_positions`` order. Differentiable; see the module docstring for
        the backward's scale."""
        sp = len(self.counts)
        return _GatherRows.apply(local, self.counts, self.rank, self.group, float(sp))


def shard_pack(packed: PackedBatch, group) -> UlyssesShard:
    """This rank's contiguous 1/sp of ``packed``, padded to a multiple of sp (module docstring)."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, positions = packed.input_ids, packed.position_ids
    total = ids.shape[1]
    pad = -total % sp
    cu, longest = packed.cu_seqlens, packed.max_seqlen
    if pad:
        ids, positions, cu, longest = append_pad_sequence(ids, positions, cu, longest, pad)
    n = (total + pad) // sp
    start, stop = rank * n, (rank + 1) * n
    # logit_positions ascend (the pack's order), so each rank's are one contiguous run of them.
    edges = torch.searchsorted(packed.logit_positions, torch.arange(0, total + pad + 1, n,
                                                                    device=packed.logit_positions.device))
    counts = (edges[1:] - edges[:-1]).tolist()
    first, last = int(edges[rank]), int(edges[rank + 1])
    return UlyssesShard(
        input_ids=ids[:, start:stop],
        position_ids=positions[:, start:stop],
        cu_seqlens=cu,
        max_seqlen=longest,
        logit_positions=packed.logit_positions[first:last] - start,
        labels=packed.labels[first:last],
        counts=[int(c) for c in counts],
        rank=rank,
        group=group,
    )


# ------------------------------------------------------------------------------- batches
def gather_group_batch(batch: TrainBatch, group) -> tuple[TrainBatch, slice]:
    """The micro-batch source of a sequence-parallel group: the shards its ranks were handed,
    glued in rank order, and the rows of the result that are this rank's own shard.

    A worker group splits a batch over every rank; the sp ranks of a group must run the same
    micro-batches, so they pool their shards (the group is one data-parallel rank of
    ``world / sp``) and each returns the results of its own rows: the controller and the worker
    group see an ordinary data-parallel role. None: the batch itself, all its rows."""
    if group is None:
        return batch, slice(0, batch.batch_size)
    shards: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, batch.to("cpu"), group=group)
    sizes = [shard.batch_size for shard in shards]
    start = sum(sizes[: dist.get_rank(group)])
    return TrainBatch.concat(shards), slice(start, start + batch.batch_size)
