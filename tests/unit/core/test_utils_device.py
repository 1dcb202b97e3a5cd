"""CPU feature detection: parsing /proc/cpuinfo and what the flags mean for bf16."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from hybridflow.inference.precision import rule_cpu_rollout_dtype
from hybridflow.utils.device import (
    CpuFeatures,
    cpu_features,
    onednn_isa_cap,
    parse_cpuinfo,
    rule_train_dtype,
    train_dtype,
)

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""
MILAN = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse avx avx2 fma
"""


def test_cpuinfo_is_read_from_the_first_processor() -> None:
    vendor, model, flags = parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert (vendor, model) == ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+")
    assert {"avx512_bf16", "amx_bf16"} <= flags and "avx512f" in flags


def test_native_bf16_needs_avx512_bf16_or_amx() -> None:
    def features(text: str) -> CpuFeatures:
        vendor, model, flags = parse_cpuinfo(text)
        return CpuFeatures(vendor=vendor, model_name=model, flags=flags, capability="AVX2")

    spr, milan = features(SAPPHIRE_RAPIDS), features(MILAN)
    assert spr.avx512_bf16 and spr.amx_bf16 and spr.native_bf16
    assert not (milan.avx512_bf16 or milan.amx_bf16 or milan.native_bf16)
    assert "avx512_bf16, amx_bf16" in spr.describe() and "no avx512_bf16/amx_bf16" in milan.describe()
    only_avx512_bf16 = CpuFeatures(vendor="AuthenticAMD", model_name="Zen 4", flags=frozenset({"avx512_bf16"}),
                                   capability="AVX512")
    assert only_avx512_bf16.native_bf16


def test_this_machine_is_described_with_torchs_dispatch_level() -> None:
    features = cpu_features()
    assert features.capability == torch.backends.cpu.get_cpu_capability()
    assert features is cpu_features()  # read once per process


def test_model_dtype_auto_is_bf16_on_bf16_hardware_cpu_or_gpu() -> None:
    def features(text: str) -> CpuFeatures:
        vendor, model, flags = parse_cpuinfo(text)
        return CpuFeatures(vendor=vendor, model_name=model, flags=flags, capability="AVX512")

    dtype, why = rule_train_dtype("cpu", features(SAPPHIRE_RAPIDS))
    assert dtype == "bfloat16" and "avx512_bf16, amx_bf16" in why
    dtype, why = rule_train_dtype("cpu", features(MILAN))
    assert dtype == "float32" and "emulated" in why
    assert rule_train_dtype("cuda", features(MILAN), cuda_bf16=True)[0] == "bfloat16"
    dtype, why = rule_train_dtype("cuda", features(SAPPHIRE_RAPIDS), cuda_bf16=False)  # a V100: the GPU decides
    assert dtype == "float32" and "compute capability" in why
    assert train_dtype("float32", "cuda") == "float32" and train_dtype("bfloat16", "cpu") == "bfloat16"
    expected = "bfloat16" if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8 else "float32"
    assert train_dtype("auto", "cuda") == expected


def test_an_isa_cap_for_onednn_turns_bf16_hardware_off_as_onednn_then_emulates_it() -> None:
    """``ONEDNN_MAX_CPU_ISA`` below a flag's level makes oneDNN, which runs the bf16 matmuls, emulate
    bf16 on that CPU: the rules then answer as on a CPU without the flag (float32), saying why."""
    vendor, model, flags = parse_cpuinfo(SAPPHIRE_RAPIDS)

    def capped(isa: str) -> CpuFeatures:
        return CpuFeatures(vendor=vendor, model_name=model, flags=flags, capability="AVX512", onednn_isa=isa)

    assert onednn_isa_cap({"ONEDNN_MAX_CPU_ISA": "avx2"}) == "AVX2"
    assert onednn_isa_cap({"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == "AVX512_CORE_BF16"  # the older name
    assert onednn_isa_cap({}) == "" and onednn_isa_cap({"ONEDNN_MAX_CPU_ISA": "ALL"}) == ""
    assert onednn_isa_cap({"ONEDNN_MAX_CPU_ISA": "no-such-isa"}) == ""  # oneDNN ignores it too
    avx2 = capped("AVX2")
    assert not (avx2.avx512_bf16 or avx2.amx_bf16 or avx2.native_bf16)
    assert avx2.bf16_flags() == "avx512_bf16, amx_bf16 capped by ONEDNN_MAX_CPU_ISA=AVX2"
    dtype, why = rule_train_dtype("cpu", avx2)
    assert dtype == "float32" and "capped by ONEDNN_MAX_CPU_ISA=AVX2" in why and "emulated" in why
    assert rule_cpu_rollout_dtype(avx2, 20_000_000).dtype == "float32"
    no_amx = capped("AVX512_CORE_BF16")  # AVX-512 bf16 dot products allowed, AMX tiles not
    assert no_amx.avx512_bf16 and not no_amx.amx_bf16 and no_amx.native_bf16
    assert rule_train_dtype("cpu", no_amx)[0] == "bfloat16"
    assert capped("AVX512_CORE_AMX").amx_bf16 and capped("").amx_bf16


def test_this_machine_reads_the_onednn_cap_from_its_environment() -> None:
    """``cpu_features`` (read once per process) carries the cap of the process's environment: a child
    started with ``ONEDNN_MAX_CPU_ISA=AVX2`` has no usable bf16 hardware, whatever this CPU is."""
    code = ("from hybridflow.utils.device import cpu_features, rule_train_dtype; c = cpu_features(); "
            "print(c.onednn_isa, c.native_bf16, rule_train_dtype('cpu')[0])")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["AVX2", "False", "float32"]
