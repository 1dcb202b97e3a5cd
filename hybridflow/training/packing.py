"""Sequence packing: a padded ``TrainBatch`` as one padding-free row, and back.

A ``TrainBatch`` pads prompts on the left to P and responses on the right to R, so a forward
over it spends B·(P+R) token slots and B·(P+R)² attention pairs however short most samples
are. ``pack_batch`` concatenates only the valid tokens of every sample into one row of N tokens,
with position ids that restart at 0 for each sample, and records where each sequence starts
(``cu_seqlens``). Attention must then stay inside each sequence:

- ``flash_attention_2/3`` read ``cu_seq_lens_q/k`` (passed as model kwargs) and run varlen;
- ``sdpa``/``eager`` (transformers 5, ``masking_utils.find_packed_sequence_indices``) detect
  packing from the restarting position ids when ``attention_mask`` is None and build an N×N
  block-diagonal causal mask — correct, but attention then costs N² per layer however short
  the sequences (measured on CPU: 1.9x padded, vs 9x for the varlen kernel below);
- ``VARLEN_ATTENTION`` (registered here) runs each sequence's causal attention on its own: Σ Lᵢ²
  work, no mask at all (on a CPU in ``cpu_attention``'s kernel, else SDPA calls over length
  groups). ``enable_varlen_attention`` swaps a model's ``sdpa`` for it; calls that are not
  packed are handed to transformers' own sdpa, unchanged to the bit.

Only the logits that predict a response token are computed (``logits_to_keep`` as a position
tensor), and ``unpack_responses`` scatters per-token results back to the (B, R) layout that
every loss and advantage function expects, with zeros where the batch has padding.

Shapes: B batch, P prompt, R response, N packed tokens, M response tokens in the pack.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridflow.training import cpu_attention
from hybridflow.types import TrainBatch
from hybridflow.utils.shapes import MIN_BUCKET, bucketed_length  # noqa: F401 (MIN_BUCKET: re-exported)

VARLEN_ATTENTION = "hybridflow_varlen_sdpa"


@dataclass
class PackedBatch:
    """The valid tokens of a ``TrainBatch`` in one row, and the map back to (B, R)."""

    input_ids: torch.Tensor  # (1, N) long
    position_ids: torch.Tensor  # (1, N) long, restarting at each sequence
    cu_seqlens: torch.Tensor  # (B+1,) int32, sequence b is packed tokens cu[b]:cu[b+1]
    max_seqlen: int
    logit_positions: torch.Tensor  # (M,) long: packed positions whose logits predict a response token
    labels: torch.Tensor  # (M,) long: the response tokens those logits predict
    response_index: torch.Tensor  # (M,) long: flat index into (B*R) of each predicted token
    batch_size: int
    response_length: int

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of a HF causal LM forward over the pack."""
        return packed_model_inputs(self.input_ids, self.position_ids, self.logit_positions, self.cu_seqlens,
                                   self.max_seqlen)


def packed_model_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, logit_positions: torch.Tensor,
                        cu_seqlens: torch.Tensor, max_seqlen: int) -> dict[str, Any]:
    """Keyword arguments of a HF causal LM forward over packed tokens (one row, position ids
    restarting per sequence, ``cu_seqlens`` the sequences' bounds)."""
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        # None makes transformers treat the row as packed (detected from position ids).
        "attention_mask": None,
        "use_cache": False,
        "logits_to_keep": logit_positions,
        # Read by varlen kernels (flash-attention, VARLEN_ATTENTION); ignored by the others.
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }


def sequence_lengths(batch: TrainBatch) -> list[int]:
    """Valid tokens (prompt + response) per sample: what a packed forward pays for each."""
    return [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]


def _check_contiguous(valid: torch.Tensor) -> None:
    """Each row's valid tokens must form one run (left-padded prompt + right-padded response)."""
    t = valid.shape[1]
    counts = valid.sum(dim=1)
    first = valid.int().argmax(dim=1)
    last = t - 1 - valid.flip(1).int().argmax(dim=1)
    gaps = (counts > 0) & (last - first + 1 != counts)
    if bool(gaps.any()):
        rows = gaps.nonzero().flatten().tolist()
        raise ValueError(f"pack_batch: rows {rows} have padding between valid tokens; cannot pack them")


def pack_batch(batch: TrainBatch) -> PackedBatch:
    """Concatenate the valid tokens of every sample into one row (see the module docstring).

    Position ids are taken from the batch, so the packed forward sees exactly the positions of
    the padded one (``collate_trajectories`` counts real tokens from 0).
    """
    if batch.multi_modal is not None and any(m is not None for m in batch.multi_modal):
        # A packed row would need each sample's M-RoPE positions (3, L) and its images' patches
        # in pack order; not built: image rows run padded.
        raise ValueError("rows with images run padded: sequence packing (use_remove_padding=True) does not carry "
                         "their images and M-RoPE positions; set actor.use_remove_padding=false for a VL model")
    p, r = batch.prompt_length, batch.response_length
    valid = batch.attention_mask.bool()  # (B, P+R)
    _check_contiguous(valid)
    response_valid = valid[:, p:]  # (B, R)
    # A response token is predicted by the logits of the token before it, which must be in the
    # same sequence: the last prompt column (left padding puts every prompt's end there).
    if p == 0 or bool((response_valid.any(dim=1) & ~valid[:, p - 1]).any()):
        raise ValueError("pack_batch: every sample with a response needs at least one prompt token")
    lengths = valid.sum(dim=1)  # (B,)
    cu_seqlens = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=valid.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    packed_position = valid.flatten().long().cumsum(0).view_as(valid) - 1  # (B, P+R)
    return PackedBatch(
        input_ids=batch.input_ids[valid].unsqueeze(0),
        position_ids=batch.position_ids[valid].unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()),
        logit_positions=packed_position[:, p:][response_valid] - 1,
        labels=batch.responses[response_valid],
        response_index=response_valid.flatten().nonzero().flatten(),
        batch_size=batch.batch_size,
        response_length=r,
    )


# Packed micro-batches run at a bucketed token count (``utils.shapes.bucketed_length``, also the memory
# planner's) where the compute is reduced precision on a CPU (``utils.shapes``: oneDNN keeps a kernel
# per matmul shape; the bf16-mixed default run's memory grew 0.83 -> 1.9 GB over 100 steps with exact
# counts, 0.88 GB flat bucketed).


def append_pad_sequence(
    input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One more sequence of ``pad`` pad tokens at the end of a packed row: attention keeps it to
    itself (its positions restart at 0, ``cu_seqlens`` closes it) and no logit position reads it."""
    n = input_ids.shape[1]
    input_ids = torch.cat([input_ids, input_ids.new_zeros((1, pad))], dim=1)
    position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1)
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([n + pad])])
    return input_ids, position_ids, cu_seqlens, max(max_seqlen, pad)


def pad_pack_to_bucket(packed: PackedBatch) -> PackedBatch:
    """``packed`` padded to its ``bucketed_length`` (a pad sequence at the end; results unchanged in
    meaning: ``unpack_responses`` reads only the real sequences' response tokens)."""
    n = packed.input_ids.shape[1]
    pad = bucketed_length(n) - n
    if pad == 0:
        return packed
    ids, positions, cu, longest = append_pad_sequence(packed.input_ids, packed.position_ids, packed.cu_seqlens,
                                                      packed.max_seqlen, pad)
    return dataclasses.replace(packed, input_ids=ids, position_ids=positions, cu_seqlens=cu, max_seqlen=longest)


def unpack_responses(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Per-response-token values (M,) back to (B, R), zero on padding. Differentiable."""
    flat = values.new_zeros(packed.batch_size * packed.response_length)
    return flat.index_copy(0, packed.response_index, values).view(packed.batch_size, packed.response_length)


def trim_padding(batch: TrainBatch) -> TrainBatch:
    """The batch without the columns that are padding in every row (a padded micro-batch's own width).

    ``collate_trajectories`` pads a whole step's samples to its longest prompt and longest
    response; a micro-batch of short samples cut from it would otherwise run (and keep
    activations for) the step's full width. Prompt columns are dropped on the left, response
    columns on the right, so every valid token keeps its position id and neighbours, and a
    response token is still predicted from the last prompt column. (B, R) fields are cut to the
    kept responses; ``pad_responses`` puts per-token results back to the batch's R.
    """
    p, r = batch.prompt_length, batch.response_length
    valid = batch.attention_mask.bool()
    prompt_used = valid[:, :p].any(dim=0)
    response_used = valid[:, p:].any(dim=0)
    # Keep at least one prompt column (the logits of the last one predict the first response token).
    first = min(int(prompt_used.int().argmax()), p - 1) if bool(prompt_used.any()) else max(0, p - 1)
    keep_r = max(1, int(response_used.nonzero().max()) + 1) if bool(response_used.any()) else 1
    if first == 0 and keep_r == r:
        return batch
    kwargs: dict[str, Any] = {"prompt_length": p - first}
    for f in dataclasses.fields(batch):
        if f.name == "prompt_length":
            continue
        value = getattr(batch, f.name)
        if f.name == "multi_modal":  # per row, not per column: trimming columns leaves it as it is
            kwargs[f.name] = value
            continue
        if value is not None and value.dim() == 2 and value.shape[1] == p + r and f.name in _TOKEN_FIELDS:
            value = value[:, first : p + keep_r]
        elif value is not None and value.dim() == 2 and value.shape[1] == r:
            value = value[:, :keep_r]
        kwargs[f.name] = value
    return TrainBatch(**kwargs)


# (B, P+R) fields; every other 2-D field of a TrainBatch is (B, R).
_TOKEN_FIELDS = ("input_ids", "attention_mask", "position_ids")


def pad_responses(values: torch.Tensor, response_length: int) -> torch.Tensor:
    """(B, R') per-token values of a trimmed batch back to (B, R), zero on the right. Differentiable."""
    missing = response_length - values.shape[1]
    return values if missing == 0 else F.pad(values, (0, missing))


# --------------------------------------------------------------------------------------------
# Varlen attention for CPU (and any device without flash-attention)
# --------------------------------------------------------------------------------------------


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Sequence starts of one packed row: wherever the position does not follow on by one.  # (S+1,)"""
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    edges = starts.nonzero().flatten().to(torch.int32)
    return torch.cat([edges, torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)])


def _segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, dropout: float, window: int | None
) -> torch.Tensor:
    """Causal SDPA over one sequence (1, H, L, D); a sliding window becomes a band mask."""
    gqa = q.shape[1] != k.shape[1]
    length = q.shape[2]
    if window is None or length <= window:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
    idx = torch.arange(length, device=q.device)
    # transformers' sliding window: query i sees keys j with i - window < j <= i.
    band = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout, scale=scaling, enable_gqa=gqa)


def _packed_segments(
    query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> list[int] | None:
    """Segment boundaries when this call is a packed row the varlen path can run, else None."""
    if attention_mask is not None or query.shape[0] != 1:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return [int(x) for x in cu.tolist()]
    position_ids = kwargs.get("position_ids")
    if position_ids is None or position_ids.shape[-1] != query.shape[2]:
        return None
    # No cu_seqlens (a caller that only passed restarting position ids): derive them.
    return [int(x) for x in cu_seqlens_from_position_ids(position_ids).tolist()]


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, N, D)
    key: torch.Tensor,  # (1, H_kv, N, D)
    value: torch.Tensor,  # (1, H_kv, N, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: per-sequence causal attention on a packed row.

    On a CPU where ``cpu_attention.usable`` says so, the kernel computes each sequence in place in
    the row (float32, no padding, no gathers); elsewhere one SDPA call per group of similar lengths.
    Anything that is not a packed row without a mask (padded batches, decoding with a cache,
    bidirectional modules) goes to transformers' ``sdpa_attention_forward`` unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = _packed_segments(query, attention_mask, kwargs)
    if segments is None or key.shape[2] != query.shape[2] or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )
    dtype = value.dtype  # the projections' output dtype (RoPE makes query and key float32 under autocast)
    tokens, heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    if segments[0] != 0 or segments[-1] != tokens:
        raise ValueError(f"packed attention: the sequences span tokens {segments[0]}..{segments[-1]} of a row of {tokens}")
    starts, lengths = segments[:-1], [e - s for s, e in zip(segments[:-1], segments[1:])]
    if cpu_attention.usable(query, key, dropout, sliding_window, max(lengths, default=0), kwargs):
        return cpu_attention.packed_attention(query, key, value, segments, scaling).to(dtype), None
    upcast = _upcast_for_backward(query, value)
    if upcast:
        query, key, value = query.float(), key.float(), value.float()
    rows: list[torch.Tensor] = []  # each group's output, (G*L, H, D): padded members included
    source = torch.empty(tokens, dtype=torch.long, device=query.device)  # packed token -> its row in cat(rows)
    offset = 0
    for group in _length_groups(lengths):
        longest = max(lengths[i] for i in group)
        t = torch.arange(longest, device=query.device)
        start = torch.tensor([starts[i] for i in group], device=query.device)[:, None]
        length = torch.tensor([lengths[i] for i in group], device=query.device)[:, None]
        # Each member right-padded to the group's longest by repeating its last token: with a
        # causal mask a real query never sees a padded key, and padded queries are dropped, so
        # the result (and the gradient) of every real token is that of its own sequence.
        index = (start + torch.minimum(t[None, :], length - 1)).reshape(-1)  # (G*L,)
        q, k, v = (x[0][:, index].unflatten(1, (len(group), longest)).transpose(0, 1) for x in (query, key, value))
        with torch.autocast(query.device.type, enabled=False) if upcast else nullcontext():
            o = _segment_attention(q, k, v, scaling, dropout, sliding_window)  # (G, H, L, D)
        real = (t[None, :] < length).reshape(-1)
        rows.append(o.transpose(1, 2).reshape(-1, heads, head_dim))
        source[index[real]] = offset + real.nonzero().flatten()
        offset += rows[-1].shape[0]
    # One gather puts every token's row back in pack order: the values (and gradients) are copies,
    # as a chain of per-group index_copy was, but that chain made two full (N, H, D) copies per
    # group (forward and backward), ~0.25 GB of the update's peak heap on the 18M long-tail workload
    # (issue 35), freed but left resident between the activations that outlive them.
    out = (rows[0] if len(rows) == 1 else torch.cat(rows)).index_select(0, source)  # (N, H, D)
    return out.unsqueeze(0).to(dtype), None  # (1, N, H, D)


def _upcast_for_backward(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a packed row's attention runs in float32 although it would run in bf16/fp16 (its
    inputs, or autocast's cast of them): on a CPU, when a backward will follow. torch's CPU
    flash-attention backward in bf16 measured 2-10x slower than in float32 (torch 2.13, a Xeon with
    AMX: 153 ms against 14 ms for 128 sequences of 38 tokens at head dim 32, 45 against 8 ms for 16
    of 64 at 64), which made a bf16-mixed update slower than an fp32 one (bench/update_bound.py).
    The attention's FLOPs are a small share of a layer's, the projections keep their bf16 matmuls,
    and a no-grad forward (logprobs) stays in bf16, where the kernel is fast. Float32 runs are
    untouched (bitwise)."""
    lower = value.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
    return query.device.type == "cpu" and lower and query.requires_grad and torch.is_grad_enabled()


# A sequence joins a group when it is at least this share of the group's longest: one SDPA call
# per group instead of one per sequence (thousands of tiny calls for many short samples), for at
# most (1/share)^2 - 1 = 56% more attention work on the shortest member.
_GROUP_LENGTH_SHARE = 0.8


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of the non-empty sequences, grouped longest first into similar lengths."""
    groups: list[list[int]] = []
    for i in sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i]):
        if groups and lengths[i] >= _GROUP_LENGTH_SHARE * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _varlen_mask(**kwargs: Any) -> torch.Tensor | None:
    """Mask builder paired with ``varlen_sdpa_attention`` (transformers calls it by keyword).

    A packed training row (one row, no padding mask, no cache offset) needs no mask: returning
    None saves building the N×N block mask that the attention function would ignore. Every
    other call, several packed rows included, gets exactly what ``sdpa`` would get.
    """
    from transformers.masking_utils import sdpa_mask

    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    no_offset = not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kv_offset == 0
    one_row = kwargs.get("batch_size") == 1 and kwargs.get("q_length") == kwargs.get("kv_length")
    if kwargs.get("attention_mask") is None and no_offset and one_row:
        return None
    return sdpa_mask(**kwargs)


def register_varlen_attention() -> str:
    """Register ``VARLEN_ATTENTION`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)
    return VARLEN_ATTENTION


def enable_varlen_attention(model: Any) -> str | None:
    """Switch a model on ``sdpa`` to ``VARLEN_ATTENTION``; returns the implementation in use
    (None for a module that is not a transformers model).

    Lossless for unpacked calls (they are handed to sdpa). Other implementations are kept:
    flash-attention already runs varlen from ``cu_seq_lens_q/k``; eager and flex detect the
    packing from position ids.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == "sdpa":
        model.set_attn_implementation(register_varlen_attention())
        return VARLEN_ATTENTION
    return current
