"""The ``distillation`` section: ranges, and a teacher for the run when it is on. Whether a teacher shares the
student's tokenizer needs both tokenizers loaded: set-up checks it (``controller/preflight.check_teacher_tokenizer``)
before any model loads."""

from __future__ import annotations

from hybridflow.config.checks.report import Report
from hybridflow.config.schema import Config
from hybridflow.config.sections.distillation import BUILTIN_TEACHER, is_teacher_server


def check_distillation(cfg: Config, report: Report) -> None:
    dist = cfg.distillation
    if dist.kl_coef < 0:
        report.error(f"distillation.kl_coef={dist.kl_coef} must be >= 0 (the weight of the reverse-KL advantage)")
    if dist.reward_weight < 0:
        report.error(f"distillation.reward_weight={dist.reward_weight} must be >= 0 (the task advantage's weight)")
    if not 0.0 <= dist.discount <= 1.0:
        report.error(f"distillation.discount={dist.discount} must be in [0, 1] (0: each token's own reverse KL)")
    if dist.log_prob_micro_batch_size_per_gpu < 1:
        report.error(f"distillation.log_prob_micro_batch_size_per_gpu={dist.log_prob_micro_batch_size_per_gpu} "
                     "must be >= 1")
    server = dist.server
    if server.max_concurrency < 1:
        report.error(f"distillation.server.max_concurrency={server.max_concurrency} must be >= 1")
    if server.timeout_s <= 0 or server.backoff_s < 0 or server.max_retries < 0:
        report.error(f"distillation.server: timeout_s={server.timeout_s} must be > 0, backoff_s={server.backoff_s} "
                     f"and max_retries={server.max_retries} >= 0")
    if dist.builtin_teacher_steps < 1:
        report.error(f"distillation.builtin_teacher_steps={dist.builtin_teacher_steps} must be >= 1")
    bad = {source: path for source, path in dist.teachers.items() if not isinstance(path, str) or not path}
    if bad:
        report.error(f"distillation.teachers maps a data_source to a model path (a string); these are not: {bad}")
    if not dist.enable:
        if dist.teacher.path is not None or dist.teachers:
            report.warn("distillation.teacher.path / distillation.teachers are set but distillation.enable=false: "
                        "no teacher scores this run")
        return
    if dist.teacher.path is None and not dist.teachers:
        report.error("distillation.teacher.path is null and distillation.teachers is empty: distillation.enable=true "
                     "needs a teacher (a model directory with the student's tokenizer, or builtin:tiny-teacher)")
    if dist.kl_coef == 0:
        report.warn("distillation.kl_coef=0: the teachers are loaded and scored but do not change the advantages")
    named = {"distillation.teacher.path": dist.teacher.path,
             **{f"distillation.teachers.{source}": path for source, path in dist.teachers.items()}}
    for key, path in named.items():
        if not isinstance(path, str) or not path.startswith("builtin:"):
            continue
        if path != BUILTIN_TEACHER:
            report.error(f"{key}={path!r}: the only built-in teacher is {BUILTIN_TEACHER}")
        elif cfg.data.builtin_task != "arithmetic":
            report.error(f"{key}={BUILTIN_TEACHER} knows the built-in arithmetic task only, but data.builtin_task="
                         f"{cfg.data.builtin_task}; use a teacher model for that task")
    servers = [key for key, path in named.items() if isinstance(path, str) and is_teacher_server(path)]
    if servers and cfg.rollout.temperature != 1.0:
        report.warn(f"{', '.join(servers)}: a teacher server's prompt logprobs are the raw model's (temperature 1, as "
                    f"vLLM returns them), a local teacher's and the student's at rollout.temperature="
                    f"{cfg.rollout.temperature}: the reverse KL compares distributions at different temperatures")
