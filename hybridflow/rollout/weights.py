"""Weight sync into a rollout engine: a streamed state dict applied in buckets of bounded size.

The trainer streams ``(name, tensor)`` pairs (``model.state_dict().items()`` or a generator that
gathers shards lazily). The engine groups them into buckets of at most ``max_bucket_bytes`` so that
(1) at most one bucket is held beyond what the sender already holds, and (2) a bucket that must
change device travels as one flat buffer, one transfer instead of one per tensor. The cross-process
path (``weight_transfer``) groups with the same ``iter_buckets`` and broadcasts each bucket as one
flat byte buffer, checked on the receiver with ``check_bucket`` before its data is sent.

Names are Hugging Face parameter names; unknown names and shape mismatches raise and name the
parameter before anything in that bucket is written.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping

import torch

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024  # large enough that a bucket amortises a transfer, small next to a model

NamedTensor = tuple[str, torch.Tensor]


def iter_buckets(weights: Iterable[NamedTensor], max_bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[NamedTensor]]:
    """Group consecutive pairs into lists of at most ``max_bucket_bytes`` (a larger tensor goes alone)."""
    if max_bucket_bytes < 1:
        raise ValueError(f"max_bucket_bytes must be >= 1, got {max_bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def check_bucket(bucket: list[NamedTensor], targets: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first pair that has no target or the wrong shape."""
    for name, tensor in bucket:
        target = targets.get(name)
        if target is None:
            close = difflib.get_close_matches(name, list(targets), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"update_weights: unknown parameter {name!r}{hint}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"update_weights: parameter {name!r} has shape {tuple(target.shape)} in the "
                f"rollout model but {tuple(tensor.shape)} was sent"
            )


def copy_bucket(bucket: list[NamedTensor], targets: Mapping[str, torch.Tensor]) -> None:
    """Copy a checked bucket into ``targets`` (casting), moving it as one flat buffer if it changes device."""
    if not bucket:
        return
    first = targets[bucket[0][0]]
    device, dtype = first.device, first.dtype
    if all(t.device == device for _, t in bucket):
        for name, tensor in bucket:
            targets[name].copy_(tensor)
        return
    # One transfer for the whole bucket, already in the target dtype.
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for _, t in bucket]).to(device)
    start = 0
    for name, tensor in bucket:
        count = tensor.numel()
        targets[name].copy_(flat[start : start + count].view(tensor.shape))
        start += count
