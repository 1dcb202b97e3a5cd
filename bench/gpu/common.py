"""What the GPU kit's steps share: a results file written as figures arrive, the device, the
model shapes, the device's two ceilings, and timing.

A step writes its JSON after every figure (``Results.put``), so a step killed by its time box
still hands the driver what it measured so far.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class Results:
    """A step's figures, rewritten to ``path`` (atomically) after every change."""

    def __init__(self, path: Path, step: str, dry_run: bool) -> None:
        self.path = path
        self.data: dict[str, Any] = {"step": step, "dry_run": dry_run, "figures": {}, "errors": []}
        self._write()

    def put(self, key: str, value: Any) -> None:
        self.data["figures"][key] = value
        self._write()
        print(f"  {key}: {json.dumps(value, default=str)}", flush=True)

    def error(self, where: str, exc: BaseException) -> None:
        """A sub-check failed: recorded with its traceback's tail; the step goes on to the next."""
        self.data["errors"].append({"where": where, "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc()[-2000:]})
        self._write()
        print(f"  FAILED {where}: {type(exc).__name__}: {exc}", flush=True)

    @contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run a sub-check; on an exception record it and carry on (a CUDA OOM frees the cache)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - every failure is a finding to record, not a crash
            self.error(where, exc)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def step_arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, required=True, help="where this step writes its figures")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the code, not the GPU")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU work)")
    return parser


def pick_device(dry_run: bool) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --dry-run to check the code on a CPU")
    return torch.device("cuda", 0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs (device synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class Shape:
    """A Qwen2 decoder's shape; the kit builds random-weight models of it (no downloads)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 151936
    tie_word_embeddings: bool = True

    def toy(self) -> Shape:
        """The same family at CPU-check size (what --dry-run builds)."""
        return Shape(f"{self.name} (toy)", 64, 128, 2, 4, 2, 512, self.tie_word_embeddings)


QWEN25_05B = Shape("Qwen2.5-0.5B", 896, 4864, 24, 14, 2)
QWEN25_15B = Shape("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2)
EOS_TOKEN_ID = 1  # random models: ignore_eos keeps every sequence running anyway
PAD_TOKEN_ID = 0


def build_qwen2(shape: Shape, max_positions: int, seed: int = 0) -> torch.nn.Module:
    """A random-weight Qwen2ForCausalLM of ``shape`` in fp32 on the CPU (moved by the caller)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=max(max_positions, 64),
        tie_word_embeddings=shape.tie_word_embeddings, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- the ceilings


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of ``repeats``)."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    seconds = median_time(lambda: target.copy_(source), device, repeats)
    return 2 * source.numel() * 4 / seconds


def matmul_flops(device: torch.device, size: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """FLOP/s of a ``size``-cubed matrix product in ``dtype`` on random data (never zeros)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = median_time(lambda: a @ b, device, repeats, warmup=3)
    return 2 * size**3 / seconds


def free_device_memory(device: torch.device) -> int | None:
    """Bytes the driver reports free on ``device`` (None on a CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)
