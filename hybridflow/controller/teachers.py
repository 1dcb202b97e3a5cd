"""On-policy distillation's teachers as roles: one worker group per distinct teacher model (the reference
role's worker with the teacher's weights, one rank per actor rank) or, for a teacher path that is a URL, a
client of that OpenAI-compatible server (``serving/teacher_client``); which one scores each data_source, and
the per-token logprobs of the step's samples under their teachers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hybridflow.cluster.backends import build_worker_group
from hybridflow.cluster.ray_group import Placement
from hybridflow.cluster.worker_group import WorkerGroup
from hybridflow.config import Config, ConfigError
from hybridflow.config.layout import data_parallel_size
from hybridflow.config.sections.distillation import is_teacher_server
from hybridflow.controller.builtin import resolve_teacher_path
from hybridflow.controller.preflight import check_teacher_tokenizer
from hybridflow.serving.teacher_client import TeacherServer
from hybridflow.types import RefBatch, TrainBatch, Trajectory
from hybridflow.workers.reference import ReferenceSetup, ReferenceWorker

log = logging.getLogger(__name__)

DEFAULT = None  # the teacher of every data_source distillation.teachers does not name


def teacher_paths(cfg: Config) -> dict[str | None, str]:
    """distillation's teachers as configured, {data_source (None: the default): model path}."""
    dist = cfg.distillation
    paths: dict[str | None, str] = dict(dist.teachers)
    if dist.teacher.path is not None:
        paths[DEFAULT] = dist.teacher.path
    return paths


def teacher_roles(paths: dict[str | None, str]) -> dict[str, str]:
    """{role name: model path}, one role per distinct path in first-named order: ``teacher``, ``teacher_1``, ..."""
    distinct = list(dict.fromkeys(paths[source] for source in sorted(paths, key=lambda s: (s is not None, s or ""))))
    return {("teacher" if k == 0 else f"teacher_{k}"): path for k, path in enumerate(distinct)}


def teacher_key(source: str | None) -> str:
    """The config key that names a teacher: distillation.teacher.path, or distillation.teachers.<source>."""
    return "distillation.teacher.path" if source is DEFAULT else f"distillation.teachers.{source}"


def naming_keys(paths: dict[str | None, str]) -> dict[str, str]:
    """{path: the first config key that names it}, for errors and logs."""
    return {path: teacher_key(source) for source, path in reversed(list(paths.items()))}


def prepare_teacher_dirs(cfg: Config, device: torch.device, student_tokenizer: Any) -> tuple[dict[str, str], list[str]]:
    """({role: the teacher's model folder}, notes): built-in teachers made (cached), and every teacher's tokenizer
    compared with the student's (a ``ConfigError`` on the key that names a teacher that differs). A teacher server
    has no folder: it is asked here whether it answers, fits the run's samples and shares the tokenizer."""
    paths = teacher_paths(cfg)
    key_of = naming_keys(paths)
    dirs, notes = {}, []
    for role, path in teacher_roles(paths).items():
        if is_teacher_server(path):
            note = check_teacher_server(cfg, path, key_of[path], role, student_tokenizer)
            notes += [note] if note is not None else []
            continue
        dirs[role] = resolve_teacher_path(cfg, path, device)
        note = check_teacher_tokenizer(student_tokenizer, dirs[role], key_of[path], cfg.distillation.teacher.trust_remote_code)
        if note is not None:
            notes.append(note)
    return dirs, notes


def check_teacher_server(cfg: Config, url: str, key: str, role: str, student_tokenizer: Any) -> str | None:
    """A teacher server answers, its context holds the longest sample (prompt + response, plus the token a
    completion draws), and it reads the student's token ids alike (``TeacherServer.check_tokenizer``)."""
    server = TeacherServer(url, cfg.distillation.server, key=key, role=role)
    try:
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length + 1
        context = server.max_model_len()
        if context is not None and context < longest:
            raise ConfigError(f"{key}={url!r} serves a context of {context} tokens, but a sample and the token a "
                              f"completion draws take up to {longest} (data.max_prompt_length + "
                              "data.max_response_length + 1); serve it with a longer --max-model-len", key=key)
        return server.check_tokenizer(student_tokenizer)
    finally:
        server.close()


def check_teacher_sources(cfg: Config, data_sources: Sequence[str]) -> None:
    """Every data_source of the training rows has a teacher (a ``ConfigError`` naming those that have none)."""
    paths = teacher_paths(cfg)
    if DEFAULT in paths:
        return
    missing = sorted(set(data_sources) - set(paths))
    if missing:
        raise ConfigError(f"distillation.teachers has no teacher for the training rows of data_source {missing} and "
                          "distillation.teacher.path is null; name them in distillation.teachers or set "
                          "distillation.teacher.path (the teacher of every other data_source)",
                          key="distillation.teachers")


class TeacherScores(NamedTuple):
    logprobs: torch.Tensor  # (B, R) each sample's response-token logprobs under its teacher
    metrics: dict[str, float]  # the teacher servers' counters (serving/teacher_client); empty without one


@dataclass(frozen=True)
class Teachers:
    """The teachers' worker groups (and servers) by role name, and which role scores each data_source."""

    groups: dict[str, WorkerGroup[ReferenceWorker]]
    by_source: dict[str, str]  # data_source -> role name (distillation.teachers)
    default: str | None  # the role of every other data_source (distillation.teacher.path); None: no default
    servers: dict[str, TeacherServer] = field(default_factory=dict)  # the roles whose teacher is a server

    def role_of(self, data_source: str) -> str:
        role = self.by_source.get(data_source, self.default)
        if role is None:
            raise ValueError(f"data_source {data_source!r} has no teacher: distillation.teachers names "
                             f"{sorted(self.by_source)} and distillation.teacher.path is null; add it to "
                             "distillation.teachers or set distillation.teacher.path")
        return role

    def logprobs(self, batch: TrainBatch | RefBatch, data_sources: Sequence[str],
                 samples: Sequence[Trajectory] = ()) -> TeacherScores:
        """Each sample's response-token logprobs under its data_source's teacher. A teacher's rows are split
        over its ranks evenly: rows are repeated up to a multiple of its ranks and the copies dropped after. A
        server teacher scores ``samples`` (the batch's trajectories, row for row); a sample it leaves unscored gets
        the student's own logprobs (``batch.old_logprobs``: no distillation signal), counted in the metrics."""
        rows_of: dict[str, list[int]] = {}
        for row, source in enumerate(data_sources):
            rows_of.setdefault(self.role_of(source), []).append(row)
        by_row: dict[int, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        for role, rows in rows_of.items():
            if role in self.servers:
                metrics |= self._server_logprobs(self.servers[role], batch, rows, samples, by_row)
                continue
            group = self.groups[role]
            if len(rows) == batch.batch_size and batch.batch_size % group.world_size == 0:
                part = batch  # one teacher for the whole batch: scored as the reference scores it
            else:
                part = batch.select(rows + [rows[-1]] * (-len(rows) % group.world_size))
            scored = torch.cat(group.split_gather(ReferenceWorker.compute_ref_logprobs, part))
            by_row.update(zip(rows, scored))  # the repeated rows' copies fall off the end
        return TeacherScores(torch.cat([by_row[row][None] for row in range(batch.batch_size)]), metrics)

    @staticmethod
    def _server_logprobs(server: TeacherServer, batch: TrainBatch | RefBatch, rows: list[int],
                         samples: Sequence[Trajectory], by_row: dict[int, torch.Tensor]) -> dict[str, float]:
        """``rows`` scored by ``server`` into ``by_row`` (each (R,), 0 past the response); returns its metrics."""
        assert len(samples) == batch.batch_size, "a teacher server scores the batch's trajectories, row for row"
        assert batch.old_logprobs is not None, "distillation computes the actor's logprobs before the teachers'"
        width = batch.old_logprobs.shape[1]
        if any(samples[row].multi_modal is not None for row in rows):
            raise RuntimeError(f"distillation: {server.key}={server.url!r} scores token ids only, but the step has "
                               "samples with images; use a local teacher model for vision-language rows")
        scored, metrics = server.score([(samples[row].prompt_ids, samples[row].response_ids[:width]) for row in rows])
        for row, result in zip(rows, scored, strict=True):
            if result.logprobs is None:
                by_row[row] = batch.old_logprobs[row].clone()  # reverse KL 0: the task advantage alone
                continue
            values = batch.old_logprobs.new_zeros(width)
            values[: len(result.logprobs)] = torch.tensor(result.logprobs, dtype=values.dtype)
            by_row[row] = values
        return metrics

    def named_groups(self) -> list[tuple[str, WorkerGroup[ReferenceWorker]]]:
        return list(self.groups.items())

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        for server in self.servers.values():
            server.close()


def build_teachers(cfg: Config, resolved: dict[str, str], device: torch.device,
                   placements: dict[str, Placement], actor_log_prob_budget: int | None) -> Teachers:
    """The teachers' groups: for each role of ``teacher_roles`` a reference worker group on ``resolved[role]``
    (the model folder), sharded and micro-batched as the reference is; ranks and placement as the actor's.
    Their token budget is ``distillation.log_prob_max_token_len_per_gpu``, else ``actor_log_prob_budget`` (the
    actor's, which the run folder records): never one derived from the memory free now, which a resume
    would not reproduce."""
    dist, a, d = cfg.distillation, cfg.actor, cfg.data
    paths = teacher_paths(cfg)
    roles = teacher_roles(paths)
    role_of_path = {path: role for role, path in roles.items()}
    groups: dict[str, WorkerGroup[ReferenceWorker]] = {}
    key_of = naming_keys(paths)
    servers = {role: TeacherServer(path, dist.server, key=key_of[path], role=role)
               for role, path in roles.items() if is_teacher_server(path)}
    try:
        for role, path in roles.items():
            if role in servers:
                log.info("distillation: %s is the server %s", role, path)
                continue
            setup = ReferenceSetup(
                model_path=resolved[role], dtype=cfg.model.dtype, device=device, temperature=cfg.rollout.temperature,
                micro_batch_size=dist.log_prob_micro_batch_size_per_gpu, use_remove_padding=a.use_remove_padding,
                use_dynamic_bsz=a.use_dynamic_bsz, longest_sample=d.max_prompt_length + d.max_response_length,
                max_token_len=dist.log_prob_max_token_len_per_gpu or actor_log_prob_budget,
                fsdp_size=a.fsdp_config.fsdp_size, offload_params=a.fsdp_config.param_offload,
                trust_remote_code=dist.teacher.trust_remote_code, use_torch_compile=a.use_torch_compile,
            )
            groups[role] = build_worker_group(cfg.trainer.backend, role,
                                              lambda r, w, setup=setup: ReferenceWorker(r, w, setup),
                                              data_parallel_size(cfg.trainer), placements.get(role))
            log.info("distillation: %s is %s (%s)", role, path, resolved[role])
    except BaseException:
        for group in groups.values():  # nobody else holds the groups started so far
            group.close()
        for server in servers.values():
            server.close()
        raise
    by_source = {source: role_of_path[path] for source, path in paths.items() if source is not None}
    default = role_of_path[paths[DEFAULT]] if DEFAULT in paths else None
    return Teachers(groups, by_source, default, servers)
