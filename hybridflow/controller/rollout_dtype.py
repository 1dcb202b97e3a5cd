"""``rollout.dtype=auto`` decided once per run, by set-up, and kept for the run's resumes.

An explicit dtype is kept, and ``auto`` on a GPU is bfloat16: nothing to decide. On a CPU with
bf16 hardware ``auto`` measures (``hybridflow.rollout.precision``), and a measurement is timing:
left to each rollout replica, two replicas of one run could sample in two precisions, and a run
started again after a kill could sample in another precision than the run it resumes, which then
no longer reproduces. So set-up measures once, in the controller, hands every replica the answer
as an explicit dtype, and records a measured answer in the run folder (``ROLLOUT_DTYPE_FILE``):
a run started again in that folder takes the recorded answer without measuring.

Two runs of one config on one machine should sample in one precision too (an A/B comparison, a
test that compares runs), and a probe of a small model under load can read either way (seen:
0.88x and 3.9x for the same 0.9M model in two runs of one CI job). So the first measurement on
a machine is kept for every later run of the same model, batch, threads and threshold
(``machine_record``, under ``warm_start.cache_dir``), first writer wins: runs that measured at the
same time all take the answer that was written first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from hybridflow.config import Config
from hybridflow.models.loading import load_causal_lm
from hybridflow.rollout.base import ROLLOUT_ENGINES, choose_rollout_dtype
from hybridflow.utils.device import CpuFeatures, cpu_features

log = logging.getLogger(__name__)

ROLLOUT_DTYPE_FILE = "rollout_dtype.json"
RECORDED_DTYPES = ("float32", "bfloat16")


def resolve_run_rollout_dtype(cfg: Config, device: torch.device, model_path: str, output_dir: Path) -> str:
    """The dtype every rollout replica of this run samples in (module docstring)."""
    r = cfg.rollout
    if r.dtype != "auto":
        return r.dtype
    record = output_dir / ROLLOUT_DTYPE_FILE
    recorded = read_recorded_dtype(record)
    if recorded is not None:
        log.info("rollout.dtype=auto: %s, as this run folder recorded when the run started (%s)", recorded, record)
        return recorded
    # Only a single-process native replica decodes what the probe times (EngineSpec.probes_cpu_precision);
    # a tensor-parallel replica splits each matmul over ranks, so it keeps auto's unmeasured answer.
    cpu = cpu_features()
    probed = (device.type == "cpu" and ROLLOUT_ENGINES[r.name].probes_cpu_precision
              and r.tensor_model_parallel_size == 1 and cpu.native_bf16)
    machine = machine_record(cfg, model_path, cpu) if probed else None
    known = None if machine is None else _read_machine_record(machine)
    if machine is not None and known is not None:
        log.info("rollout.dtype=auto: %s, as measured on this machine for this model before (%s)", known, machine)
        _write_record(record, {**json.loads(machine.read_text(encoding="utf-8")), "machine_record": str(machine)})
        return known
    model = load_causal_lm(model_path, trust_remote_code=cfg.model.trust_remote_code) if probed else None
    choice = choose_rollout_dtype("auto", device, model=model, batch=r.max_batch_size,
                                  max_logprob_mismatch=cfg.trainer.health.logprob_mismatch, cpu=cpu)
    del model
    if choice.probe is None:
        return choice.dtype
    fields: dict[str, object] = {"dtype": choice.dtype, "reason": choice.reason,
                                 "bfloat16_speedup": choice.probe.bfloat16_speedup,
                                 "logprob_mismatch": choice.probe.logprob_mismatch}
    if machine is not None and not _write_once(machine, fields):  # another run measured first: its answer
        fields = {**json.loads(machine.read_text(encoding="utf-8")), "machine_record": str(machine)}
    _write_record(record, fields)
    return str(fields["dtype"])


def machine_record(cfg: Config, model_path: str, cpu: CpuFeatures) -> Path:
    """Where this machine keeps the measured answer for this model and these settings: keyed by
    the CPU, torch, the model's files (config, and each weight file's size and time), the
    replicas' batch, torch's threads and the logprob threshold."""
    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    key = {
        "cpu": [cpu.model_name, cpu.capability, sorted(cpu.flags & {"avx512_bf16", "amx_bf16"})],
        "torch": torch.__version__,
        "config": (folder / "config.json").read_text(encoding="utf-8") if (folder / "config.json").is_file() else "",
        "weights": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "batch": cfg.rollout.max_batch_size, "threads": torch.get_num_threads(),
        "max_logprob_mismatch": cfg.trainer.health.logprob_mismatch,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cfg.warm_start.cache_dir).expanduser() / "rollout_dtype" / f"{digest}.json"


def _read_machine_record(path: Path) -> str | None:
    """The dtype a machine record holds; a damaged one is removed (measured again), not an error:
    no run depends on it the way a resumed run depends on its own record."""
    try:
        return read_recorded_dtype(path)
    except ValueError as error:
        log.warning("rollout.dtype=auto: ignoring and removing %s (%s)", path, str(error).split(" (")[0])
        path.unlink(missing_ok=True)
        return None


def _write_once(path: Path, fields: dict[str, object]) -> bool:
    """Create ``path`` holding ``fields`` unless it exists (atomically: a reader sees all or nothing);
    False when another run created it first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(fields, indent=1) + "\n", encoding="utf-8")
    try:
        os.link(partial, path)  # fails if it exists: the first writer wins
        return True
    except FileExistsError:
        return False
    finally:
        partial.unlink(missing_ok=True)


def read_recorded_dtype(record: Path) -> str | None:
    """The dtype ``record`` holds, or None when there is none. A record that cannot be read is
    an error naming the file: guessing would break the reproduction the record exists for."""
    if not record.is_file():
        return None
    try:
        dtype = json.loads(record.read_text(encoding="utf-8"))["dtype"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{record} is damaged ({error}): it records the rollout dtype this run started with; "
                         "delete it to measure again, or set rollout.dtype=float32|bfloat16") from None
    if dtype not in RECORDED_DTYPES:
        raise ValueError(f"{record} records rollout dtype {dtype!r}, not one of {', '.join(RECORDED_DTYPES)}; "
                         "delete it to measure again, or set rollout.dtype explicitly")
    return dtype


def _write_record(record: Path, fields: dict[str, object]) -> None:
    """Write ``record`` atomically: a kill mid-write leaves the old state (no file), never half a file."""
    partial = record.with_name(record.name + ".tmp")
    partial.write_text(json.dumps(fields, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, record)
