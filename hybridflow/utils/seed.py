"""Seeding. Every random choice in a run flows from ``trainer.seed`` through these helpers."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) global generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (e.g. run seed, step, prompt index).

    Used for per-request sampling seeds so a resumed run draws the same samples as an
    uninterrupted one, whatever else was generated before.
    """
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h ^= (int(p) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF
