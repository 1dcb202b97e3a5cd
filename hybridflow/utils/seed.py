"""Seeding. Every random choice in a run flows from ``trainer.seed`` through these helpers."""

from __future__ import annotations

import base64
import random
from typing import Any

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


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state() -> dict[str, Any]:
    """The global generators' states (Python, NumPy, torch CPU and CUDA) as plain JSON data.

    Saved in checkpoints so that anything drawing from a global generator continues on a
    resume exactly as it would have: JSON, so loading it can never execute code.
    """
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": _encode(torch.get_rng_state()),
        "cuda": [_encode(s.cpu()) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``. Raises ``ValueError`` naming the part that is malformed."""
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_decode(state["torch"]))
        cuda = state.get("cuda") or []
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_decode(s) for s in cuda])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"malformed RNG state in checkpoint: {exc}") from exc
