"""Step 1 of the GPU kit: what the machine is, and its two ceilings measured (copy bandwidth and
the bf16 matrix rate), which the later steps divide by (roofline fractions, MFU).

    python -m bench.gpu.env --json env.json [--dry-run]
"""

from __future__ import annotations

import platform
import subprocess

import torch

from bench.gpu.common import Results, copy_bandwidth, matmul_flops, pick_device, step_arguments


def main() -> None:
    args = step_arguments(__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    results = Results(args.json, "env", args.dry_run)
    device = pick_device(args.dry_run)
    import transformers

    results.put("versions", {"python": platform.python_version(), "torch": torch.__version__,
                             "cuda": torch.version.cuda, "transformers": transformers.__version__,
                             "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None})
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        results.put("device", {"name": props.name, "multiprocessors": props.multi_processor_count,
                               "memory_gib": round(props.total_memory / 2**30, 1),
                               "capability": f"{props.major}.{props.minor}"})
        with results.guard("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            results.put("nvidia_smi", smi.stdout.strip() or smi.stderr.strip())
    else:
        results.put("device", {"name": f"CPU ({platform.processor() or platform.machine()}), {args.threads} threads"})
    # Sizes: a few GB on the GPU (several times its 60 MB L2, well past launch overhead); toy on a CPU.
    with results.guard("copy bandwidth"):
        nbytes = 4 << 30 if device.type == "cuda" else 64 << 20
        results.put("copy_bandwidth_gb_s", round(copy_bandwidth(device, nbytes) / 1e9, 1))
    with results.guard("bf16 matmul"):
        size = 8192 if device.type == "cuda" else 256
        results.put("bf16_matmul_tflop_s", round(matmul_flops(device, size, torch.bfloat16) / 1e12, 2))


if __name__ == "__main__":
    main()
