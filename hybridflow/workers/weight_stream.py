"""The actor's weight sync by broadcast (``rollout.weight_sync=broadcast``): a (possibly sharded)
engine's weights streamed bucket by bucket from rank 0 to the rollout ranks, each bucket gathered
in lockstep as it is sent, never the whole model; LoRA adapters merged on the way."""

from __future__ import annotations

import torch

from hybridflow.models.lora import LoraLayout
from hybridflow.transfer import weight_transfer
from hybridflow.transfer.weight_transfer import (
    DEFAULT_TRANSFER_BUCKET_BYTES,
    SENDER_RANK,
    TransferStats,
    WeightSyncError,
    WeightSyncGroup,
)
from hybridflow.transfer.weights import plan_buckets
from hybridflow.training import distributed
from hybridflow.training.engine import TrainEngine


def stream_weights(
    engine: TrainEngine, rank: int, group: WeightSyncGroup | None,
    max_bucket_bytes: int = DEFAULT_TRANSFER_BUCKET_BYTES, lora: LoraLayout | None = None,
) -> TransferStats | None:
    """One weight sync from a (possibly sharded) training engine, without gathering the model.

    Every rank plans the same buckets from its shards' names and full shapes (no collective),
    each sharded tensor as row slices cut at the shard boundaries and at most a bucket long; then
    rank 0 sends them with ``weight_transfer.send_buckets`` while fetching each slice only when
    the sender asks for it: the rank whose shard holds it sends it to rank 0, in lockstep with
    the others. So rank 0's extra memory is the flat buffer plus one slice (about one bucket),
    not the model, nor its largest tensor; the other ranks send views of their shards. One rank:
    the model's own tensors and views of their rows are sent, nothing gathered or copied.

    Returns rank 0's stats, None on the others. When the sync fails (a receiver refused a bucket,
    naming the parameter) rank 0 raises ``WeightSyncError`` and tells the other ranks, which
    raise it too instead of waiting in a gather that will not come. A collective over the
    engine's ranks; rank 0 passes its weight-sync ``group``.

    ``lora``: the engine's model carries LoRA adapters; what travels is the base model's weights
    under their own names with each adapter merged (``LoraLayout.merge_rows``): the buckets are
    planned from the base weights, and each tensor or row slice is merged on rank 0 as it is
    gathered, from full copies of the adapters (gathered first: r x (in + out) per layer)."""
    named = engine.named_weight_shards()
    adapters: dict[str, torch.Tensor] = {}
    if lora is not None:
        adapters = {n: distributed.gather_weight(t) for n, t in lora.adapters(named).items()}
        named = lora.base_weights(named)
    plan = plan_buckets(named, max_bucket_bytes, distributed.shard_row_cuts)
    if rank != SENDER_RANK:
        error = distributed.follow_bucket_gathers(plan)
        if error is not None:
            raise WeightSyncError(f"actor rank {rank}: the weight sync failed on rank {SENDER_RANK}: {error}")
        return None
    with distributed.lead_bucket_gathers(plan) as buckets:
        if group is None:
            raise RuntimeError("actor rank 0 has not joined a weight-sync group: call join_weight_sync first")
        if lora is not None:
            buckets = ((bucket, _merged(lora, bucket, data, adapters)) for bucket, data in buckets)
        return weight_transfer.send_buckets(group, buckets)


def _merged(lora: LoraLayout, bucket, data, adapters: dict[str, torch.Tensor]):
    """A bucket's gathered bytes with each LoRA adapter merged into its base weight's rows."""
    for entry, rows in zip(bucket, data, strict=True):
        yield lora.merge_rows(entry.name, rows, adapters, entry.rows)
