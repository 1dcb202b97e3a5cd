"""The run's worker groups by role, built from the config: the rollout replicas, the reward role,
the reward model, the critic, and the weight-sync group between actor rank 0 and the replicas."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.cluster.backends import build_worker_group, runs_in_process
from hybridflow.cluster.ray_group import ElasticPlacement, Placement
from hybridflow.cluster.role_hosts import HostedWorkerGroup, hosted
from hybridflow.cluster.worker_group import (
    WorkerError,
    WorkerGroup,
    meeting_host,
    wait_all,
)
from hybridflow.config import Config, ConfigError
from hybridflow.config.layout import data_parallel_size, replica_restarts, rollout_replicas
from hybridflow.controller.preflight import judge_api_key
from hybridflow.controller.prime import ImplicitPRM
from hybridflow.controller.replica_pool import ElasticReplicas, replica_role
from hybridflow.controller.replicas import RolloutReplicas
from hybridflow.controller.teachers import Teachers
from hybridflow.rewards.manager import scoring_processes
from hybridflow.rewards.sandbox_fusion import SandboxFusionSettings
from hybridflow.rewards.sandbox_fusion import (
    build_settings as build_sandbox_fusion_settings,
)
from hybridflow.rewards.shaping import overlong_buffer_end, resolve_overlong_buffer
from hybridflow.types import TrainBatch
from hybridflow.workers.actor import ActorWorker, weights_on_every_rank
from hybridflow.workers.critic import CriticSetup, CriticWorker
from hybridflow.workers.reference import ReferenceWorker
from hybridflow.workers.reward import RewardSetup, RewardWorker
from hybridflow.workers.reward_model import (
    JudgeSetup,
    JudgeWorker,
    RewardModelSetup,
    RewardModelWorker,
)
from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

log = logging.getLogger(__name__)


# rollout.weight_sync, resolved (``auto`` becomes one of them). BESIDE: trainer.hybrid_engine's, each
# actor rank hands its gathered weights to the rollout replica in its own process.
OBJECT_STORE, BROADCAST, BESIDE = "object_store", "broadcast", "beside"


def resolve_weight_sync(mode: str, backend: str, shared_processes: bool = False) -> str:
    """``rollout.weight_sync`` for ``trainer.backend``: ``auto`` broadcasts when the rollout runs in
    another process than actor rank 0, hands the weights over in each shared process when every
    replica lives beside an actor rank (``shared_processes``: ``trainer.hybrid_engine``), and
    otherwise copies in-process (``object_store``)."""
    in_process = runs_in_process(backend)
    if mode == "auto":
        return OBJECT_STORE if in_process else BESIDE if shared_processes else BROADCAST
    if mode == BROADCAST and shared_processes:
        # Both sides of a broadcast must run at once; one process runs one call at a time.
        raise ConfigError(
            "rollout.weight_sync=broadcast streams weights from actor rank 0 to the rollout processes, but "
            "trainer.hybrid_engine=true puts each replica in its actor rank's process, which runs one call at a time "
            "(the broadcast's two sides would wait on each other); use rollout.weight_sync=auto (each rank hands the "
            "weights to the replica beside it), or trainer.hybrid_engine=false",
            key="rollout.weight_sync",
        )
    if mode == BROADCAST and in_process:
        # An error, not a silent fallback: the user asked for a transport that has no peer here.
        raise ConfigError(
            f"rollout.weight_sync=broadcast streams weights from actor rank 0 to the rollout process, but "
            f"trainer.backend={backend} runs both in this process, where weights are copied directly; use "
            f"rollout.weight_sync=auto, or trainer.backend=ray",
            key="rollout.weight_sync",
        )
    return mode


def connect_weight_sync(actor: WorkerGroup[ActorWorker], replicas: RolloutReplicas) -> None:
    """Form the weight-sync group: actor rank 0 sends, rollout replica k receives as member k + 1.
    Both sides join at once (each blocks until all members have), at a port on actor rank 0's node."""
    address, port = actor.rendezvous(0)
    host = meeting_host(address, replicas.node_addresses())
    gpus = [actor.call_one(0, ActorWorker.device_uuid), *replicas.device_uuids()]
    # NCCL needs every member on a GPU of its own. CPU ranks, and a replica sharing actor rank 0's
    # GPU (the colocated placement: both in bundle 0), go through host memory with gloo.
    on_gpu = None not in gpus and len(set(gpus)) == len(gpus)
    members = 1 + replicas.num_replicas
    wait_all(actor.submit_one(0, ActorWorker.join_weight_sync, host, port, members, on_gpu),
             *replicas.submit_join_weight_sync(host, port, members, on_gpu))
    replicas.pool.rejoin_weight_sync = False  # every replica of now is in it
    log.info("weight sync: actor rank 0 -> %d rollout replica(s) by broadcast via %s:%d (%s)",
             replicas.num_replicas, host, port, "nccl" if on_gpu else "gloo")


def hand_over_weights(actor: WorkerGroup[ActorWorker], replicas: RolloutReplicas, version: int,
                      adapter: bool) -> None:
    """``trainer.hybrid_engine``'s weight sync: every actor rank gathers the full weights (the
    collective the object-store sync makes, ``adapter``: only the LoRA adapters) and hands them by
    reference to the rollout replica in its own process, in one call: no broadcast group, nothing
    through this process. The replicas check what they hold against what they were handed
    (``rollout.verify_weight_sync``), as a broadcast's receivers do."""
    if not isinstance(actor, HostedWorkerGroup):
        raise TypeError(f"the hybrid engine's weight sync needs the actor in shared processes, not a "
                        f"{type(actor).__name__}")
    replicas.prepare_sync()
    actor.call_all_with(_hand_over, [(replicas.group(k), 0) for k in replicas.active], version, adapter)
    replicas.verify_sync()


def _hand_over(actor: ActorWorker, rollout: RolloutWorker, version: int, adapter: bool) -> None:
    """In the shared process of an actor rank and its replica (``hand_over_weights``)."""
    rollout.update_weights(weights_on_every_rank(actor, adapter), version, note_received=True)


def reconnect_weight_sync(actor: WorkerGroup[ActorWorker], replicas: RolloutReplicas) -> None:
    """Form the weight-sync group again after replicas were restarted, added or removed (the old
    one has a dead member, or lacks a new one): every member leaves it, then all join a new one."""
    close_weight_sync(actor, replicas)
    connect_weight_sync(actor, replicas)


def close_weight_sync(actor: WorkerGroup[ActorWorker], replicas: RolloutReplicas) -> None:
    """Both sides leave the weight-sync group before their processes end. Best effort: after a
    failure a torn-down group refuses calls, and its processes took their connections with them."""
    for role, close in (("actor", lambda: actor.call_one(0, ActorWorker.close_weight_sync)),
                        ("rollout", replicas.close_weight_sync)):
        try:
            close()
        except WorkerError as error:
            log.debug("weight sync: the %s could not leave the group: %s", role, error)


@dataclass
class RewardModelGroup:
    """The reward model's worker group and its role's scoring method, chosen once by
    ``reward_model.style``: ``score(trajectories) -> (scores, metrics)`` on each rank's share."""

    group: WorkerGroup[Any]
    score: Callable[..., tuple[list[float], dict[str, float]]]
    close: Callable[..., None] | None = None  # a role's own clean-up before the group closes


@dataclass(frozen=True)
class Roles:
    """The run's worker groups by role, and the two methods set-up chose for them. The phases call
    these and nothing else of the run."""

    actor: WorkerGroup[ActorWorker]
    rollout: RolloutReplicas
    reward: WorkerGroup[RewardWorker]
    # The reference logprobs' group: reference ranks, or with LoRA the actor itself (both have
    # compute_ref_logprobs); None without a KL term.
    reference: WorkerGroup[ReferenceWorker] | WorkerGroup[ActorWorker] | None = None
    critic: WorkerGroup[CriticWorker] | None = None  # the estimator needs values (gae)
    reward_model: RewardModelGroup | None = None  # reward_model.enable
    teachers: Teachers | None = None  # distillation.enable: the frozen teacher models
    prime: ImplicitPRM | None = None  # algorithm.adv_estimator=prime: the implicit PRM (and its reference)
    # The actor's method whose rank-0 result an object-store sync hands the rollout: its weights, or
    # only its LoRA adapter (actor.lora.sync=adapter), which the rollout workers merge themselves.
    actor_weights: Callable[[ActorWorker], list[tuple[str, torch.Tensor]]] = ActorWorker.weights_for_sync
    # The reference group's method that returns one rank's reference logprobs  # (B, R)
    reference_logprobs: Callable[[ReferenceWorker | ActorWorker, TrainBatch], torch.Tensor] = (
        ReferenceWorker.compute_ref_logprobs)
    weight_sync: str = OBJECT_STORE  # rollout.weight_sync resolved: object_store | broadcast (group formed) | beside

    def named_groups(self) -> list[tuple[str, WorkerGroup[Any]]]:
        """Every worker group of the run, by role (each rollout replica its own)."""
        rm = self.reward_model
        named = [("actor", self.actor), ("critic", self.critic), ("reference", self.reference),
                 ("reward", self.reward), ("reward_model", rm.group if rm is not None else None)]
        named += [(replica_role(k), group) for k, group in enumerate(self.rollout.groups)]
        named += self.teachers.named_groups() if self.teachers is not None else []
        named += self.prime.named_groups() if self.prime is not None else []
        return [(name, group) for name, group in named if group is not None]

    def close(self) -> None:
        """Every role's clean-up, then its processes: the weight-sync group first, the actor that
        serves as its own reference (LoRA) once."""
        self.reward.call_all(RewardWorker.close)
        if self.weight_sync == BROADCAST:
            close_weight_sync(self.actor, self.rollout)
        self.rollout.close()
        rm = self.reward_model
        if rm is not None and rm.close is not None:
            rm.group.call_all(rm.close)
        reference = self.reference if self.reference is not self.actor else None
        groups = [self.actor, self.critic, reference, self.reward, rm.group if rm is not None else None]
        for group in groups:
            if group is not None:
                group.close()
        if self.teachers is not None:
            self.teachers.close()
        if self.prime is not None:
            self.prime.close()


def build_rollout_replicas(cfg: Config, setup: RolloutSetup, placement: Placement | None,
                           elastic: ElasticPlacement | None = None) -> RolloutReplicas:
    """``rollout_replicas(cfg)`` replicas, each a worker group of its own: replica k's
    ``rollout.tensor_model_parallel_size`` ranks in bundles from k x tp on (on Ray; the group's
    process group is the replica's tensor-parallel group), so a failing replica is named and torn
    down alone. ``rollout.elastic`` (``elastic``: where their reservations go): each replica in a
    reservation of its own, ``rollout.min_replicas`` of them started waiting for room, then more
    while the cluster has room, up to ``rollout.max_replicas``."""
    tp = cfg.rollout.tensor_model_parallel_size

    def build(k: int, where: Placement | None) -> WorkerGroup[RolloutWorker]:
        named = dataclasses.replace(setup, name=replica_role(k))
        return build_worker_group(cfg.trainer.backend, replica_role(k), lambda r, w: RolloutWorker(r, w, named),
                                  tp, where)

    pools = ReplicaReservations(elastic, build) if elastic is not None else None
    groups: list[WorkerGroup[RolloutWorker]] = []
    try:
        for k in range(cfg.rollout.min_replicas if pools is not None else rollout_replicas(cfg)):
            if pools is not None:
                group = pools.start(k, patient=True)
                assert group is not None  # a patient start raises when it finds no room
            else:
                group = build(k, None if placement is None else placement.from_bundle(k * tp))
            groups.append(group)
    except BaseException:
        for k, group in enumerate(groups):  # nobody else holds the replicas started so far
            group.close()
            if pools is not None:
                pools.release(k)
        raise
    # The asynchronous loops generate while the actor trains: there is no idle cache to free.
    free_cache_engine = cfg.rollout.free_cache_engine and cfg.trainer.mode == "sync"
    # In-process replicas die with the controller: nothing is left to restart them.
    # A replica in its actor rank's process (trainer.hybrid_engine) dies with it: no process of its own to restart.
    rebuild = None if runs_in_process(cfg.trainer.backend) or placement is None or hosted(placement) else \
        (lambda k: build(k, placement.from_bundle(k * tp)))
    bounds = None
    if pools is not None:
        assert cfg.rollout.max_replicas is not None  # the config checks refuse rollout.elastic without it
        bounds = ElasticReplicas(cfg.rollout.min_replicas, cfg.rollout.max_replicas, pools)
    replicas = RolloutReplicas(groups, free_cache_engine=free_cache_engine, sleep_level=cfg.rollout.sleep_level,
                               verify_weight_sync=cfg.rollout.verify_weight_sync, rebuild=rebuild,
                               max_restarts=replica_restarts(cfg), elastic=bounds)
    if bounds is not None:
        try:
            replicas.pool.resize()  # more while the cluster has room now: they hold model.path, the weights of step 0
        except BaseException:
            replicas.close()
            raise
    return replicas


class ReplicaReservations:
    """``rollout.elastic``'s ``ReplicaPlacer``: each replica in a placement group of its own
    (``ElasticPlacement``), reserved when it starts and given back when it goes."""

    def __init__(self, placement: ElasticPlacement,
                 build: Callable[[int, Placement], WorkerGroup[RolloutWorker]]) -> None:
        self._placement, self._build = placement, build
        self._held: dict[int, Placement] = {}  # replica -> its reservation

    def start(self, replica: int, patient: bool) -> WorkerGroup[RolloutWorker] | None:
        where = self._placement.reserve(wait=patient)
        if where is None:
            return None
        self._held[replica] = where
        try:
            return self._build(replica, where)
        except BaseException:
            self.release(replica)
            raise

    def has_free_room(self) -> bool:
        return self._placement.has_free_room()

    def release(self, replica: int) -> None:
        where = self._held.pop(replica, None)
        if where is not None:
            where.pool.close()


def build_reward_model_group(
    cfg: Config, model_path: str, device: torch.device, placement: Placement | None
) -> RewardModelGroup | None:
    """The reward model's role (``reward_model.enable``), or None. A discriminative model runs one
    rank per actor rank, colocated in the actor's bundles like the reference (on the local backend,
    in this process); the judge is one rank in this process, a client of its endpoint."""
    rm, common = cfg.reward_model, dict(policy_tokenizer_path=model_path,
                                        policy_trust_remote_code=cfg.model.trust_remote_code)
    if not rm.enable:
        return None
    if rm.style == "generative":
        judge_setup = JudgeSetup(settings=rm.judge, api_key=judge_api_key(cfg), **common)
        group = build_worker_group("local", "reward_model", lambda r, w: JudgeWorker(r, w, judge_setup), 1)
        return RewardModelGroup(group, JudgeWorker.score, JudgeWorker.close)
    assert rm.model.path is not None
    setup = RewardModelSetup(model_path=rm.model.path, dtype=cfg.model.dtype, device=device,
                             micro_batch_size=rm.micro_batch_size_per_gpu, max_length=rm.max_length,
                             trust_remote_code=rm.model.trust_remote_code, **common)
    group = build_worker_group(cfg.trainer.backend, "reward_model", lambda r, w: RewardModelWorker(r, w, setup),
                               data_parallel_size(cfg.trainer), placement)
    return RewardModelGroup(group, RewardModelWorker.score)


def reward_setup(cfg: Config, model_path: str, scorers: int = 1) -> RewardSetup:
    """What a reward worker is built from: the reward role's, and each rollout replica's on the
    by-reference data plane (``trainer.data_plane=refs``), where ``scorers`` (the replicas) share
    the run's limits on outside services."""
    custom, ob, d = cfg.reward.custom_reward_function, cfg.reward.overlong_buffer, cfg.data
    buffer_end = overlong_buffer_end(ob.max_response_length, d.max_response_length)
    return RewardSetup(
        tokenizer_path=model_path, custom_path=custom.path, custom_name=custom.name,
        timeout_s=cfg.reward.timeout_s,
        num_workers=scoring_processes(cfg.reward.reward_manager, cfg.reward.num_workers),
        batch=cfg.reward.reward_manager == "batch", reward_kwargs=dict(cfg.reward.reward_kwargs),
        startup_timeout_s=cfg.reward.startup_timeout_s, combine=cfg.reward_model.combine,
        overlong_buffer_len=(resolve_overlong_buffer(ob.len, buffer_end) if ob.enable else None),
        overlong_penalty_factor=ob.penalty_factor, max_response_length=buffer_end,
        trust_remote_code=cfg.model.trust_remote_code, sandbox_fusion=sandbox_fusion_settings(cfg, scorers),
    )


def sandbox_fusion_settings(cfg: Config, scorers: int = 1) -> SandboxFusionSettings | None:
    """The SandboxFusion service of reward.sandbox_fusion (None: no url), its requests bounded by reward.timeout_s.
    ``scorers`` reward workers (each rollout replica's, on the refs data plane, perhaps on other nodes: no lock
    reaches across them) share max_concurrent in equal parts, at least one request each."""
    sf = cfg.reward.sandbox_fusion
    if sf.url is None:
        return None
    return build_sandbox_fusion_settings(sf.url, max(1, sf.max_concurrent // scorers), sf.memory_limit_mb,
                                         sf.run_timeout_s, cfg.reward.timeout_s)


def build_reward_group(cfg: Config, model_path: str) -> WorkerGroup[RewardWorker]:
    """The reward role, in this process on every backend: scoring writes each trajectory's reward
    in place, and the manager already runs the scorers in supervised subprocesses. A custom reward
    function that cannot be loaded is a ``ConfigError`` on ``reward.custom_reward_function``."""
    custom = cfg.reward.custom_reward_function
    setup = reward_setup(cfg, model_path)
    try:
        return build_worker_group("local", "reward", lambda r, w: RewardWorker(r, w, setup), 1)
    except (ImportError, AttributeError, SyntaxError, TypeError, OSError, TimeoutError, RuntimeError) as error:
        if custom.path is None:
            raise
        key = "reward.custom_reward_function.name" if isinstance(error, AttributeError) else \
            "reward.custom_reward_function.path"
        raise ConfigError(f"{key}: {error}", key=key) from error


def build_critic_group(
    cfg: Config, model_path: str, device: torch.device, total_steps: int, placement: Placement | None
) -> WorkerGroup[CriticWorker]:
    """The critic role, one rank per actor rank, in the actor's placement bundles (colocated like
    the reference): trained like the actor, FSDP2 over its ranks. Its model starts from
    ``critic.model.path``, or the policy's own weights (``model_path``, the built-in model after
    its warm start)."""
    c, d = cfg.critic, cfg.data
    mini = c.ppo_mini_batch_size if c.ppo_mini_batch_size is not None else cfg.actor.ppo_mini_batch_size
    epochs = c.ppo_epochs if c.ppo_epochs is not None else cfg.actor.ppo_epochs
    setup = CriticSetup(
        model_path=c.model.path or model_path, dtype=cfg.model.dtype, device=device, rollout_n=cfg.rollout.n,
        ppo_mini_batch_size=mini, ppo_epochs=epochs,
        total_optimizer_steps=total_steps * (d.train_batch_size // mini) * epochs,
        max_response_length=d.max_response_length, max_prompt_length=d.max_prompt_length,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing, trust_remote_code=cfg.model.trust_remote_code,
        checkpoint_format=cfg.trainer.checkpoint_format,
    )
    return build_worker_group(cfg.trainer.backend, "critic", lambda r, w: CriticWorker(r, w, c, setup),
                              data_parallel_size(cfg.trainer), placement)
