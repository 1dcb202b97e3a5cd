"""What every training loop does around its steps: resume, validation, checkpoints, preemption.

A loop (``sync.py``, ``one_step_off.py``, ``fully_async.py``) is a ``Loop``: how one step's
samples are made and trained on, from the shared phase functions. ``Trainer`` holds one loop and
runs everything else about a run, once:

    resume -> [validate] -> step 1 .. N: loop.train_step, health, validate, save, log -> done

A loop says how to bring its generation to rest (``paused``: validation runs inside it and sees
the actor's newest weights on the rollout) and what of its in-flight state a checkpoint must hold
(``loop_state`` / ``load_loop_state``). The weight versions both sides read are one
``WeightVersions`` the trainer hands the loop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from hybridflow.cluster.worker_group import WorkerError
from hybridflow.config import config_to_yaml
from hybridflow.controller import phases
from hybridflow.controller.checkpoint import STATE_FILE, CheckpointError, CheckpointManager, RemoteCheckpoints
from hybridflow.controller.preemption import Preemption, TrainingInterrupted
from hybridflow.controller.prime import PRIME_ROLE
from hybridflow.controller.profiling import profiled_step
from hybridflow.controller.roles import Roles
from hybridflow.controller.setup import RunSetup
from hybridflow.controller.step_plan import StepPlan
from hybridflow.tracking.health import HealthMonitor, HealthThresholds
from hybridflow.types import TrainBatch
from hybridflow.utils.faults import maybe_fault
from hybridflow.utils.seed import capture_rng_state, restore_rng_state
from hybridflow.utils.storage import is_remote
from hybridflow.utils.timer import PhaseTimer
from hybridflow.utils.watchdog import Watchdog, activity, parse_phase_timeouts
from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker

log = logging.getLogger(__name__)

# The few numbers worth a glance on the progress bar; the console logger prints the rest.
STARTS_ELSEWHERE = -1  # Trainer.rollout_version when the actor's first weights are not the ones the rollout loaded

PROGRESS_KEYS = {"score": "critic/score/mean", "val": "val/score/mean", "s/step": "timing_s/step"}


class WeightVersions:
    """The number of updates behind the actor's weights and behind the ones on the rollout
    replicas. A loop that generates ahead trains on samples from older weights than the actor's."""

    def __init__(self, roles: Roles, plan: StepPlan, rollout: int = 0) -> None:
        self.roles, self.plan = roles, plan
        self.actor = 0
        self.rollout = rollout

    def update(self, batch: TrainBatch, step: int, timer: PhaseTimer) -> dict[str, float]:
        """This step's critic and actor update; the actor's weights become version ``step``."""
        metrics = phases.update(self.roles, self.plan, batch, step, timer)
        self.actor = step
        return metrics

    def push(self) -> None:
        """The actor's weights to the rollout, unless the rollout has them already."""
        if self.rollout != self.actor:
            phases.sync_weights(self.roles, self.actor)
            self.rollout = self.actor

    def restore(self, restarted: list[int], *, generates_ahead: bool) -> None:
        """The rollout's weights to the replicas ``restarted`` mid-round (no other was alive to
        serve; ``RolloutReplicas.ensure_live``). They loaded ``model.path``: that is version 0.
        Later versions come from the actor while it holds them, in a loop that does not generate
        ahead of it (``generates_ahead``: an asynchronous loop's actor may be training past them)."""
        if self.rollout == 0:
            return
        if generates_ahead or self.actor != self.rollout:
            names = ", ".join(f"rollout replica {k}" for k in restarted)
            raise WorkerError(f"{names} restarted while no other replica was alive, but the weights it must serve "
                              f"(version {self.rollout}) are not the actor's (version {self.actor}, the loop trains "
                              f"ahead of the rollout): run 2 or more replicas (trainer.n_workers) to survive this",
                              process_died=True)
        phases.sync_weights(self.roles, self.rollout)


class Loop(Protocol):
    """What a training loop brings to the run: its step, and how to hold it still."""

    def train_step(self, step: int) -> dict[str, float]:
        """One step (counted from 1): samples in, weights updated; its metrics."""
        ...

    def paused(self) -> AbstractContextManager[None]:
        """Generation at rest and the actor's weights on the rollout, for as long as it is held."""
        ...

    def loop_state(self) -> dict[str, Any]:
        """What of the loop's own state a checkpoint holds besides the common state."""
        ...

    def load_loop_state(self, state: dict[str, Any]) -> None:
        """Put back ``loop_state``'s part of a checkpoint (before anything is generated)."""
        ...

    def close(self) -> None:
        """Stop what the loop started (background threads); the run's workers are the run's."""
        ...


# Builds a loop around a run, sharing the trainer's weight versions.
LoopFactory = Callable[[RunSetup, WeightVersions], Loop]


@contextlib.contextmanager
def pushed(versions: WeightVersions) -> Iterator[None]:
    """``Loop.paused`` of a loop with nothing in flight between steps: the newest weights pushed."""
    versions.push()
    yield


class Trainer:
    """The run around a loop's steps."""

    def __init__(self, run: RunSetup, loop: LoopFactory, restarts: int = 0) -> None:
        self.run = run
        # This command's rebuilds so far (trainer.max_restarts; ``controller.restarts``): trainer/restarts.
        self.restarts = restarts
        self.saved: list[Path] = []  # the checkpoints this trainer saved
        self.cfg = run.cfg
        t = self.cfg.trainer
        # trainer.checkpoint_dir: a local folder is the checkpoints' home; a URL is their home and
        # <output_dir>/checkpoints stages them (written and verified there, then uploaded).
        local_root = Path(t.checkpoint_dir).expanduser() if t.checkpoint_dir and not is_remote(t.checkpoint_dir) \
            else run.output_dir / "checkpoints"
        self.checkpoints = CheckpointManager(local_root, t.max_ckpt_to_keep)
        self.remote = RemoteCheckpoints(t.checkpoint_dir, run.storage, t.max_ckpt_to_keep) \
            if is_remote(t.checkpoint_dir) else None
        self.step = 0
        # The rollout loads model.path; an actor that starts from a saved LoRA adapter
        # (actor.lora.adapter_path) holds other weights, pushed before anything is generated (_fit).
        self.versions = WeightVersions(run.roles, run.plan,
                                       STARTS_ELSEWHERE if self.cfg.actor.lora.adapter_path is not None else 0)
        self.loop = loop(run, self.versions)
        run.roles.rollout.restore_weights = functools.partial(self.versions.restore,
                                                              generates_ahead=self.cfg.trainer.mode != "sync")
        h = self.cfg.trainer.health
        self.health = HealthMonitor(
            HealthThresholds(
                zero_variance_group_fraction=h.zero_variance_group_fraction, truncation_ratio=h.truncation_ratio,
                min_entropy=h.min_entropy, logprob_mismatch=h.logprob_mismatch,
                reward_failure_rate=h.reward_failure_rate,
            ),
            repeat_every=h.repeat_every,
        )

    def validate(self) -> dict[str, float]:
        run = self.run
        if run.prompts.val is None:
            return {}
        # Validation measures the actor's newest weights.
        with self.loop.paused(), run.timeline.span("trainer", "testing"):
            return phases.validate(run.roles, run.plan, run.prompts, run.dumps, self.step)

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, float]:
        """Train until the planned number of steps; returns the last step's metrics.

        SIGTERM or Ctrl-C finishes the current step, saves a checkpoint and raises
        ``TrainingInterrupted`` (``preemption``: within ``trainer.preempt_grace_s``; a second signal
        stops at once). A phase that stalls past its limit ends the process through the watchdog,
        naming what it waited on.
        """
        try:
            return self._fit()
        finally:
            self.loop.close()

    def _fit(self) -> dict[str, float]:
        run, trainer_cfg, total_steps = self.run, self.cfg.trainer, self.run.plan.total_steps
        self.resume()
        self.versions.push()  # a no-op unless the actor starts from weights the rollout did not load
        if self.step >= total_steps:
            log.info("run already finished: step %d of %d; nothing to do", self.step, total_steps)
            return {}
        metrics: dict[str, float] = {}
        with self.watchdog(), Preemption(trainer_cfg.preempt_grace_s, self.newest_checkpoint) as interrupt:
            if trainer_cfg.val_before_train and self.step == 0 and run.prompts.val is not None:
                run.tracker.log(self.validate(), step=0)
            while self.step < total_steps:
                self.step += 1
                with profiled_step(run, self.step):
                    metrics = self.loop.train_step(self.step)
                metrics |= self.health(metrics, self.step)
                if trainer_cfg.max_restarts > 0:
                    metrics["trainer/restarts"] = float(self.restarts)
                last = self.step == total_steps
                if last or (trainer_cfg.test_freq > 0 and self.step % trainer_cfg.test_freq == 0):
                    metrics.update(self.validate())
                save = (trainer_cfg.save_freq > 0 and self.step % trainer_cfg.save_freq == 0) or (last and trainer_cfg.save_final)
                # Logged before the save: a kill between the two then re-runs this step after the
                # resume and logs it again (an identical record), where a kill after a save that
                # came first left the checkpoint with no record of its step, never to be written.
                run.tracker.log(metrics, step=self.step)
                saved = (save or (interrupt.requested and not last)) and self.save_checkpoint()
                run.progress.update(self.step, {k: metrics[m] for k, m in PROGRESS_KEYS.items() if m in metrics})
                maybe_fault("after_step", self.step)
                if interrupt.requested and not last:
                    raise interrupt.stopped(self.step, total_steps, saved or None)
        return metrics

    def watchdog(self) -> Watchdog:
        t = self.cfg.trainer
        return Watchdog(t.watchdog_timeout_s, parse_phase_timeouts(t.phase_timeouts))

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path | None:
        """Save one checkpoint; its folder when it was saved. A save that fails (a full disk: "no
        space left on <path>") has removed its partial folder and left the earlier checkpoints
        alone; then the run stops with that ``CheckpointError`` or, with
        ``trainer.on_save_error=warn``, goes on without this checkpoint (None)."""
        with activity("phase", "save_checkpoint"), self.run.timeline.span("trainer", "save_checkpoint"):
            try:
                return self._save_checkpoint()
            except CheckpointError as exc:
                if self.cfg.trainer.on_save_error != "warn":
                    raise
                log.warning("%s; training goes on without this checkpoint (trainer.on_save_error=warn)", exc)
                return None

    def _save_checkpoint(self) -> Path:
        run = self.run
        sampler, actor, critic = run.prompts.sampler, run.roles.actor, run.roles.critic
        state = {
            "step": self.step,
            "epoch": sampler.epoch,
            "sampler": sampler.state_dict(),
            "kl_controller": run.kl_controller.state_dict() if run.kl_controller else None,
            "rng": capture_rng_state(),
        }
        state |= self.loop.loop_state()
        roles = {"critic": lambda d: critic.call_all(CriticWorker.save_checkpoint, str(d))} if critic else {}
        prime = run.roles.prime
        if prime is not None:
            roles[PRIME_ROLE] = lambda d: prime.save_checkpoint(str(d))
        saved = self.checkpoints.save(
            self.step, state, write_actor=lambda d: actor.call_all(ActorWorker.save_checkpoint, str(d)),
            extra_files={"config.yaml": config_to_yaml(self.cfg)}, write_roles=roles,
        )
        if self.remote is not None:
            self.remote.upload(saved)
        self.saved.append(saved)
        return saved

    def newest_checkpoint(self) -> str:
        """Where the same command resumes from, in words (for a stop that could not save)."""
        folders = self.checkpoints.step_folders()
        return (f"the same command resumes from the newest checkpoint, {folders[-1][1]}" if folders else
                "no checkpoint was saved yet: the same command starts over")

    def resume(self) -> None:
        """Continue from a checkpoint (``trainer.resume_mode``). ``auto`` takes the newest one that
        verifies and loads, reporting each newer one skipped, and raises ``CheckpointError`` rather
        than start over when checkpoints exist and none does; ``path`` loads that one or raises."""
        t = self.cfg.trainer
        # This run owns its output folder: what killed saves and deletions left there goes now.
        self.checkpoints.clean_leftovers()
        if t.resume_mode == "disable":
            return
        path = t.resume_from_path
        if t.resume_mode == "path" and is_remote(path):
            assert path is not None
            path = str(RemoteCheckpoints(path.rstrip("/").rsplit("/", 1)[0], self.run.storage, None).download(
                path, self.checkpoints))
        elif t.resume_mode == "auto" and self.remote is not None:
            self.remote.pull_newest(self.checkpoints)
        found = self.checkpoints.resume(t.resume_mode, path, load=self._load_checkpoint)
        if found is None:
            return
        ckpt, state = found
        assert state is not None
        self.step = self.versions.actor = int(state["step"])
        self.versions.push()
        log.info("resumed from %s at step %d", ckpt, self.step)

    def _load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        """Read ``ckpt`` into the actor, the critic, the implicit PRM, sampler, KL controller and RNGs; its trainer
        state.

        Any part may refuse; the manager then loads an older checkpoint over all of it, so each
        part is checked before it changes anything (the actor, critic, sampler and KL controller
        check first; the RNGs are put back as they were)."""
        run, roles = self.run, self.run.roles
        state = self.checkpoints.load_state(ckpt)
        refusals = [r for r in roles.actor.call_all(ActorWorker.load_checkpoint, str(ckpt / "actor")) if r]
        if roles.critic is not None and not refusals:
            refusals = [r for r in roles.critic.call_all(CriticWorker.load_checkpoint, str(ckpt / "critic")) if r]
        if roles.prime is not None and not refusals:
            refusals = roles.prime.load_checkpoint(str(ckpt / PRIME_ROLE))
        if refusals:
            raise CheckpointError(refusals[0])
        rng = capture_rng_state()
        try:
            run.prompts.sampler.load_state_dict(state["sampler"])
            if run.kl_controller is not None and state.get("kl_controller"):
                run.kl_controller.load_state_dict(state["kl_controller"])
            if state.get("rng"):
                restore_rng_state(state["rng"])
            self.loop.load_loop_state(state)
        except (ValueError, TypeError, KeyError) as exc:
            restore_rng_state(rng)
            raise CheckpointError(f"checkpoint state {ckpt / STATE_FILE} does not fit this run: {exc}") from exc
        return state


__all__ = ["Loop", "Trainer", "TrainingInterrupted", "WeightVersions"]
