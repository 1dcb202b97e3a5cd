"""Shape buckets: sizes rounded up to one of a few values, so kernels meet a bounded set of shapes.

oneDNN, which runs a CPU's reduced-precision matmuls, compiles and caches a kernel for every matmul
shape it meets and keeps them (its primitive cache and ideep's, 1,024 entries each). A trainer whose
packed micro-batches change token count every call, or a rollout engine whose decode rows and
prefill widths do, meets a new shape each time: resident memory grew step after step in bf16 on a
CPU (the default run's update: 0.83 -> 1.9 GB over 100 steps; an ~20M model's rollout: 0.43 -> 1.9
GB over 10 rounds) while float32 (MKL, nothing kept per shape) stayed flat. The trainer
(``training.packing``) and the native engine (``inference.graphs``) both round up with this rule, and
the memory planner (``config.plan``) plans the trainer's micro-batches at their bucket.
"""

from __future__ import annotations

# Sizes per doubling: a size rounds up by at most 1/BUCKETS_PER_DOUBLING, and every doubling of the
# range adds BUCKETS_PER_DOUBLING shapes (57 up to 8,192 tokens). A power of two.
BUCKETS_PER_DOUBLING = 8


def geometric_bucket(n: int) -> int:
    """``n`` rounded up to one of ``BUCKETS_PER_DOUBLING`` evenly spaced sizes between the power of
    two below it and the next (exact up to 2 * BUCKETS_PER_DOUBLING)."""
    if n < 1:
        raise ValueError(f"geometric_bucket: n must be >= 1, got {n}")
    step = 1 << max(0, (n - 1).bit_length() - BUCKETS_PER_DOUBLING.bit_length())
    return -(-n // step) * step


# The trainer's packed micro-batches and head rows: none below this size.
MIN_BUCKET = 64


def bucketed_length(n: int) -> int:
    """The bucket (``geometric_bucket``, at least ``MIN_BUCKET``) that holds ``n`` tokens or rows."""
    return MIN_BUCKET if n <= MIN_BUCKET else geometric_bucket(n)
