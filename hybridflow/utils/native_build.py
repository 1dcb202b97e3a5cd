"""Native kernels written in C here, compiled on first use with the system's C compiler and loaded with ctypes.

Used by the native engine's bf16 kernels (``inference/cpu_kernels.c``) and the trainer's attention
(``training/cpu_attention.c``). A source is compiled once per text, flags and compiler version into a
cache (``$HYBRIDFLOW_KERNEL_CACHE``, else ``~/.cache/hybridflow/kernels``, else a folder of this user's
in the temporary directory); the file is renamed into place whole, so processes compiling at once never
load half a library. ``HYBRIDFLOW_CPU_KERNELS=0`` turns every native kernel off: the callers keep
torch's ops.

ctypes lets go of the GIL for the length of a call, so a kernel can run on threads of a pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybridflow.utils.device import CpuFeatures, cpu_features

log = logging.getLogger(__name__)

DISABLE_ENV = "HYBRIDFLOW_CPU_KERNELS"
CACHE_ENV = "HYBRIDFLOW_KERNEL_CACHE"


def disabled() -> bool:
    """Whether ``HYBRIDFLOW_CPU_KERNELS=0`` turned native kernels off."""
    return os.environ.get(DISABLE_ENV, "1") == "0"


def cache_dir() -> Path:
    """``$HYBRIDFLOW_KERNEL_CACHE``, else ``~/.cache/hybridflow/kernels``, else (no writable home: a Ray worker's,
    a container's) a folder of this user's in the temporary directory, so every process of a run finds a place."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    home = Path.home() / ".cache" / "hybridflow" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except (OSError, RuntimeError):  # RuntimeError: no home directory at all
        return Path(tempfile.gettempdir()) / f"hybridflow-kernels-{os.getuid()}"


def compile_shared(source: Path, flags: tuple[str, ...], libs: tuple[str, ...] = ()) -> Path:
    """``source`` compiled into a shared library in the cache (once per source text, the headers beside it, flags
    and compiler).

    Raises ``RuntimeError`` naming the reason where there is no compiler or it fails (its last lines)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC, or install gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what its quoted includes can read
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *flags, *libs, version]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *flags, str(source), *libs, "-o", str(built)], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)
    return target


# --------------------------------------------------------------------------------------------
# Kernels written with GCC's vector extensions (16 float32 lanes: one AVX-512 register)
# --------------------------------------------------------------------------------------------

VECTOR_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=fast")
# torch's dispatch level -> the kernels' target. Not AVX2: GCC lowers the 16-lane vectors to pairs of 8 there and the
# tiles outgrow 16 registers; the attention measured 8x slower than torch's SDPA (Zen 4 capped at AVX2).
MARCH = {"AVX512": "x86-64-v4"}


def march_for(cpu: CpuFeatures | None = None) -> tuple[str | None, str | None]:
    """(the -march to build vector-extension kernels for, None), else (None, why this machine is not for them).
    torch's own dispatch level decides, so ``ATEN_CPU_CAPABILITY=avx2`` turns the kernels off as it caps torch."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernels are built for x86-64 and this machine is {platform.machine()}"
    cpu = cpu or cpu_features()
    march = MARCH.get(cpu.capability)
    if march is None:
        return None, f"torch dispatches to {cpu.capability!r} here and the kernels are built for AVX-512"
    return march, None


def load_vector_kernels(source: Path, configure: Callable[[ctypes.CDLL], None], what: str
                        ) -> tuple[ctypes.CDLL | None, str | None]:
    """``source`` built for this CPU's -march and loaded, ``configure`` setting its functions' types: (library,
    None), or (None, why not). A failed build is logged once (``what`` names the kernel) and never raised."""
    if disabled():
        return None, f"{DISABLE_ENV}=0"
    march, reason = march_for()
    if march is None:
        return None, reason
    try:
        library = ctypes.CDLL(str(compile_shared(source, (*VECTOR_FLAGS, f"-march={march}"), ("-lm",))))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("%s could not be built (%s); torch's ops run instead", what, error)
        return None, f"the kernel could not be built: {error}"
    configure(library)
    return library, None


def balanced_ranges(costs: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty ranges of items (in order) with about equal total cost each, at most ``parts``."""
    total, ranges, first, done = sum(costs), [], 0, 0
    for i, cost in enumerate(costs):
        done += cost
        if len(ranges) < parts - 1 and done >= total * (len(ranges) + 1) / parts:
            ranges.append((first, i + 1))
            first = i + 1
    ranges.append((first, len(costs)))
    return [r for r in ranges if r[0] < r[1]]


def even_ranges(count: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``count`` items in at most ``parts`` contiguous, non-empty ranges of about equal size, each starting at a
    multiple of ``align`` (arithmetic: no per-item loop, for element counts in the millions)."""
    units = -(-count // align)
    parts = max(1, min(parts, units))
    edges = [min(count, (units * i // parts) * align) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if a < b]


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hybridflow-kernel")


def run_ranges(call: Callable[[int, int], Any], ranges: list[tuple[int, int]]) -> list[Any]:
    """``call(first, last)`` for each range, the first on this thread and the others on a pool's (a ctypes call
    lets go of the GIL, so they run at once); the results in order."""
    if len(ranges) <= 1:
        return [call(*r) for r in ranges]
    others = _pool(len(ranges) - 1).map(lambda r: call(*r), ranges[1:])
    first = call(*ranges[0])
    return [first, *others]
