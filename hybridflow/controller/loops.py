"""The training loops by ``trainer.mode``: sibling files that differ in when the shared phases run."""

from __future__ import annotations

from hybridflow.controller.fully_async import FullyAsyncLoop
from hybridflow.controller.one_step_off import OneStepOffLoop
from hybridflow.controller.setup import RunSetup
from hybridflow.controller.sync import SyncLoop
from hybridflow.controller.trainer import LoopFactory, Trainer

LOOPS: dict[str, LoopFactory] = {
    "sync": SyncLoop,
    "one_step_off": OneStepOffLoop,
    "fully_async": FullyAsyncLoop,
}


def make_trainer(run: RunSetup, restarts: int = 0) -> Trainer:
    """The run around the loop ``trainer.mode`` names (``restarts``: this command's rebuilds so far)."""
    return Trainer(run, LOOPS[run.cfg.trainer.mode], restarts)
