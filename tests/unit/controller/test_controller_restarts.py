"""trainer.max_restarts's policy (``hybridflow.controller.restarts``): which faults rebuild the run,
from which config, how many times, and what stops it. Set-up and the trainer are scripted here; the
real rebuild on a Ray cluster that lost a node is tests/e2e/test_e2e_ray_multinode.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.cluster.worker_group import WorkerError
from hybridflow.config import load_config
from hybridflow.controller import restarts

DEATH = "actor rank 1 on node 127.0.0.1 (id abc) died in ActorWorker.update_actor (its process exited)"


class ScriptedRuns:
    """``build_run`` and ``make_trainer`` for ``fit_with_restarts``: each build records its config;
    each fit raises the next scripted fault (None: finishes), saving a checkpoint first when asked."""

    def __init__(self, faults: list[WorkerError | None], *, saves: bool = True) -> None:
        self.faults, self.saves = list(faults), saves
        self.configs: list[tuple[str, str | None, str]] = []  # (resume_mode, resume_from_path, output_dir)
        self.restarts_seen: list[int] = []
        self.closed = 0

    def build_run(self, cfg):
        cfg.trainer.output_dir = cfg.trainer.output_dir or "runs/first"  # as set-up names the folder
        self.configs.append((cfg.trainer.resume_mode, cfg.trainer.resume_from_path, cfg.trainer.output_dir))
        scripted = self

        class Run:
            def close(self) -> None:
                scripted.closed += 1

        return Run()

    def make_trainer(self, run, restarts_so_far):
        self.restarts_seen.append(restarts_so_far)
        scripted = self

        class Trainer:
            saved = [Path("global_step_1")] if scripted.saves else []

            def fit(self):
                fault = scripted.faults.pop(0)
                if fault is not None:
                    raise fault
                return {"trainer/restarts": float(restarts_so_far)}

        return Trainer()


@pytest.fixture
def script(monkeypatch):
    def install(faults, **kwargs) -> ScriptedRuns:
        scripted = ScriptedRuns(faults, **kwargs)
        monkeypatch.setattr(restarts, "build_run", scripted.build_run)
        monkeypatch.setattr(restarts, "make_trainer", scripted.make_trainer)
        return scripted

    return install


def config(*overrides: str):
    return load_config("grpo", overrides=["trainer.backend=ray", *overrides])


def test_a_death_rebuilds_the_run_and_resumes_from_the_newest_checkpoint(script, caplog) -> None:
    runs = script([WorkerError(DEATH, process_died=True), None])
    finished = restarts.fit_with_restarts(config("trainer.max_restarts=1", "trainer.resume_mode=disable"))
    assert finished.restarts == 1 and finished.metrics == {"trainer/restarts": 1.0}
    assert runs.restarts_seen == [0, 1] and runs.closed == 2
    # The first build as the command said; the rebuild in the same folder, from the checkpoint it saved.
    assert runs.configs == [("disable", None, "runs/first"), ("auto", None, "runs/first")]
    assert f"restart 1 of trainer.max_restarts=1: {DEATH}" in caplog.text


def test_before_any_checkpoint_the_rebuild_resumes_as_the_command_said(script) -> None:
    runs = script([WorkerError(DEATH, process_died=True), None], saves=False)
    restarts.fit_with_restarts(config("trainer.max_restarts=2", "trainer.resume_mode=path",
                                      "trainer.resume_from_path=/ckpt/global_step_4"))
    assert runs.configs[1][:2] == ("path", "/ckpt/global_step_4")


@pytest.mark.parametrize("limit, note", [
    (0, "not restarted (trainer.max_restarts=0): the same command resumes from the newest checkpoint"),
    (2, "not restarted: trainer.max_restarts=2 restarts were used up"),
])
def test_one_death_past_the_limit_stops_the_run_naming_the_fault(script, limit, note) -> None:
    runs = script([WorkerError(DEATH, process_died=True)] * (limit + 1))
    with pytest.raises(WorkerError, match="not restarted") as stopped:
        restarts.fit_with_restarts(config(f"trainer.max_restarts={limit}"))
    assert str(stopped.value).splitlines() == [DEATH, note + str(stopped.value).split(note, 1)[1]]
    assert stopped.value.process_died
    assert len(runs.configs) == limit + 1 and runs.closed == limit + 1


def test_a_workers_own_error_is_never_retried(script) -> None:
    own = WorkerError("actor rank 0 failed in ActorWorker.update_actor: ValueError('bad batch')")
    runs = script([own, None])
    with pytest.raises(WorkerError) as stopped:
        restarts.fit_with_restarts(config("trainer.max_restarts=3"))
    assert stopped.value is own and len(runs.configs) == 1
