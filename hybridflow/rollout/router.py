"""Which rollout replica serves a request: placement by in-flight tokens, sticky sessions.

A run with several rollout replicas (``trainer.n_workers`` ranks on Ray, ``rollout.tensor_model_parallel_size``
ranks each) hands every request to the router, which picks its replica. The router is pure
bookkeeping (no processes, no clocks); the controller asks it where each request goes, sends each
replica its requests, and tells it when they finished.

Load is counted in *tokens*, not requests: a request costs its prompt plus ``n`` responses of the
expected length (the running mean of what finished requests produced, ``max_tokens`` before any
finished), because one request with a 2,000-token prompt and n=16 is worth many short ones. Among
the requests placed together, the heaviest go first, each to the replica with the fewest
in-flight tokens (longest-processing-time first, within 4/3 of the best split).

Sticky sessions: a request that names a session (a multi-turn episode whose turns arrive as
separate requests) goes to the replica its session went to before, which holds its KV cache, as
long as that replica is alive; sessions are forgotten least recently used beyond ``max_sessions``.
Agent loops that run inside a replica's process (the rollout worker) are pinned by construction.

A replica marked dead takes no new requests; placing a request whose session lived there moves
the session. With every replica dead, ``place`` raises ``NoReplicaError`` naming them. A dead
replica that was restarted (``rollout.max_replica_restarts``) is ``revive``d: it takes requests again.
An elastic run (``rollout.elastic``) ``add``s replicas as nodes join, and a replica removed for good
stays dead (its slot may take a new replica later: ``add`` reuses it, counters cleared).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_SESSIONS = 1 << 16


class NoReplicaError(RuntimeError):
    """No live replica is left to take a request."""


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs to know of one request."""

    prompt_tokens: int
    n: int  # samples
    max_tokens: int  # per sample
    session: str | None = None  # a multi-turn episode's id; None: no affinity


@dataclass(frozen=True)
class Ticket:
    """Where ``place`` put one request, and the load it added there (what ``finish`` takes back)."""

    replica: int
    cost: int  # tokens
    n: int


@dataclass
class ReplicaLoad:
    """One replica's counters: what it holds now and what it has done."""

    in_flight_tokens: int = 0
    in_flight_requests: int = 0
    requests: int = 0  # finished
    generated_tokens: int = 0
    busy_seconds: float = 0.0
    alive: bool = True
    failure: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0


@dataclass
class ReplicaRouter:
    """Places requests on ``num_replicas`` replicas (see the module docstring)."""

    num_replicas: int
    max_sessions: int = DEFAULT_MAX_SESSIONS
    loads: list[ReplicaLoad] = field(init=False)
    _sessions: OrderedDict[str, int] = field(init=False, default_factory=OrderedDict)
    # Running mean of generated tokens per sample over finished requests (None before any).
    _mean_response: float | None = field(init=False, default=None)
    _finished_samples: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {self.num_replicas}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        self.loads = [ReplicaLoad() for _ in range(self.num_replicas)]

    # ------------------------------------------------------------------ placing
    def cost(self, request: RouteRequest) -> int:
        """Tokens the request is expected to hold while it runs: its prompt (each sample decodes
        against it) plus ``n`` expected responses."""
        expected = request.max_tokens if self._mean_response is None else min(self._mean_response, request.max_tokens)
        return request.prompt_tokens + round(request.n * expected)

    def place(self, requests: Sequence[RouteRequest]) -> list[Ticket]:
        """Each request's ticket (in request order): its replica, counted in flight until ``finish``."""
        live = [r for r, load in enumerate(self.loads) if load.alive]
        if not live:
            failures = "; ".join(f"replica {r}: {load.failure}" for r, load in enumerate(self.loads))
            raise NoReplicaError(f"no rollout replica is alive to take {len(requests)} request(s) ({failures})")
        costs = [self.cost(request) for request in requests]
        placed: list[Ticket | None] = [None] * len(requests)
        # Heaviest first; ties keep request order, so placement is deterministic.
        for i in sorted(range(len(requests)), key=lambda i: -costs[i]):
            session = requests[i].session
            replica = self._session_replica(session)
            if replica is None:
                replica = min(live, key=lambda r: (self.loads[r].in_flight_tokens, r))
            if session is not None:
                self._remember(session, replica)
            load = self.loads[replica]
            load.in_flight_tokens += costs[i]
            load.in_flight_requests += 1
            placed[i] = Ticket(replica, costs[i], requests[i].n)
        return [ticket for ticket in placed if ticket is not None]

    def finish(self, ticket: Ticket, generated_tokens: int, seconds: float = 0.0) -> None:
        """The request of ``ticket`` is done: it produced ``generated_tokens`` in all. ``seconds``
        is replica busy time to credit (pass it once per batch, not per request)."""
        load = self.loads[ticket.replica]
        load.in_flight_tokens = max(0, load.in_flight_tokens - ticket.cost)
        load.in_flight_requests = max(0, load.in_flight_requests - 1)
        load.requests += 1
        load.generated_tokens += generated_tokens
        load.busy_seconds += seconds
        total = (self._mean_response or 0.0) * self._finished_samples + generated_tokens
        self._finished_samples += ticket.n
        self._mean_response = total / self._finished_samples if self._finished_samples else None

    def abandon(self, ticket: Ticket) -> None:
        """The request of ``ticket`` failed or was dropped: its tokens leave the replica's load,
        and nothing is learnt from it."""
        load = self.loads[ticket.replica]
        load.in_flight_tokens = max(0, load.in_flight_tokens - ticket.cost)
        load.in_flight_requests = max(0, load.in_flight_requests - 1)

    def mark_dead(self, replica: int, reason: str) -> None:
        """``replica`` takes no more requests; its in-flight ones are the caller's to fail."""
        load = self.loads[replica]
        load.alive, load.failure = False, reason
        load.in_flight_tokens = load.in_flight_requests = 0

    def add(self, replica: int | None = None) -> int:
        """A new replica, empty, in slot ``replica`` (a dead one's, its counters cleared) or a new
        last slot (None); returns its slot. New requests go to it first: it holds none in flight."""
        if replica is None:
            self.loads.append(ReplicaLoad())
            self.num_replicas += 1
            return self.num_replicas - 1
        if self.loads[replica].alive:
            raise ValueError(f"replica {replica} is alive: a new one cannot take its slot")
        self.loads[replica] = ReplicaLoad()
        return replica

    def revive(self, replica: int) -> None:
        """``replica`` was restarted: it takes requests again, starting empty (what it did before is kept)."""
        load = self.loads[replica]
        load.alive, load.failure = True, None
        load.in_flight_tokens = load.in_flight_requests = 0

    # ------------------------------------------------------------------ sessions
    def _session_replica(self, session: str | None) -> int | None:
        if session is None:
            return None
        replica = self._sessions.get(session)
        if replica is None or not self.loads[replica].alive:
            return None
        self._sessions.move_to_end(session)
        return replica

    def _remember(self, session: str, replica: int) -> None:
        self._sessions[session] = replica
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def end_session(self, session: str) -> None:
        """Forget ``session`` (its episode is over)."""
        self._sessions.pop(session, None)

    # ------------------------------------------------------------------ reporting
    def metrics(self, busy_seconds: Sequence[float], generated_tokens: Sequence[int],
                replicas: Sequence[int] | None = None) -> dict[str, float]:
        """One generation round's load figures from each replica's busy time and generated tokens
        (``replicas``: the slots they are of, default all; an elastic run leaves out removed ones).

        ``rollout/replica_load_imbalance``: the most tokens one replica generated over the mean (1.0
        is an even split of the work; a function of the placement and the seeded samples, so a
        resumed run logs the same value). Wall-clock figures go under ``perf/`` with the other
        timings: ``perf/rollout/replica_busy_imbalance`` (the busiest replica's time over the mean:
        what the step waits for) and ``perf/rollout/replica_<k>/tokens_per_s``.
        """
        slots = range(self.num_replicas) if replicas is None else replicas
        if len(busy_seconds) != len(slots) or len(generated_tokens) != len(slots):
            raise ValueError(f"{len(slots)} replicas, got {len(busy_seconds)} times and "
                             f"{len(generated_tokens)} token counts")

        def imbalance(values: Sequence[float]) -> float:
            mean = sum(values) / len(values)
            return max(values) / mean if mean > 0 else 1.0

        metrics = {"rollout/replica_load_imbalance": imbalance(generated_tokens),
                   "perf/rollout/replica_busy_imbalance": imbalance(busy_seconds)}
        for r, seconds, tokens in zip(slots, busy_seconds, generated_tokens, strict=True):
            metrics[f"perf/rollout/replica_{r}/tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
        return metrics
