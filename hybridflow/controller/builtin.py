"""The built-in task and model as ordinary files: ``data.builtin_task``'s train/test parquet files
and the tiny model warm-started on it (cached under ``warm_start.cache_dir``), so the rest of
set-up reads them as it reads a user's data and model directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.config import Config
from hybridflow.config.budget import VISUAL_BUILTIN_TASKS
from hybridflow.config.explain import BUILTIN_TINY, warm_start_decision
from hybridflow.config.schema import WarmStartConfig
from hybridflow.config.sections.distillation import BUILTIN_TEACHER
from hybridflow.controller.sft import (
    SFTPair,
    SFTSpec,
    SFTStage,
    prepare_builtin_model,
    prepare_builtin_vl_model,
    prepare_refined_model,
)
from hybridflow.data.tasks.arithmetic import (
    arithmetic_sft_pairs,
    make_arithmetic_rows,
    write_arithmetic_task,
)
from hybridflow.data.tasks.calculator import (
    MIXED_STAGE_LR_SCALE,
    TOOL_ONLY_SHARE,
    calculator_warm_start,
    make_calculator_rows,
    write_calculator_task,
)
from hybridflow.data.tasks.colour_square import write_colour_square_task

log = logging.getLogger(__name__)


BUILTIN_TASK_SEED = 0


# data.builtin_task -> the writer of its train/test parquet files.
BUILTIN_TASK_WRITERS = {"arithmetic": write_arithmetic_task, "calculator": write_calculator_task,
                        "colour_square": write_colour_square_task}


# Built-in tasks whose rows have images: they need a vision-language model.path.
VISUAL_TASKS = VISUAL_BUILTIN_TASKS


def builtin_visual_task(cfg: Config) -> bool:
    """Whether the run trains on a built-in task about images (no data.train_files of its own)."""
    return not cfg.data.train_files and cfg.data.builtin_task in VISUAL_TASKS


@dataclass
class WarmStartRecipe:
    """A built-in task's warm start: the first stage (``spec`` steps on ``pairs``), any later
    stages, and a key naming all of their data (for the model cache)."""

    spec: SFTSpec
    pairs: list[SFTPair]
    stages: list[SFTStage]
    pairs_key: str


def warm_start_recipe(task: str, w: WarmStartConfig, train_size: int) -> WarmStartRecipe:
    """``data.builtin_task``'s warm start with ``warm_start.*`` settings."""
    seed = BUILTIN_TASK_SEED
    if task == "calculator":
        rows = make_calculator_rows(train_size, seed, "train")
        tool_only, mixed = calculator_warm_start(rows, w.tool_call_rate)
        first = round(w.steps * TOOL_ONLY_SHARE)
        stages = [SFTStage(mixed, w.steps - first, lr=w.lr * MIXED_STAGE_LR_SCALE)] if w.steps > first else []
        key = f"calculator-train-{len(rows)}-s{seed}-tools{w.tool_call_rate}-first{TOOL_ONLY_SHARE}"
        return WarmStartRecipe(SFTSpec(steps=first, batch_size=w.batch_size, lr=w.lr, seed=seed), tool_only, stages, key)
    rows = make_arithmetic_rows(train_size, seed, "train")
    spec = SFTSpec(steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=seed, teacher_slip_rate=w.teacher_slip_rate)
    return WarmStartRecipe(spec, arithmetic_sft_pairs(rows, w.teacher_slip_rate), [], f"arithmetic-train-{len(rows)}-s{seed}")


def resolve_builtin(cfg: Config, device: torch.device, model_path: str | None = None) -> tuple[str, list[str], list[str]]:
    """(model dir, train files, val files) with ``builtin:*`` and empty data turned into files.
    ``model_path``: the model's local folder when it is not ``model.path`` itself (a download)."""
    cache = Path(cfg.warm_start.cache_dir).expanduser()
    train_files, val_files = list(cfg.data.train_files), list(cfg.data.val_files)
    d = cfg.data
    if not train_files:
        name = f"{d.builtin_task}-{d.builtin_train_size}-{d.builtin_val_size}-s{BUILTIN_TASK_SEED}"
        write = BUILTIN_TASK_WRITERS[d.builtin_task]
        train_path, val_path = write(cache / "data" / name, d.builtin_train_size, d.builtin_val_size, BUILTIN_TASK_SEED)
        train_files = [str(train_path)]
        val_files = val_files or [str(val_path)]
    model_path = model_path or cfg.model.path
    if model_path == BUILTIN_TINY and builtin_visual_task(cfg):
        warm, reason = warm_start_decision(cfg.warm_start.enable, model_path)
        log.info("built-in vision-language model: %s", reason)
        w = cfg.warm_start
        spec = SFTSpec(steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=BUILTIN_TASK_SEED) if warm else None
        model_path = str(prepare_builtin_vl_model(
            cache, train_file=Path(train_files[0]), spec=spec, device=device, max_prompt_length=d.max_prompt_length,
            data_key=f"{d.builtin_task}-train-{d.builtin_train_size}-s{BUILTIN_TASK_SEED}",
        ))
    elif model_path == BUILTIN_TINY:
        warm, reason = warm_start_decision(cfg.warm_start.enable, model_path)
        log.info("built-in model: %s", reason)
        recipe = warm_start_recipe(d.builtin_task, cfg.warm_start, d.builtin_train_size)
        model_path = str(prepare_builtin_model(
            cache, pairs=recipe.pairs, pairs_key=recipe.pairs_key, spec=recipe.spec if warm else None,
            device=device, stages=recipe.stages,
        ))
    elif model_path.startswith("builtin:"):
        raise ValueError(f"model.path={model_path!r}: the only built-in model is {BUILTIN_TINY}")
    return model_path, train_files, val_files


def resolve_teacher_path(cfg: Config, path: str, device: torch.device) -> str:
    """A teacher's model folder: ``path`` itself, or for ``builtin:tiny-teacher`` the built-in teacher of
    ``distillation.builtin_teacher_steps`` steps (``builtin_teacher``)."""
    if path != BUILTIN_TEACHER:
        if path.startswith("builtin:"):
            raise ValueError(f"distillation teacher {path!r}: the only built-in teacher is {BUILTIN_TEACHER}")
        return path
    return builtin_teacher(cfg, device, cfg.distillation.builtin_teacher_steps)


def builtin_teacher(cfg: Config, device: torch.device, steps: int) -> str:
    """The folder of the built-in student's warm start (``warm_start.*``, the cached model) trained ``steps``
    more SFT steps on the arithmetic task's correct answers only, cached beside it. The student learned the
    skill and a flawed teacher's slip together; this teacher unlearned the slip, so it answers right where
    the student slips."""
    w, d, seed = cfg.warm_start, cfg.data, BUILTIN_TASK_SEED
    recipe = warm_start_recipe("arithmetic", w, d.builtin_train_size)
    student = prepare_builtin_model(Path(w.cache_dir).expanduser(), pairs=recipe.pairs, pairs_key=recipe.pairs_key,
                                    spec=recipe.spec, device=device, stages=recipe.stages)
    rows = make_arithmetic_rows(d.builtin_train_size, seed, "train")
    # Its own shuffle (seed + 1), as a later warm-start stage has; no slips: every answer right.
    spec = SFTSpec(steps=steps, batch_size=w.batch_size, lr=w.lr, seed=seed + 1)
    log.info("built-in teacher: the warm start + %d SFT steps on correct answers (cached)", spec.steps)
    return str(prepare_refined_model(student, pairs=arithmetic_sft_pairs(rows, 0.0),
                                     pairs_key=f"arithmetic-train-{len(rows)}-s{seed}-correct", spec=spec, device=device))
