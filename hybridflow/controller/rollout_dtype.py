"""``rollout.dtype`` decided once per run, by set-up, recorded in the run folder and kept for its resumes.

An explicit dtype is kept. ``auto`` is a rule (``hybridflow.inference.precision``): bfloat16 on a GPU;
on a CPU bfloat16 only with bf16 hardware and a model of at least ``BF16_MIN_PARAMETERS``
parameters that the native engine decodes in one process, else float32. A rule, not a timing: the
sampling precision changes every sampled token, and a timing taken while other processes run
could make the same command sample in fp32 in one run and in bf16 in the next. ``tune`` measures
(the user asked for timing): a probe of the model itself, once, in the controller.

Set-up hands every replica the answer as an explicit dtype (two replicas of one run never sample
in two precisions) and records it with its reason in the run folder (``ROLLOUT_DTYPE_FILE``): a run
started again in that folder takes the recorded answer, so a resume samples as the run it
continues did even where a new measurement (``tune``) would read otherwise, or where the rule was
changed since. The record's ``reuse`` is the override that makes another run sample the same way.

The record also holds the native engine's weight layout (``inference.compact.resolve_weight_layout``,
a rule of the CPU's vendor and the dtype; in fp32 the layouts round differently): a resume on hardware
where the rule gives another layout says that its rollouts will not be bitwise the ones the
uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from hybridflow.config import Config
from hybridflow.config.budget import read_model_shape
from hybridflow.models.loading import load_causal_lm
from hybridflow.rollout.base import ROLLOUT_DTYPE_RULES, choose_rollout_dtype
from hybridflow.rollout.factory import ROLLOUT_ENGINES
from hybridflow.inference.compact import layouts_round_alike, resolve_weight_layout
from hybridflow.inference.precision import DtypeChoice
from hybridflow.utils.device import cpu_features, parse_dtype

log = logging.getLogger(__name__)

ROLLOUT_DTYPE_FILE = "rollout_dtype.json"
RECORDED_DTYPES = ("float32", "bfloat16")


def resolve_run_rollout_dtype(cfg: Config, device: torch.device, model_path: str, output_dir: Path) -> str:
    """The dtype every rollout replica of this run samples in (module docstring)."""
    r = cfg.rollout
    record = output_dir / ROLLOUT_DTYPE_FILE
    layout = _weight_layout if ROLLOUT_ENGINES[r.name].probes_cpu_precision else _no_layout
    recorded = read_record(record) if r.dtype in ROLLOUT_DTYPE_RULES else None
    if recorded is not None:
        log.info("rollout.dtype=%s: %s, as this run folder recorded when the run started (%s)", r.dtype,
                 recorded["dtype"], record)
        _check_layout(recorded, layout(device, recorded["dtype"]), record)
        return str(recorded["dtype"])
    choice = _decide(cfg, device, model_path)
    fields: dict[str, Any] = {"dtype": choice.dtype, "rollout.dtype": r.dtype, "reason": choice.reason}
    if choice.probe is not None:
        fields |= {"bfloat16_speedup": choice.probe.bfloat16_speedup, "logprob_mismatch": choice.probe.logprob_mismatch,
                   "batch": choice.probe.batch}
    fields |= layout(device, choice.dtype)
    fields["reuse"] = f"rollout.dtype={choice.dtype}"
    write_record(record, fields)
    if r.dtype == "tune":
        log.info("rollout.dtype=tune measured %s (%s); recorded in %s: pass rollout.dtype=%s to sample the same "
                 "way in other runs", choice.dtype, choice.reason, record, choice.dtype)
    return choice.dtype


def _decide(cfg: Config, device: torch.device, model_path: str) -> DtypeChoice:
    """``rollout.dtype`` resolved for a replica of this config: the native engine in one process is
    sized (``auto``) or measured (``tune``); any other engine's decode is not what was measured."""
    r = cfg.rollout
    native = ROLLOUT_ENGINES[r.name].probes_cpu_precision and r.tensor_model_parallel_size == 1
    cpu = cpu_features()
    shape = read_model_shape(model_path) if native else None
    measured = native and r.dtype == "tune" and device.type == "cpu" and cpu.native_bf16
    model = load_causal_lm(model_path, trust_remote_code=cfg.model.trust_remote_code,
                           override_config=cfg.model.override_config) if measured else None
    return choose_rollout_dtype(r.dtype, device, model=model, batch=r.max_batch_size, cpu=cpu,
                                max_logprob_mismatch=cfg.trainer.health.logprob_mismatch,
                                num_parameters=None if shape is None else shape.num_parameters)


def _weight_layout(device: torch.device, dtype: str) -> dict[str, str]:
    return {"weight_layout": resolve_weight_layout("auto", device, parse_dtype(dtype))}


def _no_layout(device: torch.device, dtype: str) -> dict[str, str]:
    return {}


def _check_layout(recorded: dict[str, Any], now: dict[str, str], record: Path) -> None:
    started = recorded.get("weight_layout")
    if started is None or not now or layouts_round_alike(started, now["weight_layout"], parse_dtype(recorded["dtype"])):
        return  # the same layout, or another with the same numbers: nothing to warn of
    log.warning("%s: the run started with the native engine's %s weight layout; this machine's is %s, which "
                "rounds differently: the resumed run's rollouts will not be bitwise the uninterrupted run's",
                record, started, now["weight_layout"])


def read_record(record: Path) -> dict[str, Any] | None:
    """What ``record`` holds, or None when there is none. A record that cannot be read is an error
    naming the file: guessing would break the reproduction the record exists for."""
    if not record.is_file():
        return None
    try:
        fields = json.loads(record.read_text(encoding="utf-8"))
        dtype = fields["dtype"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{record} is damaged ({error}): it records the rollout dtype this run started with; "
                         "delete it to decide again, or set rollout.dtype=float32|bfloat16") from None
    if dtype not in RECORDED_DTYPES:
        raise ValueError(f"{record} records rollout dtype {dtype!r}, not one of {', '.join(RECORDED_DTYPES)}; "
                         "delete it to decide again, or set rollout.dtype explicitly")
    return fields


def write_record(record: Path, fields: dict[str, object]) -> None:
    """Write the JSON ``record`` atomically: a kill mid-write leaves the old state, never half a file.
    The temporary name carries the writer's pid (``run_folder.clean_leftovers`` knows it). Every
    record set-up keeps in the run folder is written so (rollout dtype, token budgets, placement)."""
    partial = record.with_name(f".{record.name}.tmp-{os.getpid()}")
    partial.write_text(json.dumps(fields, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, record)
