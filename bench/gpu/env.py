"""Step 1 of the GPU kit: what the machine is, and its two ceilings measured (copy bandwidth and
the bf16 matrix rate), which the later steps divide by (roofline fractions, MFU).

    python -m bench.gpu.env --json env.json [--dry-run]
"""

from __future__ import annotations

import importlib
import pkgutil
import platform
import subprocess

import torch

from bench.gpu.common import Results, copy_bandwidth, matmul_flops, pick_device, step_arguments


OPTIONAL_PACKAGES = {"ray", "fastapi", "uvicorn", "openai", "vllm", "sglang", "mlflow", "wandb", "selenium", "fsspec",
                     "s3fs", "gcsfs", "hydra", "omegaconf"}
"""Extras a module may need that the GPU machine's image lacks: their features are unavailable
there, which is reported, not a failure. Any other import error is."""


def import_every_module() -> dict[str, object]:
    """Import each module of hybridflow; the ones that fail, with the missing package."""
    import hybridflow

    missing_extra, broken = {}, {}
    for info in pkgutil.walk_packages(hybridflow.__path__, "hybridflow."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            root = (exc.name or "").split(".")[0]
            (missing_extra if root in OPTIONAL_PACKAGES else broken)[info.name] = f"no module {exc.name!r}"
        except ImportError as exc:  # a module's own message naming the extra it needs
            text = str(exc)
            optional = any(name in text.lower() for name in OPTIONAL_PACKAGES)
            (missing_extra if optional else broken)[info.name] = text[:300]
        except Exception as exc:  # noqa: BLE001 - any import failure is a finding
            broken[info.name] = f"{type(exc).__name__}: {exc}"[:300]
    return {"unavailable_extras": missing_extra, "broken": broken}


def main() -> None:
    args = step_arguments(__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    results = Results(args.json, "env", args.dry_run)
    device = pick_device(args.dry_run)
    import transformers

    results.put("versions", {"python": platform.python_version(), "torch": torch.__version__,
                             "cuda": torch.version.cuda, "transformers": transformers.__version__,
                             "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None})
    imports = import_every_module()
    results.put("imports", imports)
    if imports["broken"]:
        results.error("import every hybridflow module", ImportError(f"{sorted(imports['broken'])}"))
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
        results.put("bf16_matmul_tflop_s", round(matmul_flops(device, size, torch.bfloat16) / 1e12, 3))


if __name__ == "__main__":
    main()
