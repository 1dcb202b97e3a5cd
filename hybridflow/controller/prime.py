"""PRIME's implicit process reward model as a role of the run (``algorithm.adv_estimator=prime``, ``prime.*``):
its worker group (one rank per actor rank, trained with its own optimizer), the frozen reference its rewards are
measured against, and one step of it: train on the step's samples and score them, in ``prime.update``'s order.

The estimator reads its token rewards as the ``implicit_rewards`` input (``phases.INPUT_PROVIDERS``): no loop
names PRIME. Its reference is the run's reference role when that loads the same weights and scores at
temperature 1 (``config.explain.prime_shares_reference``: the batch's ``ref_logprobs`` are then the PRM's
too), else a reference worker group of its own on the PRM's starting weights."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from hybridflow.algorithms.prime import implicit_prm_metrics, normalise_implicit_rewards
from hybridflow.cluster.backends import build_worker_group
from hybridflow.cluster.ray_group import Placement
from hybridflow.cluster.worker_group import WorkerGroup
from hybridflow.config import Config
from hybridflow.config.layout import data_parallel_size
from hybridflow.controller.preflight import check_teacher_tokenizer
from hybridflow.tracking import reduce_metrics
from hybridflow.types import RefBatch, TrainBatch
from hybridflow.workers.engine_setup import RoleBatching
from hybridflow.workers.prime import PRM_TEMPERATURE, ImplicitPRMWorker, PrimeSetup
from hybridflow.workers.reference import ReferenceSetup, ReferenceWorker

log = logging.getLogger(__name__)

PRIME_ROLE, PRIME_REFERENCE_ROLE = "prime", "prime_reference"


def prime_model_path(cfg: Config, model_path: str) -> str:
    """The implicit PRM's starting weights: ``prime.model.path``, or the policy's model (``model_path``: the
    built-in model after its warm start)."""
    return cfg.prime.model.path or model_path


def check_prime_model(cfg: Config, student_tokenizer: object) -> str | None:
    """A ``prime.model.path`` whose tokenizer is not the policy's is refused on that key (the PRM scores the
    policy's token ids); a note when only special tokens' roles differ."""
    if cfg.prime.model.path is None:
        return None
    return check_teacher_tokenizer(student_tokenizer, cfg.prime.model.path, "prime.model.path",
                                   cfg.model.trust_remote_code, role="implicit PRM")


@dataclass(frozen=True)
class ImplicitPRM:
    """The implicit PRM's group, its own reference group (None: the run's reference scores the batch's
    ``ref_logprobs`` for it), and how a step uses them."""

    group: WorkerGroup[ImplicitPRMWorker]
    reference: WorkerGroup[ReferenceWorker] | None
    update_first: bool  # prime.update=before: train on the step's samples, then score them
    reward_norm: str  # prime.reward_norm
    label_threshold: float  # prime.label_threshold

    def token_rewards(self, batch: TrainBatch | RefBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """One step of the PRM on ``batch`` (trained and scored, in ``prime.update``'s order): its normalised
        token rewards (B, R) and ``prime/*`` metrics."""
        own = batch
        if self.reference is not None:
            ref = torch.cat(self.reference.split_gather(ReferenceWorker.compute_ref_logprobs, batch))
            own = dataclasses.replace(batch, ref_logprobs=ref)  # the actor's KL reads the run's, left alone
        assert own.ref_logprobs is not None, "set-up shares the run's reference only when it scores the batch"
        if self.update_first:
            metrics = reduce_metrics(self.group.split_gather(ImplicitPRMWorker.update_prm, own))
            rewards = torch.cat(self.group.split_gather(ImplicitPRMWorker.compute_token_rewards, own))
        else:
            rewards = torch.cat(self.group.split_gather(ImplicitPRMWorker.compute_token_rewards, own))
            metrics = reduce_metrics(self.group.split_gather(ImplicitPRMWorker.update_prm, own))
        metrics |= implicit_prm_metrics(rewards, batch.rewards, batch.group_ids, self.label_threshold)
        return normalise_implicit_rewards(rewards, self.reward_norm), metrics

    def save_checkpoint(self, folder: str) -> None:
        """The PRM's weights and optimizer (its reference is its starting weights, loaded from the path again)."""
        self.group.call_all(ImplicitPRMWorker.save_checkpoint, folder)

    def load_checkpoint(self, folder: str) -> list[str]:
        """Load what ``save_checkpoint`` wrote; the ranks' refusals (empty: loaded)."""
        return [r for r in self.group.call_all(ImplicitPRMWorker.load_checkpoint, folder) if r]

    def named_groups(self) -> list[tuple[str, WorkerGroup]]:
        named: list[tuple[str, WorkerGroup]] = [(PRIME_ROLE, self.group)]
        return named + ([(PRIME_REFERENCE_ROLE, self.reference)] if self.reference is not None else [])

    def close(self) -> None:
        for _, group in self.named_groups():
            group.close()


def build_implicit_prm(cfg: Config, path: str, device: torch.device, total_steps: int,
                       placements: dict[str, Placement], share_reference: bool,
                       actor_budgets: tuple[int | None, int | None]) -> ImplicitPRM:
    """The PRM's group on ``path`` (one rank per actor rank, in the actor's placement like the critic), and its
    own reference group on the same weights unless ``share_reference``. With ``actor.use_dynamic_bsz`` both cut
    micro-batches by ``actor_budgets`` (the actor's (update, logprob) token budgets as the run uses them: never
    ones derived from the memory free now, which a resume would not reproduce)."""
    p, d, a = cfg.prime, cfg.data, cfg.actor
    dp = data_parallel_size(cfg.trainer)
    setup = PrimeSetup(
        model_path=path, dtype=cfg.model.dtype, device=device, total_optimizer_steps=total_steps,
        max_response_length=d.max_response_length, max_prompt_length=d.max_prompt_length,
        batching=RoleBatching(a.use_remove_padding, a.use_dynamic_bsz, ppo_max_token_len=actor_budgets[0],
                              log_prob_max_token_len=actor_budgets[1]),
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        trust_remote_code=cfg.model.trust_remote_code, checkpoint_format=cfg.trainer.checkpoint_format,
    )
    group = build_worker_group(cfg.trainer.backend, PRIME_ROLE, lambda r, w: ImplicitPRMWorker(r, w, p, setup), dp,
                               placements.get(PRIME_ROLE))
    reference = None
    if not share_reference:
        ref_setup = ReferenceSetup(
            model_path=path, dtype=cfg.model.dtype, device=device, temperature=PRM_TEMPERATURE,
            micro_batch_size=p.micro_batch_size_per_gpu, use_remove_padding=a.use_remove_padding,
            use_dynamic_bsz=a.use_dynamic_bsz, max_token_len=actor_budgets[1],
            longest_sample=d.max_prompt_length + d.max_response_length, fsdp_size=p.fsdp_config.fsdp_size,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        try:
            reference = build_worker_group(cfg.trainer.backend, PRIME_REFERENCE_ROLE,
                                           lambda r, w: ReferenceWorker(r, w, ref_setup), dp,
                                           placements.get(PRIME_REFERENCE_ROLE))
        except BaseException:
            group.close()  # nobody else holds it yet
            raise
    log.info("prime: implicit PRM from %s, reference %s", path,
             "the run's reference model" if share_reference else "its own frozen copy")
    return ImplicitPRM(group, reference, update_first=p.update == "before", reward_norm=p.reward_norm,
                       label_threshold=p.label_threshold)
