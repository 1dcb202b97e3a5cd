"""What would the step cost asynchronously? A discrete-event model of one RL step's pipeline.

``hybridflow simulate`` predicts the steady-state step time of three loops at N devices from
per-phase costs and a response-length distribution, so that one can see, before building or
running them, what one-step-off or fully asynchronous training would buy on a given workload:

- ``sync`` (this repository's loop, colocated): all N devices generate (N / ``devices_per_replica``
  replicas), then score, then all N train, then the weights are synced. Generation ends with the
  slowest replica's last sequence: a long tail keeps every other device waiting.
- ``one_step_off`` (verl's one-step-off-policy): R devices generate, T = N - R train. Batch k+1
  is generated with the weights of step k-1 while batch k is scored and trained; the step ends when
  both are done, then the weights are synced (both sides wait for it). Steady state:
  ``max(gen, reward + train) + sync``; the first step pays ``gen`` alone.
- ``fully_async`` (staleness s, AReaL's rule): R devices generate continuously, every freed slot
  starts a new sample at once, but no more than ``(version + s + 1) x batch`` samples are started
  by the time the trainer has made ``version`` updates (a sample is at most s versions stale when
  trained). The trainer takes the first ``batch`` finished samples, scores and trains on them,
  then syncs; while weights are synced, generation pauses (in-flight samples resume after it).

The generation model, per replica: ``slots`` sequences decode together (continuous batching); a
decode iteration takes ``decode_s_per_token`` whatever the number of busy slots (decoding is
memory-bound: a partly empty batch costs as much as a full one), and each sample costs
``request_overhead_s`` (its prefill, scheduling) in its slot before its first token. A sample of
length L holds its slot for ``overhead + L x decode_s_per_token``; a freed slot takes the next
sample. In ``sync`` and ``one_step_off`` a batch's samples are dealt to replicas round-robin (lengths
are unknown when requests are placed); in ``fully_async`` all slots draw from one stream.

The training model: scoring takes ``reward_s`` per batch on the trainer's side; training takes
``train_s_per_token x tokens / trainer_devices`` (prompt and response tokens of the batch; linear
scaling, no communication cost); a weight sync takes ``weight_sync_s`` whatever the split.

Reported per mode and N (and s): the steady-state step time (mean over ``steps`` steps after a
warm-up), the speed-up over ``sync`` at the same N, the devices given to rollout / training (the
split with the shortest step unless fixed), and two idle ratios over the whole simulated run:
``rollout idle`` (1 - slot-seconds decoding / (slots x replicas x time): empty slots in a tail are
idle) and ``trainer idle`` (1 - seconds scoring, training or syncing / time).

Not modelled: memory limits on ``slots``, prefill/decode interference, KV-cache preemption, the
cost of off-policy samples to learning (staleness is a knob, not a price), network topology,
stragglers among trainer ranks, and how colocated sync's offload/onload adds to its step. The
lengths are drawn independently per sample (a seeded lognormal with a cap, or an empirical
list), so runs are reproducible. Nothing here imports torch.

From a run folder (``profile_from_run``): the phases' seconds are the means of ``timing_s/*`` over
the steps of ``metrics.jsonl``; ``decode_s_per_token`` is the value at which this model's ``sync``
generation of the run's batch (its replicas and slots) takes the measured ``timing_s/gen``; the
lengths are a lognormal with the measured mean whose expected batch maximum is the measured
``response_length/max``, capped at the largest length seen. Validating the async predictions
against measured async runs awaits those loops.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

MODES = ("sync", "one_step_off", "fully_async")


# ---------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class LengthModel:
    """Response lengths: a lognormal (``mu``, ``sigma`` of log-length) capped at ``cap``, or an
    empirical list sampled with replacement (``empirical``)."""

    mu: float = math.log(500.0)
    sigma: float = 0.8
    cap: int = 4096
    empirical: tuple[int, ...] = ()

    def sample(self, rng: random.Random, n: int) -> list[int]:
        if self.empirical:
            return [rng.choice(self.empirical) for _ in range(n)]
        return [max(1, min(self.cap, round(rng.lognormvariate(self.mu, self.sigma)))) for _ in range(n)]

    @classmethod
    def from_mean_and_max(cls, mean: float, batch_max: float, batch: int, cap: int) -> LengthModel:
        """The lognormal with mean ``mean`` whose expected maximum over ``batch`` draws is about
        ``batch_max``: exp(mu + sigma z) = max with z the (1 - 1/(batch+1)) normal quantile and
        mu = ln(mean) - sigma^2 / 2, i.e. sigma^2 / 2 - z sigma + ln(max / mean) = 0."""
        if mean <= 0:
            raise ValueError(f"mean response length must be > 0, got {mean}")
        z = statistics.NormalDist().inv_cdf(1.0 - 1.0 / (batch + 1)) if batch > 1 else 0.0
        gap = math.log(max(batch_max, mean) / mean)
        disc = z * z - 2.0 * gap
        sigma = z - math.sqrt(disc) if disc >= 0 else z
        return cls(mu=math.log(mean) - sigma * sigma / 2.0, sigma=sigma, cap=max(1, int(cap)))


@dataclass(frozen=True)
class Costs:
    """Per-phase costs; see the module docstring for what each means."""

    decode_s_per_token: float = 0.03  # one decode iteration of a replica (any number of busy slots)
    request_overhead_s: float = 0.0  # per sample: prefill and scheduling, in its slot
    slots: int = 64  # sequences a replica decodes together
    devices_per_replica: int = 1  # tensor parallelism of a rollout replica
    train_s_per_token: float = 1e-4  # trainer seconds per batch token on one device
    reward_s: float = 0.0  # scoring a batch
    weight_sync_s: float = 1.0
    prompt_tokens: float = 200.0  # mean prompt length (training tokens = prompt + response)
    batch: int = 512  # samples per step (train_batch_size x rollout.n)


@dataclass(frozen=True)
class Prediction:
    mode: str
    devices: int
    staleness: int | None
    rollout_devices: int
    trainer_devices: int
    step_s: float
    rollout_idle: float
    trainer_idle: float
    speedup: float = 1.0


@dataclass(frozen=True)
class RunProfile:
    """What ``profile_from_run`` read: the costs, the lengths and where they came from."""

    costs: Costs
    lengths: LengthModel
    steps: int
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------- generation
def replica_makespan(lengths: list[int], slots: int, decode_s: float, overhead_s: float) -> float:
    """When the last of ``lengths`` (in arrival order) finishes on one replica with ``slots`` slots."""
    free = [0.0] * min(slots, max(1, len(lengths)))
    end = 0.0
    for length in lengths:
        start = heapq.heappop(free)
        done = start + overhead_s + length * decode_s
        end = max(end, done)
        heapq.heappush(free, done)
    return end


def generate_batch(lengths: list[int], replicas: int, c: Costs) -> tuple[float, float]:
    """(seconds until every replica is done, slot-seconds spent decoding) for one batch dealt
    round-robin over ``replicas``."""
    spans = [replica_makespan(lengths[r::replicas], c.slots, c.decode_s_per_token, c.request_overhead_s)
             for r in range(replicas)]
    used = sum(c.request_overhead_s + length * c.decode_s_per_token for length in lengths)
    return max(spans), used


def train_seconds(lengths: list[int], trainer_devices: int, c: Costs) -> float:
    tokens = sum(lengths) + c.prompt_tokens * len(lengths)
    return c.train_s_per_token * tokens / trainer_devices


# ---------------------------------------------------------------------- the three loops
def _replicas(devices: int, c: Costs) -> int:
    return max(1, devices // c.devices_per_replica)


def _idle(used: float, capacity: float) -> float:
    return min(1.0, max(0.0, 1.0 - used / capacity)) if capacity > 0 else 1.0


def simulate_sync(devices: int, lengths: LengthModel, c: Costs, steps: int = 20, seed: int = 0) -> Prediction:
    rng, replicas = random.Random(seed), _replicas(devices, c)
    total = used = trained = 0.0
    for _ in range(steps):
        batch = lengths.sample(rng, c.batch)
        gen, slot_s = generate_batch(batch, replicas, c)
        train = train_seconds(batch, devices, c)
        total += gen + c.reward_s + train + c.weight_sync_s
        used += slot_s
        trained += c.reward_s + train + c.weight_sync_s
    return Prediction("sync", devices, None, devices, devices, total / steps,
                      _idle(used, c.slots * replicas * total), _idle(trained, total))


def simulate_one_step_off(devices: int, rollout_devices: int, lengths: LengthModel, c: Costs, steps: int = 20,
                          seed: int = 0) -> Prediction:
    """Step k: generate batch k+1 while batch k is scored and trained, then sync."""
    trainer_devices = devices - rollout_devices
    _check_split(devices, rollout_devices)
    rng, replicas = random.Random(seed), _replicas(rollout_devices, c)
    batches = [lengths.sample(rng, c.batch) for _ in range(steps + 1)]
    gens = [generate_batch(b, replicas, c) for b in batches]
    now = gens[0][0]  # warm-up: the first batch is generated alone
    step_ends, used, trained = [], gens[0][1], 0.0
    for k in range(steps):
        train = c.reward_s + train_seconds(batches[k], trainer_devices, c)
        gen, slot_s = gens[k + 1]
        now += max(gen, train) + c.weight_sync_s
        step_ends.append(now)
        used += slot_s
        trained += train + c.weight_sync_s
    step = (step_ends[-1] - gens[0][0]) / steps
    return Prediction("one_step_off", devices, 1, rollout_devices, trainer_devices, step,
                      _idle(used, c.slots * replicas * now), _idle(trained, now))


def simulate_fully_async(devices: int, rollout_devices: int, staleness: int, lengths: LengthModel, c: Costs,
                         steps: int = 20, seed: int = 0) -> Prediction:
    """Continuous generation on every slot, bounded by staleness; the trainer takes the first
    ``batch`` finished samples. Steady state: the mean step over the last ``steps`` updates after
    ``staleness + 1`` warm-up updates."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    trainer_devices = devices - rollout_devices
    _check_split(devices, rollout_devices)
    rng = random.Random(seed)
    slots = _replicas(rollout_devices, c) * c.slots
    warmup = staleness + 1
    updates_wanted = warmup + steps
    now, free, started, version = 0.0, slots, 0, 0
    inflight: list[tuple[float, int]] = []  # (end, length)
    finished: list[int] = []
    used = trained = 0.0
    train_end = sync_end = math.inf  # the trainer's pending events
    paused_until = 0.0
    update_ends: list[float] = []
    while len(update_ends) < updates_wanted:
        if now >= paused_until:
            while free and started < (version + staleness + 1) * c.batch:
                (length,) = lengths.sample(rng, 1)
                hold = c.request_overhead_s + length * c.decode_s_per_token
                heapq.heappush(inflight, (now + hold, length))
                free, started, used = free - 1, started + 1, used + hold
        if train_end == math.inf and sync_end == math.inf and len(finished) >= c.batch:
            batch, finished = finished[: c.batch], finished[c.batch :]
            work = c.reward_s + train_seconds(batch, trainer_devices, c)
            train_end, trained = now + work, trained + work + c.weight_sync_s
        now = min(inflight[0][0] if inflight else math.inf, train_end, sync_end,
                  paused_until if paused_until > now else math.inf)
        if now == math.inf:  # cannot happen with batch >= 1 and slots >= 1; a bug, not a hang
            raise RuntimeError("fully_async simulation has no next event")
        if now == train_end:  # weights go out: generation pauses, in-flight samples resume after
            train_end, sync_end = math.inf, now + c.weight_sync_s
            paused_until = sync_end
            inflight = [(end + c.weight_sync_s, length) for end, length in inflight]
            heapq.heapify(inflight)
        elif now == sync_end:
            sync_end, version = math.inf, version + 1
            update_ends.append(now)
        while inflight and inflight[0][0] <= now:
            _, length = heapq.heappop(inflight)
            finished.append(length)
            free += 1
    step = (update_ends[-1] - update_ends[warmup - 1]) / steps
    return Prediction("fully_async", devices, staleness, rollout_devices, trainer_devices, step,
                      _idle(used, slots * now), _idle(trained, now))


def _check_split(devices: int, rollout_devices: int) -> None:
    if not 0 < rollout_devices < devices:
        raise ValueError(f"a split loop needs devices on both sides: {rollout_devices} of {devices} for rollout")


def candidate_splits(devices: int, c: Costs) -> list[int]:
    """Rollout device counts tried for the split loops: eighths of N (and every count when N <= 16),
    whole replicas, at least one device left for training."""
    raw = range(1, devices) if devices <= 16 else (round(devices * k / 8) for k in range(1, 8))
    tp = c.devices_per_replica
    return sorted({r // tp * tp for r in raw if tp <= r // tp * tp < devices})


def predict(devices: list[int], stalenesses: list[int], lengths: LengthModel, c: Costs, *, steps: int = 20,
            seed: int = 0, rollout_fraction: float | None = None) -> list[Prediction]:
    """Every mode at every device count; the split loops at their best split, or at
    ``rollout_fraction`` of the devices when given."""
    out: list[Prediction] = []
    for n in devices:
        base = simulate_sync(n, lengths, c, steps, seed)
        out.append(base)
        if rollout_fraction is not None:
            r = max(c.devices_per_replica, round(n * rollout_fraction) // c.devices_per_replica * c.devices_per_replica)
            splits = [r] if r < n else []
        else:
            splits = candidate_splits(n, c)
        if not splits:
            continue
        runs = [lambda r: simulate_one_step_off(n, r, lengths, c, steps, seed)]
        runs += [lambda r, s=s: simulate_fully_async(n, r, s, lengths, c, steps, seed) for s in stalenesses]
        for run in runs:
            best = min((run(r) for r in splits), key=lambda p: p.step_s)
            out.append(replace(best, speedup=base.step_s / best.step_s))
    return out


def format_predictions(predictions: list[Prediction]) -> str:
    lines = [f"{'mode':<16} {'devices':>7} {'rollout/train':>13} {'step s':>10} {'speed-up':>9} "
             f"{'rollout idle':>12} {'trainer idle':>12}"]
    for p in predictions:
        mode = p.mode if p.staleness is None or p.mode != "fully_async" else f"{p.mode} s={p.staleness}"
        split = "colocated" if p.mode == "sync" else f"{p.rollout_devices}/{p.trainer_devices}"
        lines.append(f"{mode:<16} {p.devices:>7} {split:>13} {p.step_s:>10.2f} {p.speedup:>8.2f}x "
                     f"{p.rollout_idle:>12.1%} {p.trainer_idle:>12.1%}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- from a run folder
TRAINER_PHASES = ("old_log_prob", "ref", "adv", "values", "update_critic", "update_actor", "gen_baseline")
REWARD_PHASES = ("reward", "reward_model")


def read_step_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The training steps' records of ``<run>/metrics.jsonl`` (step >= 1), a step's lines merged."""
    path = Path(run_dir) / "metrics.jsonl"
    merged: dict[int, dict[str, float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a killed writer's partial last line
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 1:
            merged.setdefault(step, {}).update({k: v for k, v in record.items() if isinstance(v, int | float)})
    return [merged[s] for s in sorted(merged) if "timing_s/step" in merged[s]]


def profile_from_run(run_dir: str | Path, *, replicas: int = 1, trainer_devices: int = 1, slots: int = 64,
                     overhead_s: float = 0.0, seed: int = 0) -> RunProfile:
    """Costs and lengths measured by a sync run (see the module docstring for how)."""
    records = read_step_metrics(run_dir)
    if not records:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} holds no training step with timing_s/step")

    def mean(key: str) -> float:
        values = [r[key] for r in records if key in r and r[key] is not None]
        return sum(values) / len(values) if values else 0.0

    resp, prompt = mean("response_length/mean"), mean("prompt_length/mean")
    tokens = mean("perf/total_num_tokens")
    if resp <= 0 or tokens <= 0:
        raise ValueError(f"{run_dir}: metrics.jsonl lacks response_length/mean or perf/total_num_tokens")
    batch = max(1, round(tokens / (prompt + resp)))
    cap = max(int(r.get("response_length/max", 0)) for r in records) or round(resp)
    lengths = LengthModel.from_mean_and_max(resp, mean("response_length/max"), batch, cap)
    trainer_s = sum(mean(f"timing_s/{p}") for p in TRAINER_PHASES)
    costs = Costs(
        decode_s_per_token=1.0, request_overhead_s=0.0, slots=slots, train_s_per_token=trainer_s * trainer_devices / tokens,
        reward_s=sum(mean(f"timing_s/{p}") for p in REWARD_PHASES), weight_sync_s=mean("timing_s/update_weights"),
        prompt_tokens=prompt, batch=batch,
    )
    # Calibrate: this model's sync generation of such batches (unit decode time, overhead_s per
    # sample) against the measured generation seconds.
    rng = random.Random(seed)
    unit = replace(costs, request_overhead_s=0.0)
    token_units = statistics.fmean(generate_batch(lengths.sample(rng, batch), replicas, unit)[0] for _ in range(20))
    gen = mean("timing_s/gen")
    decode = max(gen - overhead_s * math.ceil(batch / replicas / slots), 1e-9) / token_units
    notes = [
        f"{len(records)} step(s) of {Path(run_dir) / 'metrics.jsonl'}",
        f"batch {batch} samples, prompt {prompt:.0f} tokens, response mean {resp:.0f} (lognormal mu {lengths.mu:.2f} "
        f"sigma {lengths.sigma:.2f}, cap {lengths.cap})",
        f"gen {gen:.3f} s -> decode {decode * 1e3:.3f} ms/token ({replicas} replica(s) x {slots} slots); "
        f"trainer {trainer_s:.3f} s on {trainer_devices} device(s); reward {costs.reward_s:.3f} s; "
        f"weight sync {costs.weight_sync_s:.3f} s",
    ]
    return RunProfile(replace(costs, decode_s_per_token=decode, request_overhead_s=overhead_s), lengths,
                      len(records), notes)
