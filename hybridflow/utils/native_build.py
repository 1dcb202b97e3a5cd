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

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

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
    """``source`` compiled into a shared library in the cache (once per source text, flags and compiler).

    Raises ``RuntimeError`` naming the reason where there is no compiler or it fails (its last lines)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC, or install gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *flags, *libs, version]).encode()).hexdigest()[:16]
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
