"""One rank of ``hybridflow sft``: the actor's training engine set up for supervised fine-tuning.

The set-up is ``ActorWorker``'s without the RL parts (precision, LoRA with the same adapter init
on every rank, activation checkpointing, FSDP2 with several ranks, packing and micro-batches
from ``actor.*``); the controller's SFT loop (``hybridflow.controller.sft.sft_loop``) drives
``engine`` and ``micro_batches``, and this worker does the tensor work around it: the validation
loss, checkpoints, the device and threads of its process.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from hybridflow.config.schema import Config
from hybridflow.config.sections.trainer import FOLLOW_FREE_CORES
from hybridflow.models.loading import (
    enable_activation_checkpointing,
    load_causal_lm,
    load_tokenizer,
    value_head_name,
)
from hybridflow.models.lora import apply_lora, write_lora_manifest
from hybridflow.training import distributed
from hybridflow.training.engine import TrainEngine
from hybridflow.training.micro_batches import plan_micro_batches, train_micro_batches
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories
from hybridflow.utils.device import configure_threads, resolve_device, train_dtype
from hybridflow.utils.threads import adjust_threads, rule_threads
from hybridflow.workers.checkpoints import load_engine_checkpoint, sharded_checkpoints
from hybridflow.workers.engine_setup import lora_spec, model_precision, optim_spec

log = logging.getLogger(__name__)


def rank_device(name: str, rank: int, world: int) -> torch.device:
    """The device of ``rank``: ``trainer.device`` resolved; with several CUDA ranks, GPU ``rank``."""
    device = resolve_device(name)
    if device.type == "cuda" and world > 1:
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


class SFTWorker:
    def __init__(self, rank: int, world: int, cfg: Config, model_path: str, device: torch.device, *,
                 total_steps: int, max_length: int, chat_template: str | None,
                 load_model: Callable[..., torch.nn.Module] = load_causal_lm, head_lr: float | None = None) -> None:
        """``load_model(path, dtype=, device=, trust_remote_code=)`` builds the trained model (a causal LM;
        ``hybridflow rm`` passes a sequence classifier's loader); ``head_lr``: the peak lr of its value head
        (``rm.head_lr``), None: ``actor.optim.lr`` like the rest."""
        self.rank, self.world, self.cfg, self.model_path = rank, world, cfg, model_path
        threads = cfg.trainer.num_threads
        # The run's rule (rule_threads: the cores split over this machine's ranks), 'follow' or the user's number.
        configure_threads(None if threads == FOLLOW_FREE_CORES else threads or rule_threads(world))
        self.tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, chat_template)
        a = cfg.actor
        data_parallel = world > 1
        # model.dtype=auto by the rule of this rank's hardware (an offline job keeps no run-folder record).
        dtype = train_dtype(cfg.model.dtype, device.type)
        weights_dtype, compute_dtype = model_precision(dtype, trainable=True, data_parallel=data_parallel)
        model = load_model(model_path, dtype=weights_dtype, device=device, trust_remote_code=cfg.model.trust_remote_code)
        self.lora = a.lora.rank > 0
        if self.lora:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.trainer.seed)  # every rank draws the same adapter init
                model = apply_lora(model, lora_spec(a.lora)).get_base_model()
        if cfg.model.enable_gradient_checkpointing:
            enable_activation_checkpointing(model)
            if self.lora:
                model.enable_input_require_grads()  # frozen embeddings would starve the adapters of gradient
        optim = optim_spec(a.optim, total_steps=total_steps, grad_clip=a.grad_clip)
        if head_lr is not None:
            optim = replace(optim, group_lrs=((f"{value_head_name(model)}.", head_lr),))
        self.engine = TrainEngine(
            model, optim, device,
            data_parallel=data_parallel, mixed_precision=compute_dtype, fsdp_size=a.fsdp_config.fsdp_size,
            offload_params=a.fsdp_config.param_offload, offload_optimizer=a.fsdp_config.optimizer_offload,
            checkpoint_trainable_only=self.lora, metrics_prefix="train",
        )
        self.plan = plan_micro_batches(
            self.engine, use_remove_padding=a.use_remove_padding, use_dynamic_bsz=a.use_dynamic_bsz,
            ppo_max_token_len=a.ppo_max_token_len_per_gpu, log_prob_max_token_len=a.log_prob_max_token_len_per_gpu,
            longest_sample=max_length, gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        )
        if rank == 0:
            for note in self.plan.notes:
                log.info("sft: %s", note)
        self.sharded = sharded_checkpoints(cfg.trainer.checkpoint_format, world)

    def micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """This rank's share of a step cut as the actor cuts a mini-batch (count agreed over ranks)."""
        return train_micro_batches(self.engine, self.plan, batch, self.cfg.actor.ppo_micro_batch_size_per_gpu)

    def val_loss(self, examples: list[Trajectory], pad_token_id: int) -> float | None:
        """Token-mean NLL of the assistant tokens of ``examples`` over every rank (a collective). Each
        rank takes an equal share, a short one filled with copies whose loss mask is zero, so all
        ranks run the same forwards."""
        if not examples:
            return None
        share = math.ceil(len(examples) / self.world)
        own = examples[self.rank * share : (self.rank + 1) * share]
        filler = replace(examples[0], loss_mask=[0] * len(examples[0].loss_mask))
        own = own + [filler] * (share - len(own))
        total, tokens = 0.0, 0.0
        size = self.cfg.data.val_batch_size
        for start in range(0, share, size):
            adjust_threads()
            batch = collate_trajectories(own[start : start + size], pad_token_id)
            logprobs, _ = self.engine.compute_logprobs(
                batch, temperature=1.0, micro_batch_size=self.cfg.actor.log_prob_micro_batch_size_per_gpu,
                use_remove_padding=self.plan.use_remove_padding, max_token_len=self.plan.log_prob_max_token_len,
            )
            mask = batch.response_mask.double()
            total += float(-(logprobs.double() * mask).sum())
            tokens += float(mask.sum())
        total, tokens = distributed.all_reduce_sum([total, tokens])
        return total / max(tokens, 1.0)

    def save(self, folder: Path) -> None:
        """Write this rank's part of a checkpoint's ``actor`` folder (a collective with several ranks)."""
        self.engine.save(folder, tokenizer=self.tokenizer, sharded=self.sharded)
        if self.lora and self.rank == 0:
            # What ``hybridflow export`` needs to merge the adapter: the base model and its shape.
            write_lora_manifest(folder / "model", self.model_path, lora_spec(self.cfg.actor.lora))

    def load(self, folder: Path) -> str | None:
        """Load a checkpoint's ``actor`` folder: None when in place, else why it was refused."""
        return load_engine_checkpoint(self.engine, folder, "sft")
