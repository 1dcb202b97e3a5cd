"""Device and thread selection."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hybridflow.utils.threads import fix_threads, follow_free_cores, process_cores


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cuda`` without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu or auto")
    return torch.device(name)


def configure_threads(num_threads: int | None, *, advise: bool = False) -> int:
    """Set torch's intra-op threads deliberately. A number: that many (``advise``: and say once
    when other processes' load makes another count faster, ``hybridflow.utils.threads``).
    ``None``: every core the process may use, then as many as other processes leave free."""
    if num_threads is None:
        return follow_free_cores(len(process_cores())).threads
    return fix_threads(num_threads, advise=advise)


def parse_dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(dtypes)}")
    return dtypes[name]


# /proc/cpuinfo flags that give bf16 matmuls native hardware: AVX-512 BF16 dot products (Cooper
# Lake, Sapphire Rapids, Zen 4/5) and AMX tiles (Sapphire Rapids and later). Without either, torch
# runs bf16 matmuls through a slow conversion path (0.2 GFLOP/s measured on an AVX2 EPYC against
# 76 GFLOP/s in fp32; bench/rollout_compute_bound.py).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


# oneDNN runs a CPU's bf16 matmuls; ``ONEDNN_MAX_CPU_ISA`` (older name ``DNNL_MAX_CPU_ISA``) caps the
# instructions it may use, and below a flag's level oneDNN emulates bf16 however new the CPU is. The
# values are oneDNN's ``dnnl_cpu_isa_t`` bit masks: a cap allows an instruction set when it holds all of
# that set's bits. Users set the cap to reproduce an older CPU's numbers (or to dodge a kernel bug).
ONEDNN_ISA_MASKS = {
    "SSE41": 0x1, "AVX": 0x3, "AVX2": 0x7, "AVX2_VNNI": 0xF, "AVX2_VNNI_2": 0x1F,
    "AVX512_CORE": 0x27, "AVX512_CORE_VNNI": 0x67, "AVX512_CORE_BF16": 0xE7,
    "AVX10_1_512": 0x1EF, "AVX512_CORE_FP16": 0x1EF, "AVX10_1_512_AMX": 0xFEF, "AVX512_CORE_AMX": 0xFEF,
    "AVX10_1_512_AMX_FP16": 0x1FEF, "AVX512_CORE_AMX_FP16": 0x1FEF,
}
_FLAG_ISA = {"avx512_bf16": "AVX512_CORE_BF16", "amx_bf16": "AVX512_CORE_AMX"}


def onednn_isa_cap(environ: Mapping[str, str] = os.environ) -> str:
    """The instruction-set cap set for oneDNN (upper-cased, as oneDNN reads it case-blind), or "" for
    none; ``ALL``/``DEFAULT`` and names oneDNN does not know (it ignores them too) are no cap."""
    value = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return value if value in ONEDNN_ISA_MASKS else ""


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU offers the kernels torch picks (``cpu_features``)."""

    vendor: str  # "GenuineIntel", "AuthenticAMD", ... ("" when unknown)
    model_name: str
    flags: frozenset[str]  # what the CPU has (/proc/cpuinfo)
    capability: str  # torch's dispatch level: "AVX512", "AVX2", "DEFAULT", ...
    onednn_isa: str = ""  # ``onednn_isa_cap``: "" when oneDNN may use every instruction the CPU has

    def _usable(self, flag: str) -> bool:
        """``flag`` is on the CPU and oneDNN, which runs the bf16 matmuls, may use it."""
        if flag not in self.flags:
            return False
        needed = ONEDNN_ISA_MASKS[_FLAG_ISA[flag]]
        return not self.onednn_isa or ONEDNN_ISA_MASKS[self.onednn_isa] & needed == needed

    @property
    def avx512_bf16(self) -> bool:
        return self._usable("avx512_bf16")

    @property
    def amx_bf16(self) -> bool:
        return self._usable("amx_bf16")

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matmuls run on bf16 hardware here (either flag of ``NATIVE_BF16_FLAGS``, not
        capped away by ``ONEDNN_MAX_CPU_ISA``)."""
        return self.avx512_bf16 or self.amx_bf16

    def bf16_flags(self) -> str:
        """The bf16 flags the matmuls use, or why none: "avx512_bf16, amx_bf16", "no avx512_bf16/amx_bf16",
        "avx512_bf16 capped by ONEDNN_MAX_CPU_ISA=AVX2"."""
        usable = [f for f in NATIVE_BF16_FLAGS if self._usable(f)]
        if usable:
            return ", ".join(usable)
        present = [f for f in NATIVE_BF16_FLAGS if f in self.flags]
        if present:
            return f"{', '.join(present)} capped by ONEDNN_MAX_CPU_ISA={self.onednn_isa}"
        return "no avx512_bf16/amx_bf16"

    def describe(self) -> str:
        return f"{self.model_name or 'unknown CPU'} ({self.vendor or 'unknown vendor'}; torch {self.capability}; {self.bf16_flags()})"


def parse_cpuinfo(text: str) -> tuple[str, str, frozenset[str]]:
    """(vendor, model name, flags) of the first processor in ``/proc/cpuinfo`` text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: every core of a machine reports the same
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("vendor_id", ""), fields.get("model name", ""), frozenset(fields.get("flags", "").split())


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This machine's CPU, from ``/proc/cpuinfo`` (Linux) and torch's dispatch level.

    Elsewhere the flags are unknown (empty), which reads as "no native bf16": the safe answer.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            vendor, model_name, flags = parse_cpuinfo(handle.read())
    except OSError:
        vendor, model_name, flags = "", platform.processor(), frozenset()
    return CpuFeatures(vendor=vendor, model_name=model_name, flags=flags,
                       capability=torch.backends.cpu.get_cpu_capability(), onednn_isa=onednn_isa_cap())


AUTO_DTYPE = "auto"
"""``model.dtype=auto``: the training compute dtype is ``rule_train_dtype``'s answer."""


def rule_train_dtype(
    device_type: str, cpu: CpuFeatures | None = None, cuda_bf16: bool | None = None
) -> tuple[str, str]:
    """``model.dtype=auto``: (the training compute dtype, why), a rule of the hardware, never a timing.

    bfloat16 (mixed precision: fp32 master weights and AdamW, bf16 matmuls) on a CUDA device with
    bf16 tensor cores (compute capability 8.0 on: ``cuda_bf16``, read from torch when not given) and
    on a CPU with bf16 hardware (``NATIVE_BF16_FLAGS``); float32 elsewhere, where bf16 matmuls are
    emulated (a V100, a CPU with AVX2 only: far slower than fp32). No model-size threshold: the bf16-mixed update
    measured 1.35x faster than fp32 by CPU-seconds for the built-in 0.8M model and 1.7x for a
    20M one (bench/update_bound.py, Xeon with AMX, one thread), with mean |logprob difference|
    0.001-0.003, far inside a PPO clip. A timing would make two starts of one command train in
    two precisions on a loaded machine; the run folder records the answer so a resume keeps it
    (``controller.token_budgets``)."""
    if device_type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        if cuda_bf16:
            return "bfloat16", "a CUDA device with bf16 tensor cores"
        return "float32", "this CUDA device has no bf16 tensor cores (compute capability below 8.0): bf16 would be emulated"
    cpu = cpu or cpu_features()
    if not cpu.native_bf16:
        return "float32", f"{cpu.model_name or 'this CPU'}: {cpu.bf16_flags()}: bf16 would be emulated"
    return "bfloat16", f"{cpu.model_name or 'this CPU'} has {cpu.bf16_flags()}: bf16-mixed updates measured 1.35-1.7x fp32"


def train_dtype(setting: str, device_type: str) -> str:
    """``model.dtype`` as the roles compute: the setting, or the rule's answer for ``auto``."""
    return rule_train_dtype(device_type)[0] if setting == AUTO_DTYPE else setting
