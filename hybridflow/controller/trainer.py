"""What every training loop does around its steps: resume, validation, checkpoints, preemption.

A loop (``sync.py``, ``one_step_off.py``) subclasses ``Trainer`` and writes ``train_step``: how
one step's samples are made and trained on. Everything else about a run is here, once:

    resume -> [validate] -> step 1 .. N: train_step, health, validate, save, log -> done

A loop that generates in the background says how to bring generation to rest (``quiesce``:
before validation and checkpoints, so both see the actor's newest weights on the rollout) and
what of its in-flight state a checkpoint must hold (``loop_state`` / ``load_loop_state``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hybridflow.config import config_to_yaml
from hybridflow.controller import phases
from hybridflow.controller.profiling import profiled_step
from hybridflow.controller.checkpoint import STATE_FILE, CheckpointError, CheckpointManager, RemoteCheckpoints
from hybridflow.controller.preemption import Preemption, TrainingInterrupted
from hybridflow.controller.setup import RunSetup
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


class Trainer:
    """The run around a loop's steps. Subclasses implement ``train_step``."""

    def __init__(self, run: RunSetup) -> None:
        self.run = run
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
        # Weight versions: the number of updates behind the actor's weights and behind the ones
        # on the rollout replicas. A loop that generates ahead trains on samples from older
        # weights than the actor's.
        self.actor_version = 0
        # The rollout loads model.path; an actor that starts from a saved LoRA adapter
        # (actor.lora.adapter_path) holds other weights, pushed before anything is generated (_fit).
        self.rollout_version = STARTS_ELSEWHERE if self.cfg.actor.lora.adapter_path is not None else 0
        h = self.cfg.trainer.health
        self.health = HealthMonitor(
            HealthThresholds(
                zero_variance_group_fraction=h.zero_variance_group_fraction, truncation_ratio=h.truncation_ratio,
                min_entropy=h.min_entropy, logprob_mismatch=h.logprob_mismatch,
                reward_failure_rate=h.reward_failure_rate,
            ),
            repeat_every=h.repeat_every,
        )

    # ------------------------------------------------------------------ the loop's part
    def train_step(self) -> dict[str, float]:
        """One step (``self.step``, already counted): samples in, weights updated; its metrics."""
        raise NotImplementedError

    def quiesce(self) -> None:
        """Bring background generation to rest and put the actor's weights on the rollout."""
        self.push_weights()

    def loop_state(self) -> dict[str, Any]:
        """What of the loop's own state a checkpoint holds besides the common state."""
        return {}

    def load_loop_state(self, state: dict[str, Any]) -> None:
        """Put back ``loop_state``'s part of a checkpoint (before anything is generated)."""

    def close(self) -> None:
        """Stop what the loop started (background threads); the run's workers are the run's."""

    # ------------------------------------------------------------------ shared
    def update(self, batch: TrainBatch, timer: PhaseTimer) -> dict[str, float]:
        """This step's critic and actor update; the actor's weights become version ``step``."""
        metrics = phases.update(self.run, batch, self.step, timer)
        self.actor_version = self.step
        return metrics

    def push_weights(self) -> None:
        """The actor's weights to the rollout, unless the rollout has them already."""
        if self.rollout_version != self.actor_version:
            phases.sync_weights(self.run, self.actor_version)
            self.rollout_version = self.actor_version

    def validate(self) -> dict[str, float]:
        if self.run.val_data is None:
            return {}
        self.quiesce()  # validation measures the actor's newest weights
        with self.run.timeline.span("trainer", "testing"):
            return phases.validate(self.run, self.step)

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
            self.close()

    def _fit(self) -> dict[str, float]:
        run, trainer_cfg = self.run, self.cfg.trainer
        self.resume()
        self.push_weights()  # a no-op unless the actor starts from weights the rollout did not load
        if self.step >= run.total_steps:
            log.info("run already finished: step %d of %d; nothing to do", self.step, run.total_steps)
            return {}
        metrics: dict[str, float] = {}
        with self.watchdog(), Preemption(trainer_cfg.preempt_grace_s, self.newest_checkpoint) as interrupt:
            if trainer_cfg.val_before_train and self.step == 0 and run.val_data is not None:
                run.tracker.log(self.validate(), step=0)
            while self.step < run.total_steps:
                self.step += 1
                with profiled_step(run, self.step):
                    metrics = self.train_step()
                metrics |= self.health(metrics, self.step)
                last = self.step == run.total_steps
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
                    raise interrupt.stopped(self.step, run.total_steps, saved or None)
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
        state = {
            "step": self.step,
            "epoch": run.sampler.epoch,
            "sampler": run.sampler.state_dict(),
            "kl_controller": run.kl_controller.state_dict() if run.kl_controller else None,
            "rng": capture_rng_state(),
        }
        state |= self.loop_state()
        critic = run.critic
        roles = {"critic": lambda d: critic.call_all(CriticWorker.save_checkpoint, str(d))} if critic else {}
        saved = self.checkpoints.save(
            self.step, state, write_actor=lambda d: run.actor.call_all(ActorWorker.save_checkpoint, str(d)),
            extra_files={"config.yaml": config_to_yaml(self.cfg)}, write_roles=roles,
        )
        if self.remote is not None:
            self.remote.upload(saved)
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
        self.step = self.actor_version = int(state["step"])
        self.push_weights()
        log.info("resumed from %s at step %d", ckpt, self.step)

    def _load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        """Read ``ckpt`` into the actor, the critic, sampler, KL controller and RNGs; its trainer
        state.

        Any part may refuse; the manager then loads an older checkpoint over all of it, so each
        part is checked before it changes anything (the actor, critic, sampler and KL controller
        check first; the RNGs are put back as they were)."""
        run = self.run
        state = self.checkpoints.load_state(ckpt)
        refusals = [r for r in run.actor.call_all(ActorWorker.load_checkpoint, str(ckpt / "actor")) if r]
        if run.critic is not None and not refusals:
            refusals = [r for r in run.critic.call_all(CriticWorker.load_checkpoint, str(ckpt / "critic")) if r]
        if refusals:
            raise CheckpointError(refusals[0])
        rng = capture_rng_state()
        try:
            run.sampler.load_state_dict(state["sampler"])
            if run.kl_controller is not None and state.get("kl_controller"):
                run.kl_controller.load_state_dict(state["kl_controller"])
            if state.get("rng"):
                restore_rng_state(state["rng"])
            self.load_loop_state(state)
        except (ValueError, TypeError, KeyError) as exc:
            restore_rng_state(rng)
            raise CheckpointError(f"checkpoint state {ckpt / STATE_FILE} does not fit this run: {exc}") from exc
        return state


__all__ = ["Trainer", "TrainingInterrupted"]
