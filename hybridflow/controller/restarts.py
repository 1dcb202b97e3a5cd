"""``trainer.max_restarts``: a Ray run that rebuilds itself after a worker process died.

A rank whose process dies (killed, out of memory, its node lost: the raylet's death takes every
process on the node) fails the step within seconds with a ``WorkerError`` naming the role, the rank
and its node (``process_died``; ``hybridflow.cluster.ray_group``). With restarts left, the
controller then does what running the same command again would do, in this process: it closes the
run (every worker group, and the placement groups, so the dead node's reservations are given back),
builds it again from the config as the command gave it (Ray places the new groups on the nodes with
room now) and resumes from the newest intact checkpoint by the usual path (``Trainer.resume``).
The steps after that checkpoint are trained again and logged again (readers of metrics.jsonl take
each step's last record), so the run ends with the metrics of a run that was never killed.

Only deaths are retried: a worker's own exception would raise again. ``trainer/restarts`` counts
the restarts of this command; one fault more than ``trainer.max_restarts`` stops the run with the
fault named, as without restarts (and the same command resumes it).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from hybridflow.cluster.worker_group import WorkerError
from hybridflow.config import Config
from hybridflow.controller.loops import make_trainer
from hybridflow.controller.setup import RunSetup, build_run
from hybridflow.controller.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass
class FinishedRun:
    """The run that reached the end (closed), its last step's metrics, and the restarts it took."""

    run: RunSetup
    metrics: dict[str, float]
    restarts: int


def fit_with_restarts(cfg: Config) -> FinishedRun:
    """Build the run and train it; after a worker's death, with ``trainer.max_restarts`` left,
    build it again and resume (module docstring). Every run built is closed before this returns
    or raises."""
    as_given = copy.deepcopy(cfg)  # set-up fills in the config it runs: a rebuild starts from the command's
    limit, restarts, saved = cfg.trainer.max_restarts, 0, False
    while True:
        trainer: Trainer | None = None
        try:
            run = build_run(cfg)
            try:
                trainer = make_trainer(run, restarts)
                return FinishedRun(run, trainer.fit(), restarts)
            finally:
                saved = saved or bool(trainer and trainer.saved)
                run.close()
        except WorkerError as error:
            if not error.process_died or cfg.trainer.output_dir is None:
                raise  # its own code failed (it would again), or it died before the run had a folder
            if restarts >= limit:
                raise WorkerError(f"{error}\n{_not_restarted(limit)}", process_died=True) from error
            restarts += 1
            log.warning("restart %d of trainer.max_restarts=%d: %s; tearing the worker groups down, building them "
                        "again on the nodes with room and resuming from the newest checkpoint", restarts, limit,
                        str(error).splitlines()[0])
            cfg = _rebuilt_config(as_given, cfg.trainer.output_dir, saved)


def _rebuilt_config(as_given: Config, output_dir: str, saved: bool) -> Config:
    """The config of a rebuild: the command's, in the same run folder, resuming from its newest
    checkpoint once this command saved one (before that, as the command said: ``disable`` starts
    over, ``path`` loads that checkpoint again)."""
    cfg = copy.deepcopy(as_given)
    cfg.trainer.output_dir = output_dir
    if saved:
        cfg.trainer.resume_mode, cfg.trainer.resume_from_path = "auto", None
    return cfg


def _not_restarted(limit: int) -> str:
    """Why a worker's death stops the run (the error's last line)."""
    if limit == 0:
        return ("not restarted (trainer.max_restarts=0): the same command resumes from the newest checkpoint; "
                "trainer.max_restarts=N has the run rebuild its workers and resume by itself")
    return (f"not restarted: trainer.max_restarts={limit} restarts were used up; the same command resumes from the "
            f"newest checkpoint")
