"""The rollout role: turns generation requests into trajectories with a rollout engine.

Two paths, chosen once at construction:

- no agent settings (``rollout.multi_turn.enable=false``): each request goes straight to the
  engine's ``generate``, exactly as a plain RLHF/RLVR rollout;
- with ``AgentSetup``: each request runs as ``n`` agent episodes (``hybridflow.agents``),
  the loop picked per row by its ``agent_name`` (else the default loop), every episode
  concurrently against the same engine.

Every request runs on one persistent event loop in a background thread of the worker's process
(``hybridflow.rollout.stream.RequestStream``), so the engine batches all of them continuously,
whichever call brought them: ``generate`` / ``serve`` block until their requests are done;
``start`` returns at once and ``take`` hands back each request's trajectories (per prompt
group, agent episodes included) as soon as it finishes, which is how the controller scores a
round while it is still being generated (``RolloutReplicas.stream``). While requests run, the
worker's other calls still work: weight updates are applied between two engine steps (no
request sees a mix of weights), ``sleep`` is refused until nothing is in flight.

New weights arrive either as ``(name, tensor)`` pairs through the controller (``update_weights``)
or, when the rollout runs in another process than actor rank 0 (``rollout.weight_sync=broadcast``),
straight from it: the worker joins the weight-sync group as a receiver (``join_weight_sync``) and
applies each bucket as it arrives (``receive_weights``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.agents import AgentContext, AgentRow, AgentRunner, load_tools
from hybridflow.agents.interactions import load_interaction_config
from hybridflow.config.engines import engines_with
from hybridflow.data.plane import put_group, records_of
from hybridflow.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, meta_causal_lm
from hybridflow.models.lora import AdapterMerger, is_adapter_payload
from hybridflow.rewards.tally import RewardTally
from hybridflow.rollout import ROLLOUT_ENGINES, EngineArgs, build_rollout_engine
from hybridflow.rollout.base import choose_rollout_dtype
from hybridflow.rollout.stream import Finished, Job, RequestStream
from hybridflow.transfer import weight_transfer
from hybridflow.transfer.verify import Digest, held_digest, sent_checksum
from hybridflow.transfer.weight_transfer import (
    SENDER_RANK,
    TransferStats,
    WeightSyncGroup,
    gpu_uuid,
    sync_device,
)
from hybridflow.types import GenerationRequest, SampleRecord, Trajectory
from hybridflow.utils.faults import fault_requested, maybe_fault
from hybridflow.workers.reward import RewardSetup, RewardWorker, score_trajectories

logger = logging.getLogger(__name__)


@dataclass
class AgentSetup:
    """``rollout.multi_turn``, resolved: what the worker builds its agent runner from."""

    default_agent: str  # the loop for rows without an agent_name
    tool_config_path: str | None = None  # a YAML file, builtin:<name>[,...], or None (no tools)
    interaction_config_path: str | None = None  # verl's interaction file, or None (no simulated user)
    tool_parser: str = "hermes"
    max_assistant_turns: int = 5
    max_user_turns: int | None = None  # verl's: tool and interaction reply turns per episode (None, 0: no bound)
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_timeout_s: float | None = None  # None: each tool's own limit
    openai_agent: str | None = None  # the openai loop's function (module:function or file.py:function)
    openai_timeout_s: float = 300.0  # the openai loop's limit per episode
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # data.apply_chat_template_kwargs


@dataclass
class RolloutSetup:
    model_path: str
    engine: str
    dtype: str
    device: torch.device
    max_batch_size: int
    seed: int
    trust_remote_code: bool = False
    chat_template: str | None = None  # data.chat_template: replaces the tokenizer's for agent turns
    agent: AgentSetup | None = None  # None: single-turn generation, no agent loop
    enforce_eager: bool = False  # no CUDA graphs for decode
    # The largest mean |logprob difference| from fp32 a CPU's bf16 decode may show to be chosen by
    # rollout.dtype=auto (trainer.health.logprob_mismatch); None: the engine's default.
    max_logprob_mismatch: float | None = None
    # A tensor-parallel replica's collectives fail after this long instead of hanging on a dead rank.
    tp_timeout_s: float = 60.0
    enable_prefix_caching: bool = True  # rollout.enable_prefix_caching
    max_num_batched_tokens: int | None = None  # rollout.max_num_batched_tokens (None: the engine's default)
    # rollout.kv_cache_memory_bytes (None: the engine derives it from the memory free when it starts).
    kv_cache_memory_bytes: int | None = None
    enable_chunked_prefill: bool = True  # rollout.enable_chunked_prefill
    # rollout.mode: "engine" (method calls) or "server" (the engine behind an HTTP server in this
    # process, requests and agent loops through HTTP).
    mode: str = "engine"
    # actor.lora.sync=adapter: syncs bring LoRA adapters of this rank (actor.lora.rank), merged here
    # into a copy of the base weights; 0: syncs bring whole weights.
    lora_adapter_rank: int = 0
    name: str = "rollout replica 0"  # the replica's role, as errors name it
    # trainer.data_plane=refs: finished prompt groups are scored here with this reward
    # (``take_records``) and kept in this process; None: the controller scores what ``take`` returns.
    scoring: RewardSetup | None = None
    # model.override_config: the model the engine serves is built from the overridden config, and an
    # engine that reads the checkpoint itself (vLLM, SGLang) is given the overrides to apply.
    override_config: dict[str, Any] = field(default_factory=dict)


def build_agent_runner(tokenizer: Any, setup: AgentSetup) -> AgentRunner:
    """The runner for ``setup``: tools loaded and every named loop and parser resolved, so a bad
    name fails here, at start-up, not on the first batch."""
    tools = load_tools(setup.tool_config_path, setup.max_tool_response_length, setup.tool_timeout_s)
    interaction = (load_interaction_config(setup.interaction_config_path)
                   if setup.interaction_config_path is not None else None)
    context = AgentContext(
        tokenizer,
        tools=tools,
        tool_parser=setup.tool_parser,
        max_assistant_turns=setup.max_assistant_turns,
        # verl's null max_user_turns: the user may reply after every assistant turn (never more often).
        max_user_turns=setup.max_assistant_turns,
        max_reply_turns=setup.max_user_turns or None,  # verl's 0 is no bound too
        interaction=interaction,
        max_parallel_tool_calls=setup.max_parallel_calls,
        openai_agent=setup.openai_agent,
        openai_timeout_s=setup.openai_timeout_s,
        chat_template_kwargs=dict(setup.chat_template_kwargs),
    )
    return AgentRunner(context, default_agent=setup.default_agent)


@dataclass
class StreamBatch:
    """What one ``take`` returns: requests finished since the last one, and the state now."""

    finished: list[Finished]  # (tag, trajectories, seconds since its start call), completion order
    in_flight: int  # started requests not finished yet
    engine_counts: dict[str, float] = field(default_factory=dict)  # the engine's counters now


@dataclass
class ScoredGroup:
    """A finished prompt group on the by-reference data plane: its samples' records (tokens kept
    by the replica), its reward tally, and the seconds since its ``start`` call."""

    tag: Any
    records: list[SampleRecord]
    tally: RewardTally
    seconds: float


@dataclass
class RecordBatch:
    """What one ``take_records`` returns: ``StreamBatch`` with scored groups' records."""

    finished: list[ScoredGroup]
    in_flight: int
    engine_counts: dict[str, float] = field(default_factory=dict)


@dataclass
class ReplicaOutput:
    """What one replica returns for the requests the router gave it in one round."""

    trajectories: list[list[Trajectory]]  # per request, in the order sent
    seconds: float  # wall time the replica spent on them
    # The engine's counters over the round (``EngineStats`` fields that count: prefill and
    # generated tokens, forwards, ...), for the controller's rollout metrics.
    engine_counts: dict[str, float] = field(default_factory=dict)


async def _of_request(
    generate: Callable[[GenerationRequest], Awaitable[list[Trajectory]]], request: GenerationRequest
) -> list[Trajectory]:
    """The engine's samples of ``request``, each referring to the request's row and prompt group:
    the one place a served sample gets them (the agent runner does the same for its episodes)."""
    samples = await generate(request)
    for t in samples:
        t.row, t.group_id = request.row, request.group_id
    return samples


class RolloutWorker:
    def __init__(self, rank: int, world_size: int, setup: RolloutSetup) -> None:
        self.rank, self.device = rank, setup.device
        tokenizer = load_tokenizer(setup.model_path, setup.trust_remote_code, setup.chat_template)
        # The engine owns its own copy of the weights (possibly in another dtype); the trainer
        # pushes updates with update_weights after each step. An engine that reads the checkpoint
        # itself (vLLM) gets the model on the meta device: names and shapes, no second copy.
        spec = ROLLOUT_ENGINES.get(setup.engine)  # an unknown name fails in build_rollout_engine, with the list
        if spec is not None and spec.loads_own_weights:
            model = meta_causal_lm(setup.model_path, trust_remote_code=setup.trust_remote_code,
                                   override_config=setup.override_config)
        else:
            model = load_causal_lm(setup.model_path, device=setup.device, trust_remote_code=setup.trust_remote_code,
                                   override_config=setup.override_config)
        # The module the engine serves (it may cast or move it in place): its state dict names the
        # parameters and shapes a broadcast sync is checked against.
        self.model = model
        # Taken now, before any sync writes into the model: the base every adapter is merged into.
        self.adapter_merger = AdapterMerger(model, setup.lora_adapter_rank) if setup.lora_adapter_rank > 0 else None
        self.weight_sync: WeightSyncGroup | None = None  # once joined (rollout.weight_sync=broadcast)
        self.agents: AgentRunner | None = None
        self.server: Any = None  # rollout.mode=server: the engine's HTTP server in this process
        self.client: Any = None  # ... and the client every request of this replica goes through
        self._stream: RequestStream | None = None  # the event loop requests run on, from first use
        self.name, self.scoring = setup.name, setup.scoring
        # Why this replica cannot report what its engine holds (weights_digest), or None: said once.
        self._unverifiable = unverifiable_reason(model, world_size)
        self._synced: list[str] = []  # the names the last sync wrote, what weights_digest reports
        self._received: Digest | None = None  # broadcast: checksums of the received bytes, as held
        self._adapter_synced = False  # the last sync brought a LoRA adapter (merged here): not checked
        self._scorer: RewardWorker | None = None  # built at the first take_records (its scoring processes)
        if world_size > 1:
            # One replica over ``world_size`` ranks (rollout.tensor_model_parallel_size): rank 0
            # serves, the others follow its commands.
            self.engine = self._build_tensor_parallel(model, tokenizer, setup, world_size)
            if rank == 0 and setup.agent is not None:
                self.agents = build_agent_runner(tokenizer, setup.agent)
            return
        self.engine = build_rollout_engine(setup.engine, _engine_args(setup, model, tokenizer, seed=setup.seed + rank))
        self.agents = None if setup.agent is None else build_agent_runner(tokenizer, setup.agent)
        if setup.mode == "server":
            self._serve_over_http(tokenizer, setup)

    def _serve_over_http(self, tokenizer: Any, setup: RolloutSetup) -> None:
        """``rollout.mode=server``: the engine behind hybridflow's HTTP server on 127.0.0.1 in a
        thread of this process, and a client through which every request of this replica goes."""
        from hybridflow.serving.http_client import HttpEngineClient
        from hybridflow.serving.launch import ServerThread
        from hybridflow.serving.schema import ServerLimits
        from hybridflow.serving.server import create_app

        name = f"rollout replica {self.rank}"
        # The trainer's own requests: as many samples as rollout.n asks for; the context is the model's.
        app = create_app(self.engine, tokenizer, model_name=setup.model_path, limits=ServerLimits(max_n=1 << 20))
        self.server = ServerThread(app, name=name)
        self.client = HttpEngineClient(self.server.url, name=name)
        logger.info("%s serves its engine on %s (rollout.mode=server)", name, self.server.url)

    def _build_tensor_parallel(self, model: torch.nn.Module, tokenizer: Any, setup: RolloutSetup, size: int) -> Any:
        """This rank's part of a tensor-parallel native engine over the group's ``size`` ranks: the
        engine on rank 0; on the others None, and a thread that executes rank 0's commands until
        it stops (so this worker's construction returns while rank 0's still sends them)."""
        from hybridflow.inference.tensor_parallel import TensorParallelFollower, build_tp_engine, new_tp_group

        spec = ROLLOUT_ENGINES.get(setup.engine)
        if spec is not None and spec.own_tensor_parallel:
            # vLLM and SGLang split the model over the replica's devices with workers of their own:
            # rank 0 builds the engine over all ``size`` of them; the other ranks only hold theirs.
            if self.rank != 0:
                return None
            args = _engine_args(setup, model, tokenizer, seed=setup.seed)
            return build_rollout_engine(setup.engine, dataclasses.replace(
                args, tensor_parallel_size=size, max_logprob_mismatch=None, kv_cache_memory_bytes=None))
        if spec is None or not spec.capabilities.tensor_parallel:
            raise ValueError(f"rollout.tensor_model_parallel_size={size} needs rollout.name="
                             f"{engines_with('tensor_parallel')}, not {setup.engine!r}")
        group = new_tp_group(size, setup.tp_timeout_s)
        # Every rank must agree on the dtype: an explicit one, or what ``auto`` gives without a probe.
        role = build_tp_engine(
            model, group, timeout_s=setup.tp_timeout_s, eos_token_ids=eos_token_ids(setup.model_path, tokenizer),
            pad_token_id=int(tokenizer.pad_token_id), max_batch_size=setup.max_batch_size, device=setup.device,
            dtype=choose_rollout_dtype(setup.dtype, setup.device).dtype, seed=setup.seed, tokenizer=tokenizer,
            enable_chunked_prefill=setup.enable_chunked_prefill, kv_cache_memory_bytes=setup.kv_cache_memory_bytes,
            **({} if setup.max_num_batched_tokens is None else {"max_prefill_tokens": setup.max_num_batched_tokens}),
        )
        if isinstance(role, TensorParallelFollower):
            follower = threading.Thread(target=_follow, args=(role, self.rank), daemon=True,
                                        name=f"tp-follower-{self.rank}")
            follower.start()
            return None
        self.tp_leader = role
        return role.engine

    def generate(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        """Each request's ``n`` trajectories, in request order, each with its request's row fields
        and group id (``GenerationRequest.row``: the agent loops read them too).

        The requests run on the worker's event loop (``RequestStream``), batched with any started
        by ``start``.
        """
        jobs = self._jobs(requests)
        return self.stream.run_all([job.run for job in jobs])

    def serve(self, requests: list[GenerationRequest]) -> ReplicaOutput:
        """``generate``, timed, with the engine's counters over the call: what a replica answers
        the controller's router."""
        before = _engine_counts(self.engine)
        start = time.perf_counter()
        trajectories = self.generate(requests) if requests else []
        seconds = time.perf_counter() - start
        after = _engine_counts(self.engine)
        return ReplicaOutput(trajectories, seconds, {k: after[k] - before.get(k, 0.0) for k in after})

    # ------------------------------------------------------------ streaming
    def start(self, requests: list[GenerationRequest], tags: Sequence[Any] | None = None) -> dict[str, float]:
        """Start ``requests`` and return at once (the engine's counters now, for a caller that
        measures what its requests cost). They run on the worker's event loop, batched with
        everything else in flight; ``take`` hands each one's trajectories back, under its tag
        (default: its position in this call), as soon as all its samples are done. More
        ``start`` calls may come while earlier requests run."""
        tags = list(range(len(requests))) if tags is None else list(tags)
        if len(tags) != len(requests):
            raise ValueError(f"RolloutWorker.start: {len(tags)} tags for {len(requests)} requests")
        jobs = self._jobs(requests, tags)
        counts = _engine_counts(self.engine)
        self.stream.start(jobs)
        return counts

    def take(self, max_wait_s: float = 0.0) -> StreamBatch:
        """The started requests finished since the last ``take`` (waiting at most ``max_wait_s``
        for a first one): their tags and trajectories, how many are still in flight, and the
        engine's counters. A request that raised raises here, naming it (and, through the
        worker group, this replica). Keep ``max_wait_s`` short on Ray: the actor answers other
        calls (a weight update) only between two takes."""
        self._fault_point()
        finished = self.stream.take(max_wait_s)
        return StreamBatch(finished, self.stream.in_flight, _engine_counts(self.engine))

    def take_records(self, max_wait_s: float = 0.0) -> RecordBatch:
        """``take`` on the by-reference data plane (``hybridflow.data.plane``): each finished
        prompt group (its trajectories carry their row's fields) is scored here with the run's
        reward (``RolloutSetup.scoring``; shaping on, as training scores) and kept in this process;
        what comes back is its samples' records and the reward metrics' tally, not its tokens."""
        if self.scoring is None:
            raise RuntimeError(f"{self.name}: take_records needs RolloutSetup.scoring (trainer.data_plane=refs)")
        self._fault_point()
        if self._scorer is None:
            self._scorer = RewardWorker(0, 1, self.scoring)
        groups = []
        for finished in self.stream.take(max_wait_s):
            tally = score_trajectories(self._scorer, finished.trajectories)
            handle = put_group(finished.trajectories, self.name)
            groups.append(ScoredGroup(finished.tag, records_of(finished.trajectories, handle), tally, finished.seconds))
        return RecordBatch(groups, self.stream.in_flight, _engine_counts(self.engine))

    def ping(self) -> int:
        """This replica's process id: that it answers is the point (the controller's check for a
        replica that died while idle, before a weight sync would fail on it)."""
        return os.getpid()

    def _fault_point(self) -> None:
        """Tests of replica recovery (``HYBRIDFLOW_FAULT=replica_take/rollout_replica_<k>@<version>``):
        this process is SIGKILLed at a take while its requests run, as an OOM kill or a lost node
        would end it, when its engine serves that policy version (a restarted replica serves a later one)."""
        maybe_fault(f"replica_take/{self.name.replace(' ', '_')}", int(getattr(self.engine, "policy_version", 0)))

    def abort(self) -> int:
        """Cancel every started request still in flight and drop finished ones not yet taken;
        returns how many. Used when a round fails elsewhere, so nothing stale reaches a later take."""
        return self.stream.abort()

    def _jobs(self, requests: Sequence[GenerationRequest], tags: Sequence[Any] | None = None) -> list[Job]:
        """One job per request: the engine's ``generate``, or its ``n`` agent episodes; either way
        its trajectories come back with the request's row fields and group id (``_of_request``)."""
        generator = self.client or self.engine
        tags = list(range(len(requests))) if tags is None else tags
        labels = [f"{tag!r}" + (f" ({r.request_id!r})" if r.request_id else "") for tag, r in zip(tags, requests)]
        if self.agents is None:
            return [Job(tag, label, functools.partial(_of_request, generator.generate, r))
                    for tag, label, r in zip(tags, labels, requests, strict=True)]
        if any(r.row is None for r in requests):
            raise ValueError("RolloutWorker.generate with agent loops needs each request's row fields "
                             "(GenerationRequest.row): the loops read them")
        agents = self.agents
        # A row's episodes are seeded by its position in the call (as AgentRunner.generate does),
        # so a streamed call generates what a blocking one would.
        return [
            Job(tag, label, functools.partial(agents.generate_row, AgentRow(list(r.prompt_ids), r.row, r.group_id),
                                              i, r.params, generator))
            for i, (tag, label, r) in enumerate(zip(tags, labels, requests, strict=True))
        ]

    @property
    def stream(self) -> RequestStream:
        """The event loop every request of this worker runs on (started on first use)."""
        if self._stream is None:
            self._stream = RequestStream(f"rollout rank {self.rank}")
        return self._stream

    def sleep(self, level: int = 1) -> None:
        """Free generation memory while the trainer works (``rollout.free_cache_engine``): the KV
        cache, and at level 2 the weights too (the next full weight update restores them).
        Refused while started requests are in flight: take (or abort) them first."""
        in_flight = 0 if self._stream is None else self._stream.in_flight
        if in_flight:
            raise RuntimeError(f"rollout rank {self.rank} cannot sleep: {in_flight} started requests are still in "
                               f"flight; take() them (or abort()) first")
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def kv_cache_budget(self) -> int | None:
        """The bytes this rank's engine sized its KV cache by (None: an engine that sizes its own, or a
        tensor-parallel follower), for the run folder's record (``controller.token_budgets``)."""
        return getattr(self.engine, "kv_cache_memory_bytes", None)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                       note_received: bool = False) -> None:
        """Copy new weights into the engine; tokens generated from now on record policy
        ``version`` (default: the engine's last + 1; see ``Trajectory.token_versions``).
        LoRA adapters (``actor.lora.sync=adapter``) are merged into the base weights first.
        ``note_received``: keep the checksums of the tensors handed in (in the engine's dtype, before
        the copy), as the broadcast path does of the bytes received, for ``weights_digest``: an actor
        rank in this process handed them (``trainer.hybrid_engine``), so the controller never saw them."""
        weights = list(weights)
        adapter = self.adapter_merger is not None and is_adapter_payload(n for n, _ in weights)
        if adapter:
            weights = self.adapter_merger.merged(weights)
        received: Digest | None = None
        if note_received and not adapter:
            targets = self.model.state_dict()
            received = {n: (str(targets[n].dtype), sent_checksum(t, str(targets[n].dtype)))
                        for n, t in weights if n in targets}
        self.engine.update_weights(weights, version=version)
        self._after_sync([name for name, _ in weights], version, received, adapter=adapter)

    def _after_sync(self, names: list[str], version: int | None, received: Digest | None,
                    adapter: bool = False) -> None:
        # An adapter payload is not what the engine holds (it merged it): nothing sent to compare.
        self._synced, self._received, self._adapter_synced = names, received, adapter
        if names and not adapter and fault_requested(f"corrupt_weight_sync/{self.name.replace(' ', '_')}", version or 0):
            # Tests of the verifier (HYBRIDFLOW_FAULT): one byte of the first synced tensor flipped
            # in the engine's copy, as a faulty copy or transfer would leave it.
            with torch.no_grad():
                self.model.state_dict()[names[0]].reshape(-1).view(torch.uint8)[0] ^= 0xFF

    def weights_digest(self) -> tuple[Digest, Digest | None] | None:
        """What the engine holds of the last sync's tensors (``hybridflow.transfer.verify``), read
        from its parameters after the copy, and on the broadcast path the checksums of the bytes
        received (as held); None when this replica cannot tell (logged once, with why)."""
        if self._unverifiable is None and self._adapter_synced:
            self._unverifiable = ("the LoRA adapter sync (actor.lora.sync=adapter) sends the adapter, which this "
                                  "replica merges: the trainer holds no merged bytes to compare with")
        if self._unverifiable is not None:
            if self._unverifiable:
                logger.info("%s: weight sync not verified: %s", self.name, self._unverifiable)
                self._unverifiable = ""
            return None
        return held_digest(self.model.state_dict(), self._synced), self._received

    # ------------------------------------------------------------ weight sync (broadcast)
    def device_uuid(self) -> str | None:
        """This rank's GPU (None on CPU), so the controller can tell whether NCCL can link it to
        actor rank 0."""
        return gpu_uuid(self.device)

    def join_weight_sync(self, host: str, port: int, world_size: int, on_gpu: bool, member: int | None = None) -> None:
        """Join the weight-sync group at ``host:port`` as receiver ``member`` (default ``rank + 1``;
        actor rank 0 is the sender, member 0); returns once all ``world_size`` members have joined."""
        member = SENDER_RANK + 1 + self.rank if member is None else member
        self.weight_sync = WeightSyncGroup.connect(rank=member, world_size=world_size, host=host, port=port,
                                                   device=sync_device(self.device, on_gpu))

    def receive_weights(self, version: int | None = None) -> TransferStats:
        """One weight sync from actor rank 0 (which runs ``send_weights`` at the same time): each
        bucket is checked against the model's names and shapes, then applied by the engine
        (cast to its dtype) as it arrives. The engine runs no step until the last bucket is in, so
        no step sees a mix of old and new weights. Tokens generated after it record policy
        ``version`` (as ``update_weights``)."""
        if self.weight_sync is None:
            raise RuntimeError(f"rollout rank {self.rank} has not joined a weight-sync group: call join_weight_sync "
                               f"first")
        with self.engine.weight_update(version) as apply:
            if self.adapter_merger is None:
                targets, received = self.model.state_dict(), {}

                def apply_and_note(bucket: list[tuple[str, torch.Tensor]]) -> None:
                    # The received bytes' checksums, in the dtype the engine holds (its cast), before the
                    # copy: the replica's digest after it must match them.
                    received.update((n, (str(targets[n].dtype), sent_checksum(t, str(targets[n].dtype))))
                                    for n, t in bucket if n in targets)
                    apply(bucket)

                stats = weight_transfer.receive_weights(self.weight_sync, targets, apply_and_note)
                self._after_sync(list(received), version, received)
                return stats
            # actor.lora.sync=adapter: A, B and the scaling arrive (checked against their shapes
            # from the base weights and the rank), then merge into the base, applied at once.
            received: dict[str, torch.Tensor] = {}

            def keep(bucket: list[tuple[str, torch.Tensor]]) -> None:
                received.update((name, tensor.clone()) for name, tensor in bucket)  # views, valid in the call

            stats = weight_transfer.receive_weights(self.weight_sync, self.adapter_merger.targets(), keep)
            apply(self.adapter_merger.merged(received.items()))
            self._after_sync(list(received), version, None, adapter=True)
            return stats

    def close_weight_sync(self) -> None:
        """Leave the weight-sync group (a no-op when not in one)."""
        if self.weight_sync is not None:
            self.weight_sync.close()
            self.weight_sync = None

    def close(self) -> None:
        """Stop the worker's event loop (cancelling what runs) and this replica's HTTP server
        (server mode)."""
        if self._stream is not None:
            client = self.client
            self._stream.close(None if client is None else client.aclose)
            self._stream = None
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None


def _engine_args(setup: RolloutSetup, model: torch.nn.Module, tokenizer: Any, *, seed: int) -> EngineArgs:
    """The engine's arguments from the worker's set-up (one replica's engine, seeded ``seed``)."""
    return EngineArgs(
        model=model,
        eos_token_ids=eos_token_ids(setup.model_path, tokenizer),
        pad_token_id=int(tokenizer.pad_token_id),
        max_batch_size=setup.max_batch_size,
        device=setup.device,
        dtype=setup.dtype,
        seed=seed,
        tokenizer=tokenizer,
        enforce_eager=setup.enforce_eager,
        max_logprob_mismatch=setup.max_logprob_mismatch,
        enable_prefix_caching=setup.enable_prefix_caching,
        model_path=setup.model_path,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        enable_chunked_prefill=setup.enable_chunked_prefill,
        model_override_config=setup.override_config,
        kv_cache_memory_bytes=setup.kv_cache_memory_bytes,
    )


def _engine_counts(engine: Any) -> dict[str, float]:
    """The numeric counters of an engine's ``stats`` (none for an engine without them)."""
    stats = getattr(engine, "stats", None)
    if stats is None:
        return {}
    return {k: float(v) for k, v in vars(stats).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _follow(follower: Any, rank: int) -> None:
    """A follower rank's life: execute the leader's commands until it stops or is lost."""
    try:
        follower.follow()
    except Exception:  # the leader is gone: its own error names the replica; this one is logged
        logger.exception("tensor-parallel rank %d stopped following", rank)


def unverifiable_reason(model: torch.nn.Module, world_size: int) -> str | None:
    """Why a replica cannot report the weights its engine holds (``weights_digest``), or None."""
    if world_size > 1:
        return "a tensor-parallel replica's engine holds shards, not the synced tensors"
    if any(p.is_meta for p in model.parameters()):
        return "its engine (vLLM, SGLang) loads and holds its own copy, out of reach of this process"
    return None
