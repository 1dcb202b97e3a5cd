"""``hybridflow sft``: supervised fine-tuning of a model on the user's conversations.

The data (``hybridflow.data.sft``: loss on assistant tokens only) is read, checked and tokenised
once in the launching process, so a bad row is a one-line ``data error`` before any rank starts.
Training is SPMD (``controller.ranks``): with one rank on the local backend it runs in this process;
with ``trainer.n_workers`` (CPU) or ``n_gpus_per_node x nnodes`` ranks on the local backend, each rank
is a process started from a forkserver (never a fork of this process, whose threads and locks a fork
would copy) and joins a gloo/NCCL group; with ``trainer.backend=ray`` each rank is a Ray actor placed
as the RL trainer's actor ranks are (one cluster node or several). The model is sharded with FSDP2
as the actor's is.

Every rank runs ``hybridflow.controller.sft.sft_loop``, the loop of the built-in warm start, on
its share of each batch, with the actor's engine set-up: ``actor.optim``, ``actor.lora``,
``actor.fsdp_config``, packing (``actor.use_remove_padding``) and micro-batches of
``actor.ppo_micro_batch_size_per_gpu`` examples or, with ``actor.use_dynamic_bsz``, a token
budget. Rank 0 writes the metrics (``train/loss``, ``train/lr``, ``train/grad_norm``,
``train/tokens_per_s``, ``val/loss`` every ``trainer.test_freq`` steps and at the end) and the
checkpoints, in the RL trainer's format (``hybridflow.controller.checkpoint``: atomic,
manifest-checked, ``global_step_<N>/actor``), each rank writing its part into the same folder.
A run resumes from its newest checkpoint (``trainer.resume_mode``) with the sampler's position,
so it continues exactly where it stopped. At the end the final checkpoint is exported
(``hybridflow.controller.export``) to ``<output_dir>/export``, a Hugging Face directory that
``hybridflow train model.path=...`` starts from.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from hybridflow.config import Config, ConfigError, config_to_yaml
from hybridflow.config.layout import data_parallel_size
from hybridflow.controller.checkpoint import CheckpointError, CheckpointManager
from hybridflow.controller.export import export_checkpoint
from hybridflow.controller.ranks import run_ranks
from hybridflow.controller.builtin import resolve_builtin
from hybridflow.controller.preflight import config_device, policy_chat_template
from hybridflow.controller.setup import resolve_output_dir
from hybridflow.controller.sft import sft_loop
from hybridflow.data import ResumableSampler
from hybridflow.data.sft import SFTColumns, SFTDataStats, load_sft_examples
from hybridflow.models.loading import load_tokenizer
from hybridflow.tracking.loggers import Tracker
from hybridflow.training import distributed
from hybridflow.types import Trajectory
from hybridflow.utils.faults import maybe_fault
from hybridflow.workers.sft import SFTWorker

log = logging.getLogger(__name__)

EXPORT_DIR = "export"
# Ranks start from a forkserver that has imported these once (each spawned rank importing them
# again costs most of a short run on a small machine).
PRELOAD = ["torch", "transformers", "hybridflow.controller.sft_run"]


@dataclass
class SFTResult:
    output_dir: Path
    metrics_path: Path
    export_dir: Path | None
    final_val_loss: float | None


T = TypeVar("T")


@dataclass(frozen=True)
class OfflineJob(Generic[T]):
    """What every rank of an offline trainer (sft, dpo, rm) needs: the config, the resolved model, the
    tokenised data (examples or preference pairs), the step count, the pad id and the longest sequence
    its micro-batch plan cuts at. Built once in the launching process and pickled to each rank."""

    cfg: Config
    model_path: str
    output_dir: str
    train: list[T]
    val: list[T]
    total_steps: int
    pad_token_id: int
    max_length: int


def check_sft_config(cfg: Config) -> None:
    """The settings ``hybridflow sft`` reads that can be wrong before anything loads."""
    if not cfg.data.train_files:
        raise ConfigError("hybridflow sft needs data.train_files: parquet or JSONL files with a 'messages' column "
                          "(or prompt/response columns)", key="data.train_files")
    check_offline_run(cfg, "sft", "examples", cfg.sft.export, "sft.export")
    if cfg.sft.max_length is not None and cfg.sft.max_length < 2:
        raise ConfigError(f"sft.max_length={cfg.sft.max_length}: need at least 2 tokens", key="sft.max_length")


def check_offline_run(cfg: Config, command: str, unit: str, export: bool, export_key: str) -> None:
    """The settings every offline trainer (``hybridflow <command>``: sft, dpo, rm) reads the same way:
    its ranks run without Ulysses, each step's ``unit``s split evenly over them, and an export
    (``export``, the value of ``export_key``) needs the final checkpoint it exports."""
    if export and not cfg.trainer.save_final:
        raise ConfigError(f"{export_key}=true exports the final checkpoint, but trainer.save_final=false; set one "
                          f"of them", key=export_key)
    if cfg.actor.ulysses_sequence_parallel_size != 1:
        raise ConfigError(f"hybridflow {command} does not use Ulysses sequence parallelism; set "
                          f"actor.ulysses_sequence_parallel_size=1", key="actor.ulysses_sequence_parallel_size")
    world = data_parallel_size(cfg.trainer)
    if cfg.data.train_batch_size % world:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} {unit} per step do not split over "
                          f"{world} ranks", key="data.train_batch_size")


def max_length(cfg: Config) -> int:
    return cfg.sft.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length


def run_sft_job(cfg: Config) -> SFTResult:
    """Fine-tune ``model.path`` on ``data.train_files``; see the module docstring."""
    check_sft_config(cfg)
    device = config_device(cfg.trainer.device)
    model_path, _, _ = resolve_builtin(cfg, device)  # builtin:tiny as `hybridflow train` gets it
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, policy_chat_template(cfg.data))
    columns = SFTColumns(cfg.sft.messages_key, cfg.data.prompt_key, cfg.sft.response_key)
    length = max_length(cfg)
    template_kwargs = cfg.data.apply_chat_template_kwargs
    train, stats = load_sft_examples(cfg.data.train_files, tokenizer, columns, max_length=length,
                                     truncation=cfg.sft.truncation, on_bad_row=cfg.data.on_bad_row,
                                     template_kwargs=template_kwargs)
    val: list[Trajectory] = []
    if cfg.data.val_files:
        val, _ = load_sft_examples(cfg.data.val_files, tokenizer, columns, max_length=length,
                                   truncation=cfg.sft.truncation, on_bad_row=cfg.data.on_bad_row,
                                   template_kwargs=template_kwargs)
    log.info("sft: %s", stats.describe())
    total = total_steps(cfg, len(train), "examples")
    out = open_output_dir(cfg)
    _write_data_stats(out, stats)
    job = OfflineJob(cfg, model_path, str(out), train, val, total, int(tokenizer.pad_token_id), length)
    final_val = run_ranks("sft", data_parallel_size(cfg.trainer), _train, job, PRELOAD)
    export_dir = export_final(out) if cfg.sft.export else None
    return SFTResult(out, out / "metrics.jsonl", export_dir, final_val)


def total_steps(cfg: Config, rows: int, unit: str) -> int:
    """An offline trainer's optimizer steps over ``rows`` training ``unit``s: ``trainer.total_training_steps``,
    else ``trainer.total_epochs`` of whole batches (a partial last batch is dropped)."""
    if cfg.data.train_batch_size > rows:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the {rows} training "
                          f"{unit}", key="data.train_batch_size")
    return cfg.trainer.total_training_steps or cfg.trainer.total_epochs * (rows // cfg.data.train_batch_size)


def open_output_dir(cfg: Config) -> Path:
    """An offline trainer's run folder (``resolve_output_dir``) with the run's ``config.yaml`` written in it."""
    out = resolve_output_dir(cfg)
    (out / "config.yaml").write_text(config_to_yaml(cfg))
    return out


def export_final(out: Path) -> Path:
    """The final checkpoint of the run in ``out`` exported to ``out/export``: a Hugging Face folder
    ``hybridflow train`` starts from."""
    export_dir = export_checkpoint(out, out / EXPORT_DIR, overwrite=True)
    print(f"exported: {export_dir} (hybridflow train model.path={export_dir})")
    return export_dir


def _write_data_stats(out: Path, stats: SFTDataStats) -> None:
    record = {"rows": stats.rows, "kept": stats.kept, "truncated": stats.truncated, "skipped": dict(stats.skipped)}
    (out / "sft_data.json").write_text(json.dumps(record, indent=1) + "\n")


def _train(rank: int, world: int, job: OfflineJob[Trajectory], device) -> float | None:
    cfg = job.cfg
    out = Path(job.output_dir)
    worker = SFTWorker(rank, world, cfg, job.model_path, device, total_steps=job.total_steps,
                       max_length=job.max_length, chat_template=policy_chat_template(cfg.data))
    run = open_run(cfg, out, len(job.train), worker, rank)
    sampler, tracker, start_step = run.sampler, run.tracker, run.start_step
    try:
        if start_step == 0 and cfg.trainer.val_before_train and job.val:
            loss = worker.val_loss(job.val, job.pad_token_id)
            if tracker is not None:
                tracker.log({"val/loss": loss}, step=0)
        final_val = None
        clock = {"t": time.perf_counter()}

        def on_step(step: int, metrics: dict[str, float]) -> None:
            nonlocal final_val
            now = time.perf_counter()
            # The step's exact token mean over every rank and micro-batch (nll_loss's shares).
            loss = distributed.all_reduce_sum([metrics["sft/loss_share"]])[0]
            record = {"train/loss": loss, "train/lr": metrics["train/lr"],
                      "train/grad_norm": metrics["train/grad_norm"], "train/tokens": metrics["sft/tokens"],
                      "train/tokens_per_s": metrics["sft/tokens"] / max(now - clock["t"], 1e-9),
                      "train/epoch": sampler.epoch}
            if job.val and run.validate_due(step, job.total_steps):
                record["val/loss"] = final_val = worker.val_loss(job.val, job.pad_token_id)
            run.save_if_due(step, job.total_steps, worker)
            if tracker is not None:
                tracker.log(record, step=step)
            maybe_fault("after_step", step)  # tests kill the run here (SIGKILL) and resume it
            clock["t"] = time.perf_counter()  # validation and saving do not count against tokens/s

        sft_loop(worker.engine, job.train, sampler, range(start_step + 1, job.total_steps + 1),
                 pad_token_id=job.pad_token_id, micro_batches=worker.micro_batches,
                 use_remove_padding=worker.plan.use_remove_padding, on_step=on_step, rank=rank, world_size=world)
        if start_step >= job.total_steps and job.val:
            final_val = worker.val_loss(job.val, job.pad_token_id)  # nothing left to train: the model as it stands
        return final_val
    finally:
        if tracker is not None:
            tracker.close()


@dataclass
class OfflineRun:
    """One rank's state of an offline trainer's run (``open_run``): the data order, the checkpoints,
    the step it starts after, rank 0's tracker (None elsewhere), and when a step validates and saves."""

    cfg: Config
    rank: int
    sampler: ResumableSampler
    manager: CheckpointManager
    start_step: int
    tracker: Tracker | None

    def validate_due(self, step: int, total_steps: int) -> bool:
        """Every ``trainer.test_freq`` steps and at the last one."""
        freq = self.cfg.trainer.test_freq
        return step == total_steps or (freq > 0 and step % freq == 0)

    def save_if_due(self, step: int, total_steps: int, worker: SFTWorker) -> None:
        """Checkpoint every ``trainer.save_freq`` steps and, with ``trainer.save_final``, at the last one
        (a collective: every rank calls it)."""
        trainer = self.cfg.trainer
        if (step == total_steps and trainer.save_final) or (trainer.save_freq > 0 and step % trainer.save_freq == 0):
            _save(self.manager, worker, step, self.sampler, self.cfg, self.rank)


def open_run(cfg: Config, out: Path, rows: int, worker: SFTWorker, rank: int) -> OfflineRun:
    """A rank's run over ``rows`` training rows written under ``out``: the sampler seeded by
    ``data.seed`` (else ``trainer.seed``), resumed with ``worker`` from the newest checkpoint
    (``trainer.resume_mode``), and on rank 0 the tracker (close it when the run ends)."""
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
    sampler = ResumableSampler(rows, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=seed)
    manager = CheckpointManager(out / "checkpoints", cfg.trainer.max_ckpt_to_keep)
    start_step = _resume(manager, worker, sampler, cfg, rank)
    tracker = None
    if rank == 0:
        tracker = Tracker(cfg.trainer.logger, output_dir=out, project=cfg.trainer.project_name,
                          experiment=cfg.trainer.experiment_name, config={})
    return OfflineRun(cfg, rank, sampler, manager, start_step, tracker)


def _resume(manager: CheckpointManager, worker: SFTWorker, sampler: ResumableSampler, cfg: Config, rank: int) -> int:
    """The step a run continues after: its newest intact checkpoint loaded into the engine and
    the sampler (all ranks the same folder, chosen by rank 0), else 0."""
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return 0
    found = None
    if rank == 0:
        found = manager.find(mode, cfg.trainer.resume_from_path)
    path = distributed.broadcast_text(None if found is None else str(found))
    if path is None:
        return 0
    ckpt = Path(path)
    refusal = worker.load(ckpt / "actor")
    if refusal is not None:
        raise CheckpointError(f"cannot resume from {ckpt}: {refusal}")
    state = CheckpointManager.load_state(ckpt)
    try:
        sampler.load_state_dict(state["sampler"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"cannot resume from {ckpt}: its sampler state does not fit this data: {exc}") from exc
    log.info("sft: resumed from %s (step %d)", ckpt, state["step"])
    return int(state["step"])


def _save(manager: CheckpointManager, worker: SFTWorker, step: int, sampler: ResumableSampler, cfg: Config,
          rank: int) -> None:
    """Checkpoint ``step``: rank 0 runs the manager's atomic save and tells the other ranks the
    folder it writes, where each writes its part (a collective)."""

    def write_actor(folder: Path) -> None:
        distributed.broadcast_text(str(folder))
        worker.save(folder)

    if rank == 0:
        state = {"step": step, "sampler": sampler.state_dict()}
        manager.save(step, state, write_actor, extra_files={"config.yaml": config_to_yaml(cfg)})
    else:
        folder = distributed.broadcast_text(None)
        assert folder is not None
        worker.save(Path(folder))
    if distributed.is_data_parallel():
        distributed.barrier()  # the folder is renamed into place before any rank goes on


def sft_cli(cfg: Config) -> SFTResult:
    """``hybridflow sft``: run, then say where the results are."""
    from hybridflow.models.loading import hf_progress_bars_off

    with hf_progress_bars_off():
        result = run_sft_job(cfg)
    if result.final_val_loss is not None:
        print(f"final val/loss {result.final_val_loss:.4f}")
    print(f"metrics: {result.metrics_path}")
    return result


__all__ = ["SFTResult", "OfflineJob", "OfflineRun", "check_offline_run", "check_sft_config", "export_final",
           "open_output_dir", "open_run", "total_steps", "run_sft_job", "sft_cli", "max_length", "EXPORT_DIR"]
