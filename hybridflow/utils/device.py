"""Device and thread selection."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cuda`` without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu or auto")
    return torch.device(name)


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads deliberately (default: every core the process may use)."""
    if num_threads is None:
        try:
            num_threads = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            num_threads = os.cpu_count() or 1
    torch.set_num_threads(max(1, num_threads))
    return torch.get_num_threads()


def parse_dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(dtypes)}")
    return dtypes[name]
