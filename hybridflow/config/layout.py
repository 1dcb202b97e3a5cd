"""How a run's batches and ranks are laid out: data-parallel ranks, rollout replicas, Ulysses groups and
the split of one step's prompts into optimizer steps and micro-batches (``BatchPlan``). Read by the
checks, ``config explain``, the plan and set-up."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.schema import Config, TrainerConfig


@dataclass(frozen=True)
class BatchPlan:
    """How one training step's prompts split into optimizer steps and micro-batches.

    Meaningful only for a config that passed ``validate_config`` (the divisions are exact then).
    """

    dp: int  # data-parallel ranks
    prompts_per_step: int  # data.train_batch_size
    samples_per_step: int  # prompts x rollout.n
    samples_per_rank_per_step: int
    mini_batches_per_epoch: int  # optimizer steps per pass over the rollout batch
    optimizer_steps_per_step: int  # x ppo_epochs
    samples_per_mini_batch: int  # ppo_mini_batch_size x rollout.n, over all ranks
    samples_per_rank_per_mini_batch: int
    grad_accum_steps: int  # micro-batches per optimizer step on one rank


def compute_batch_plan(
    *,
    train_batch_size: int,
    ppo_mini_batch_size: int,
    rollout_n: int,
    ppo_epochs: int,
    ppo_micro_batch_size_per_gpu: int,
    dp: int,
) -> BatchPlan:
    """The batch split for these sizes (prompts for the first two, samples for the micro)."""
    samples_per_mini = ppo_mini_batch_size * rollout_n
    per_rank_mini = samples_per_mini // dp
    mini_batches = train_batch_size // ppo_mini_batch_size
    return BatchPlan(
        dp=dp,
        prompts_per_step=train_batch_size,
        samples_per_step=train_batch_size * rollout_n,
        samples_per_rank_per_step=train_batch_size * rollout_n // dp,
        mini_batches_per_epoch=mini_batches,
        optimizer_steps_per_step=mini_batches * ppo_epochs,
        samples_per_mini_batch=samples_per_mini,
        samples_per_rank_per_mini_batch=per_rank_mini,
        grad_accum_steps=per_rank_mini // ppo_micro_batch_size_per_gpu,
    )


def data_parallel_size(trainer: TrainerConfig) -> int:
    """Data-parallel ranks of the actor (and reference): ``n_workers`` CPU ranks when set, else
    ``n_gpus_per_node x nnodes``."""
    if trainer.n_workers is not None:
        return trainer.n_workers
    return trainer.n_gpus_per_node * trainer.nnodes


def rollout_replicas(cfg: Config) -> int:
    """Rollout replicas: the data-parallel ranks in groups of ``rollout.tensor_model_parallel_size``
    (each replica one engine over its ranks' placements); with ``rollout.elastic``, the most the run
    may start (``rollout.max_replicas``), which is what shares of a run-wide limit are sized by."""
    if cfg.rollout.elastic and cfg.rollout.max_replicas is not None:
        return cfg.rollout.max_replicas
    return max(1, data_parallel_size(cfg.trainer) // cfg.rollout.tensor_model_parallel_size)


def dp_source(trainer: TrainerConfig) -> str:
    """Where ``data_parallel_size`` came from, for messages."""
    if trainer.n_workers is not None:
        return f"trainer.n_workers={trainer.n_workers}"
    return f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} x trainer.nnodes={trainer.nnodes}"


def batch_plan(cfg: Config) -> BatchPlan:
    """``compute_batch_plan`` for a config."""
    return compute_batch_plan(
        train_batch_size=cfg.data.train_batch_size,
        ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size,
        rollout_n=cfg.rollout.n,
        ppo_epochs=cfg.actor.ppo_epochs,
        ppo_micro_batch_size_per_gpu=cfg.actor.ppo_micro_batch_size_per_gpu,
        dp=data_parallel_size(cfg.trainer),
    )


def sequence_parallel_sizes(cfg: Config) -> dict[str, int]:
    """Each training role's Ulysses group size by its config key (the reference's None: the actor's)."""
    actor = cfg.actor.ulysses_sequence_parallel_size
    ref = cfg.ref.ulysses_sequence_parallel_size
    return {"actor.ulysses_sequence_parallel_size": actor,
            "ref.ulysses_sequence_parallel_size": actor if ref is None else ref,
            "critic.ulysses_sequence_parallel_size": cfg.critic.ulysses_sequence_parallel_size}


def hybrid_engine_blockers(cfg: Config) -> list[str]:
    """Why ``trainer.hybrid_engine`` cannot put this run's colocated roles in one process per bundle
    (each names its key); [] when it can. Each needs a rank or replica in a process of its own: a pool
    of its own, a reservation per replica, a group over part of the pool, generation beside training
    (one process runs one call at a time), one profiler per process, an engine not tried sharing one,
    a broadcast (its two sides run at once), a replica restarted alone. The last two are what a user
    asked for by name: they keep a process per rank rather than be refused or silently dropped."""
    r, t = cfg.rollout, cfg.trainer
    reasons = []
    if r.placement == "split":
        reasons.append("rollout.placement=split puts the replicas on bundles of their own")
    if r.elastic:
        reasons.append("rollout.elastic reserves each replica apart")
    if r.tensor_model_parallel_size > 1:
        reasons.append(f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}: a replica's group spans "
                       f"part of the pool")
    if t.mode != "sync":
        reasons.append(f"trainer.mode={t.mode} generates while the actor trains")
    if t.profile.steps:
        reasons.append("trainer.profile.steps records one profiler per process")
    if r.name != "native":
        reasons.append(f"rollout.name={r.name}: only the native engine shares a process with the trainer here")
    if r.weight_sync == "broadcast":  # both sides at once: a process here runs one call at a time
        reasons.append("rollout.weight_sync=broadcast streams the weights to each replica's own process")
    if r.max_replica_restarts:  # asked for: a replica beside its actor rank dies with it, never restarted alone
        reasons.append(f"rollout.max_replica_restarts={r.max_replica_restarts} restarts a replica in a process of its "
                       f"own")
    return reasons


def shares_processes(cfg: Config) -> bool:
    """Whether the colocated roles' ranks of a bundle live in one Ray process (``trainer.hybrid_engine``)."""
    t = cfg.trainer
    return t.hybrid_engine and t.backend == "ray" and not hybrid_engine_blockers(cfg)


DEFAULT_REPLICA_RESTARTS = 3
"""``rollout.max_replica_restarts=null`` where a replica has a process of its own: a few deaths (a
killed process, an out-of-memory kill) are survived, and a replica that keeps dying stops the run."""


def replica_restarts(cfg: Config) -> int:
    """``rollout.max_replica_restarts`` resolved: the value set, else ``DEFAULT_REPLICA_RESTARTS``, or
    0 where each replica shares its actor rank's process (a replica's death is then its rank's)."""
    value = cfg.rollout.max_replica_restarts
    if value is not None:
        return value
    return 0 if shares_processes(cfg) else DEFAULT_REPLICA_RESTARTS
