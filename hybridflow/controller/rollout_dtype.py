"""``rollout.dtype=auto`` decided once per run, by set-up, and kept for the run's resumes.

An explicit dtype is kept, and ``auto`` on a GPU is bfloat16: nothing to decide. On a CPU with
bf16 hardware ``auto`` measures (``hybridflow.rollout.precision``), and a measurement is timing:
left to each rollout replica, two replicas of one run could sample in two precisions, and a run
started again after a kill could sample in another precision than the run it resumes, which then
no longer reproduces. So set-up measures once, in the controller, hands every replica the answer
as an explicit dtype, and records a measured answer in the run folder (``ROLLOUT_DTYPE_FILE``):
a run started again in that folder takes the recorded answer without measuring.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from hybridflow.config import Config
from hybridflow.models.loading import load_causal_lm
from hybridflow.rollout.base import ROLLOUT_ENGINES, choose_rollout_dtype
from hybridflow.utils.device import cpu_features

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
    model = load_causal_lm(model_path, trust_remote_code=cfg.model.trust_remote_code) if probed else None
    choice = choose_rollout_dtype("auto", device, model=model, batch=r.max_batch_size,
                                  max_logprob_mismatch=cfg.trainer.health.logprob_mismatch, cpu=cpu)
    del model
    if choice.probe is not None:
        _write_record(record, {"dtype": choice.dtype, "reason": choice.reason,
                               "bfloat16_speedup": choice.probe.bfloat16_speedup,
                               "logprob_mismatch": choice.probe.logprob_mismatch})
    return choice.dtype


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
