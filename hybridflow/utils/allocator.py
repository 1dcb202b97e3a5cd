"""jemalloc for the command line's processes, on request (``HYBRIDFLOW_ALLOCATOR``).

glibc's malloc keeps freed blocks in its heap, and how they fragment depends on the order of
frees, which thread timing changes between runs: identical GRPO runs peak apart, and above what
they use. jemalloc (Debian/Ubuntu ``libjemalloc2``, conda ``jemalloc``) sorts blocks by size
class and hands unused pages back on a timer. Measured on the ~18M long-tail GRPO step
(``bench/memory_timeline.py``, 4 identical runs, AMD EPYC Zen 4): glibc tuned as
``memory.configure_host_allocator`` does 2.32-2.42 GB (4.2% apart), jemalloc 1.89-1.90 GB (0.5%);
the default run 0.76-0.80 GB (5.5%) against 0.72-0.73 GB (2.0%); CPU-seconds in
docs/figures.md. Same numbers either way: an allocator does not change the arithmetic.

An allocator must be in place before the process's first ``malloc``, so ``hybridflow`` re-executes
itself once with jemalloc in ``LD_PRELOAD``; the processes it starts (ranks, Ray workers, the
reward scorer) inherit it. A user's own ``LD_PRELOAD`` is kept (jemalloc goes in front of it).

``HYBRIDFLOW_ALLOCATOR``: ``auto`` (the default: jemalloc where the machine has it and no GPU, else the C
library's malloc, tuned by ``memory.configure_host_allocator``; the run's log says which),
``jemalloc`` (required: an error names the package where it is missing) or ``system`` (the C
library's malloc). The default since the whole test suite passed with every process under jemalloc
(``LD_PRELOAD`` on pytest itself: the sandboxed reward processes' memory limits, Ray, the servers);
only the glibc-specific tests needed to know which allocator they run under.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ALLOCATOR_ENV = "HYBRIDFLOW_ALLOCATOR"
"""``auto`` (default), ``jemalloc`` or ``system`` (module docstring)."""
DEFAULT_ALLOCATOR = "auto"
_RELAUNCHED_ENV = "HYBRIDFLOW_ALLOCATOR_RELAUNCHED"  # set on the re-executed process: never twice
JEMALLOC = "libjemalloc.so.2"
# Where distributions and environments put it: Debian/Ubuntu multiarch, RPM's lib64, /usr/local, and
# the running Python's own prefix (conda's jemalloc package, a virtual environment's base).
_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")


# ``auto`` keeps the C library's malloc on a machine with a GPU: the figures behind the default are a CPU
# run's host memory, and no CUDA process of ours (the GPU kit, NCCL, pinned memory) has run under jemalloc yet.
# ``jemalloc`` still asks for it there.
_ACCELERATOR_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def find_jemalloc(dirs: Sequence[str | os.PathLike[str]] | None = None) -> Path | None:
    """The path of ``libjemalloc.so.2`` in the usual library folders, or None."""
    search = list(dirs) if dirs is not None else [*_LIBRARY_DIRS, Path(sys.base_prefix) / "lib", Path(sys.prefix) / "lib"]
    for folder in search:
        candidate = Path(folder) / JEMALLOC
        if candidate.is_file():
            return candidate
    return None


def jemalloc_loaded(maps: str | None = None) -> bool:
    """Whether jemalloc is mapped into this process (``/proc/self/maps``; False where unreadable)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return False
    return "libjemalloc" in maps


def accelerator_present(device_files: Sequence[str] = _ACCELERATOR_DEVICE_FILES) -> bool:
    """Whether this machine shows a GPU's device files (NVIDIA's, or AMD's ROCm), without importing torch."""
    return any(os.path.exists(path) for path in device_files)


def relaunch_environment(environ: Mapping[str, str], library: Path | None, loaded: bool,
                         accelerator: bool = False) -> dict[str, str] | None:
    """The environment to re-execute this command with jemalloc preloaded, or None to carry on as is:
    the C library's malloc asked for, jemalloc already loaded (or a relaunch already tried), or
    ``auto`` on a machine without it or with a GPU (``accelerator``: not measured there yet, see
    ``_ACCELERATOR_DEVICE_FILES``). ``jemalloc`` where it is missing: ``RuntimeError`` saying what
    to install."""
    setting = environ.get(ALLOCATOR_ENV, DEFAULT_ALLOCATOR).strip().lower()
    if setting not in ("auto", "system", "jemalloc"):
        raise ValueError(f"{ALLOCATOR_ENV}={environ[ALLOCATOR_ENV]!r}: expected system, jemalloc or auto")
    if setting == "system" or loaded or (setting == "auto" and accelerator):
        return None
    if environ.get(_RELAUNCHED_ENV):  # preloaded, yet not mapped: the loader refused it; say so once, go on
        print(f"{ALLOCATOR_ENV}: {environ.get('LD_PRELOAD')} did not load; running with the C library's malloc",
              file=sys.stderr)
        return None
    if library is None:
        if setting == "jemalloc":
            raise RuntimeError(f"{ALLOCATOR_ENV}=jemalloc but no {JEMALLOC} was found in {', '.join(_LIBRARY_DIRS)} "
                               "or this Python's prefix: install it (Debian/Ubuntu: apt install libjemalloc2; conda: "
                               f"conda install jemalloc), or set {ALLOCATOR_ENV}=system")
        return None
    preload = environ.get("LD_PRELOAD", "")
    return {**environ, "LD_PRELOAD": f"{library}:{preload}" if preload else str(library), _RELAUNCHED_ENV: "1"}


def relaunch_with_jemalloc() -> None:
    """Re-execute this command line with jemalloc preloaded where ``relaunch_environment`` says so
    (Linux only); returns only when it does not. Call first thing in an entry point, never in a
    process that holds state (a test runner calling ``cli.main``)."""
    if not sys.platform.startswith("linux"):
        return
    env = relaunch_environment(os.environ, find_jemalloc(), jemalloc_loaded(), accelerator_present())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def choose_allocator() -> None:
    """``relaunch_with_jemalloc`` for an entry point: a bad ``HYBRIDFLOW_ALLOCATOR`` (or jemalloc asked
    for and missing) ends the command with its message and exit code 2, as a config error does."""
    try:
        relaunch_with_jemalloc()
    except (RuntimeError, ValueError) as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None


def describe() -> str:
    """One line for the log: which allocator this process runs and how to change it."""
    if jemalloc_loaded():
        return f"memory allocator: jemalloc ({ALLOCATOR_ENV}=system keeps the C library's malloc)"
    if os.environ.get(ALLOCATOR_ENV, DEFAULT_ALLOCATOR).strip().lower() == "system":
        return f"memory allocator: the C library's malloc, as {ALLOCATOR_ENV}=system asks"
    library = find_jemalloc()
    if library is not None and accelerator_present():
        return (f"memory allocator: the C library's malloc: on a machine with a GPU {ALLOCATOR_ENV}=auto keeps it "
                f"({ALLOCATOR_ENV}=jemalloc asks for jemalloc)")
    if library is None:
        return (f"memory allocator: the C library's malloc: no {JEMALLOC} here (Debian/Ubuntu: apt install "
                "libjemalloc2; conda: conda install jemalloc), with which identical runs peak alike and lower")
    # The Python API in a process the hybridflow command did not start: too late to change its malloc.
    return (f"memory allocator: the C library's malloc: this process was not started by the hybridflow command; "
            f"LD_PRELOAD={library} before python starts gives it jemalloc")
