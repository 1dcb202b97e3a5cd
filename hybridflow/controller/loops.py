"""The training loops by ``trainer.mode``: sibling files that differ in when the shared phases run."""

from __future__ import annotations

from hybridflow.controller.fully_async import FullyAsyncTrainer
from hybridflow.controller.one_step_off import OneStepOffTrainer
from hybridflow.controller.setup import RunSetup
from hybridflow.controller.sync import SyncTrainer
from hybridflow.controller.trainer import Trainer

LOOPS: dict[str, type[Trainer]] = {
    "sync": SyncTrainer,
    "one_step_off": OneStepOffTrainer,
    "fully_async": FullyAsyncTrainer,
}


def make_trainer(run: RunSetup) -> Trainer:
    """The loop ``trainer.mode`` names, around ``run``."""
    return LOOPS[run.cfg.trainer.mode](run)
