"""SGLang as a rollout engine, in server mode (``rollout.name=sglang``).

Each replica launches one SGLang server (``python -m sglang.launch_server`` on 127.0.0.1, a free
port; ``SGLangServer``) or connects to one, and talks to its native HTTP API (``SGLangClient``):
``POST /generate`` with token ids in and out, ``/abort_request``, ``/flush_cache``,
``/release_memory_occupation`` and ``/resume_memory_occupation`` (sleep and wake), and
``/init_weights_update_group`` + ``/update_weights_from_distributed`` (weight sync over a
torch.distributed group the server joins). The client is separate from the process so that tests
point it at a fake of those endpoints. Request and reply bodies follow sglang 0.5.x
(``sglang/srt/managers/io_struct.py``, ``sglang/srt/entrypoints/http_server.py``).

``SamplingParams`` → SGLang ``sampling_params``, field by field:

- ``max_tokens`` → ``max_new_tokens``; ``temperature``, ``top_p``, ``ignore_eos``, ``stop``
  (strings), ``stop_token_ids`` → the same names; ``top_k`` → ``top_k`` (-1 means off in both).
- ``repetition_penalty`` → ``repetition_penalty``, with two differences from the native engine
  (sglang 0.5.x ``penaltylib/repetition_penalty.py``): SGLang counts only generated tokens, not
  the prompt's, and applies the penalty to the logits its logprobs come from, so with a penalty
  other than 1 ``rollout_logprobs`` are not the trainer's quantity. SGLang also caps it at 2.
- ``greedy`` → ``temperature=0`` (SGLang turns it into top-k 1; logprobs are then those of the
  unscaled distribution, as in the native engine).
- ``seed`` → ``sampling_seed``, one per sample: sample ``i`` gets ``derive_sample_seed(seed, i)``
  (the native engine's per-sample streams), folded into SGLang's signed 64-bit range. SGLang
  honours ``sampling_seed`` only on a server started with ``--enable-deterministic-inference``,
  which ``SGLangServer.launch`` passes. Unseeded requests draw a seed from the engine's
  generator, as the native engine does. The same seed gives the same tokens on the same server
  build; the tokens are not those of the native engine (different sampler).
- ``n`` → not SGLang's ``n``: the request is sent as a batch of ``n`` copies of the prompt, each
  with its own ``sampling_seed`` (SGLang copies one ``sampling_seed`` to all ``n`` samples of a
  request, so with deterministic inference they would all be the same sample).
- ``logprobs`` (top-k per token) → ``top_logprobs_num``; ``return_logprob`` is always on, and
  ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` per token, of
  ``log_softmax(logits / temperature)``: the native engine's ``rollout_logprobs`` convention)
  become ``Trajectory.rollout_logprobs``; ``meta_info.output_top_logprobs`` become
  ``top_logprobs`` (with the sampled token added, as the native engine returns it).
- ``include_stop_str_in_output`` → ``no_stop_trim``. It only changes SGLang's text; a
  ``Trajectory`` carries token ids, which run up to and including the token that completed a stop
  string in both engines.
- ``min_p``: no counterpart with seeds. SGLang's seeded sampler does not support min-p (it
  asserts in the scheduler), and every request here is seeded, so ``min_p > 0`` is refused
  before anything is sent.

Replies: ``meta_info.finish_reason.type`` ``stop`` / ``length`` / ``abort`` →
``Trajectory.finish_reason`` (same words); ``finish_reason.matched`` (the stop token id or
string) → ``stop_reason``. SGLang fields with no hybridflow counterpart (frequency/presence
penalties, min_new_tokens, grammars, logit_bias) are never sent.

Sleep: level 1 releases the tag ``kv_cache``, level 2 ``kv_cache`` and ``weights`` (the server
needs ``--enable-memory-saver``, which ``launch`` passes); ``wake_up`` resumes ``kv_cache``, and a
weight update after level 2 resumes ``weights`` before its first bucket and must cover every
parameter before the engine generates again. After every update the radix cache is flushed.

A server that dies or stops answering fails the call within a bounded time with an error naming
it (URL and pid): requests are awaited beside a liveness poll of the process, and every HTTP call
has a timeout (a non-streamed /generate can only be bounded as a whole: ``request_timeout_s``).

Weight sync: the rollout worker's engine is rank 0 of the server's update group and pushes each
checked bucket itself, so weights travel actor rank 0 → rollout worker (hybridflow's own sync) →
server. The group is gloo by default: NCCL refuses two ranks on one GPU, which is where a server
and its rollout worker sit. Gloo picks its network interface by resolving the hostname; where
that is slow, ``GLOO_SOCKET_IFNAME=lo`` makes the first sync start at once.

Lifetime: ``close`` (or this process's normal exit) kills the server's process group; a rollout
process killed with SIGKILL leaves its server running.

Partial rollout (not built here): ``Trajectory.token_versions`` is None, and the ``version`` given
to ``update_weights``/``weight_update`` is accepted and ignored. Requests wait while an update is
pushed, but one already running on the server continues on its KV cache of the old weights, and
nothing records which tokens came from which weights (SGLang's replies carry no weight version);
the native engine does both (``hybridflow.inference.native``, "partial rollout").
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

from hybridflow.inference.sampling import derive_sample_seed, is_greedy, refuse_images
from hybridflow.transfer.weights import NamedTensor, check_bucket, update_weights_in_buckets
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory
from hybridflow.utils.aio import serve_batch

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
# Loading a checkpoint and capturing CUDA graphs takes minutes on a large model; past this the
# server is taken for stuck and killed.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
# The longest one /generate call may take (n samples of max_tokens each): a server that stops
# answering fails the request after this long even if its process is still alive.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# Control calls (flush, release, resume) return in seconds; a weight bucket in seconds too.
DEFAULT_CONTROL_TIMEOUT_S = 120.0
# How often a waiting request checks that the server process is still alive: a crash is then
# reported within this long, not at the request timeout.
LIVENESS_POLL_S = 0.2
# An abort is best effort (the request is cancelled either way): not worth waiting long for.
ABORT_TIMEOUT_S = 5.0
HEALTH_POLL_S = 0.5
# After a dropped connection, how long to watch for the server's exit before blaming the network.
DEATH_GRACE_S = 1.0
# Lines of the server's log quoted in an error about it.
LOG_TAIL_LINES = 20
LEVEL_TAGS = {1: ["kv_cache"], 2: ["kv_cache", "weights"]}
# Plain HTTP to a server on this host: no certificate bundle to load (~45 ms a client, and a client
# per request) and no proxy settings from the environment to route 127.0.0.1 elsewhere.
LOCAL_HTTP: dict[str, Any] = {"verify": False, "trust_env": False}
SEED_MASK = 2**63 - 1  # sampling_seed is a signed 64-bit integer in SGLang
MAX_REPETITION_PENALTY = 2.0  # SGLang's SamplingParams.verify refuses more


class SGLangServerError(RuntimeError):
    """An SGLang server failed, refused a call or stopped answering; the message names it."""


# ----------------------------------------------------------------------------- request mapping
def sample_seeds(seed: int, n: int) -> list[int]:
    """The ``sampling_seed`` of each of a request's ``n`` samples."""
    return [derive_sample_seed(seed, index) & SEED_MASK for index in range(n)]


def to_sglang_sampling_params(params: SamplingParams, sampling_seed: int) -> dict[str, Any]:
    """One sample's SGLang ``sampling_params`` (see the module docstring for each field)."""
    if params.prompt_logprobs is not None:
        raise ValueError("SamplingParams.prompt_logprobs: the SGLang engine does not score prompts; use "
                         "rollout.name=native")
    if params.min_p > 0:
        raise ValueError(f"SamplingParams.min_p={params.min_p}: SGLang's seeded sampler has no min-p "
                         f"(rollout.name=sglang seeds every request); use min_p=0 or rollout.name=native")
    if params.repetition_penalty > MAX_REPETITION_PENALTY:
        raise ValueError(f"SamplingParams.repetition_penalty={params.repetition_penalty}: SGLang accepts at most "
                         f"{MAX_REPETITION_PENALTY}")
    body: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": 0.0 if is_greedy(params) else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "repetition_penalty": params.repetition_penalty,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": params.include_stop_str_in_output,
        "sampling_seed": sampling_seed,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def generate_body(request: GenerationRequest, seed: int, rids: Sequence[str]) -> dict[str, Any]:
    """The ``/generate`` body for a request's ``n`` samples: a batch of ``n`` prompt copies, each
    with its own seed (see ``n`` in the module docstring)."""
    params = request.params
    body: dict[str, Any] = {
        "rid": list(rids),
        "input_ids": [list(request.prompt_ids) for _ in rids],
        "sampling_params": [to_sglang_sampling_params(params, s) for s in sample_seeds(seed, params.n)],
        "return_logprob": True,
    }
    if params.logprobs is not None:
        body["top_logprobs_num"] = params.logprobs
    return body


def to_trajectory(prompt_ids: Sequence[int], output: Mapping[str, Any], top_logprobs: bool) -> Trajectory:
    """A ``Trajectory`` from one ``/generate`` output (``output_ids`` and ``meta_info``)."""
    meta = output.get("meta_info") or {}
    response_ids = [int(t) for t in output.get("output_ids") or []]
    entries = meta.get("output_token_logprobs") or []
    if [int(e[1]) for e in entries] != response_ids:
        raise ValueError(f"SGLang output {meta.get('id')!r}: output_token_logprobs do not match output_ids "
                         f"({len(entries)} logprobs for {len(response_ids)} tokens)")
    finish = meta.get("finish_reason") or {}
    kind = str(finish.get("type", "abort"))
    trajectory = Trajectory(
        prompt_ids=list(prompt_ids),
        response_ids=response_ids,
        loss_mask=[1] * len(response_ids),
        rollout_logprobs=[float(e[0]) for e in entries],
        finish_reason=kind if kind in ("stop", "length") else "abort",
        stop_reason=finish.get("matched") if kind == "stop" else None,
    )
    if top_logprobs:
        per_token = meta.get("output_top_logprobs") or [[] for _ in response_ids]
        trajectory.top_logprobs = [
            {**{int(e[1]): float(e[0]) for e in (top or [])}, int(chosen[1]): float(chosen[0])}
            for top, chosen in zip(per_token, entries, strict=True)
        ]
    return trajectory


# --------------------------------------------------------------------------------- HTTP client
class SGLangClient:
    """One server's native HTTP API. ``why_dead`` tells whether the server's process has died
    (None while it runs, or when the process is not ours to watch)."""

    def __init__(
        self,
        url: str,
        *,
        name: str | None = None,
        why_dead: Callable[[], str | None] = lambda: None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name or f"SGLang server {self.url}"
        self.why_dead = why_dead
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s

    async def generate(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The outputs of one ``/generate`` batch, in order; raises ``SGLangServerError`` when the
        server dies, errs or does not answer within ``request_timeout_s``."""
        async with httpx.AsyncClient(base_url=self.url, timeout=self.request_timeout_s, **LOCAL_HTTP) as client:
            task = asyncio.ensure_future(client.post("/generate", json=body))
            try:
                response = await self._watch(task)
            finally:
                task.cancel()
        outputs = self._payload(response, "/generate")
        return outputs if isinstance(outputs, list) else [outputs]

    async def _watch(self, task: asyncio.Future[httpx.Response]) -> httpx.Response:
        """``task``'s reply, checking every ``LIVENESS_POLL_S`` that the process still lives."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
            if done:
                try:
                    return task.result()
                except httpx.HTTPError as exc:
                    raise self._failure("/generate", exc, await self._await_death(exc)) from exc
            dead = self.why_dead()
            if dead is not None:
                raise SGLangServerError(f"{self.name}: {dead} while serving /generate")

    async def abort(self, rids: Iterable[str]) -> None:
        """Ask the server to stop generating ``rids`` (best effort: failures are logged)."""
        async with httpx.AsyncClient(base_url=self.url, timeout=ABORT_TIMEOUT_S, **LOCAL_HTTP) as client:
            for rid in rids:
                try:
                    await client.post("/abort_request", json={"rid": rid})
                except httpx.HTTPError as exc:
                    logger.warning("%s: /abort_request for %r failed: %s", self.name, rid, exc)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """A control call; its JSON reply (None for an empty one). Raises ``SGLangServerError``
        when the call fails or the reply says ``success: false``."""
        try:
            response = httpx.post(self.url + path, json=body if body is not None else {},
                                  timeout=timeout_s or self.control_timeout_s, **LOCAL_HTTP)
        except httpx.HTTPError as exc:
            raise self._failure(path, exc, self._wait_for_death(exc)) from exc
        reply = self._payload(response, path)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise SGLangServerError(f"{self.name}: {path} failed: {reply.get('message')}")
        return reply

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout_s, **LOCAL_HTTP).status_code == 200
        except httpx.HTTPError:
            return False

    def _payload(self, response: httpx.Response, path: str) -> Any:
        if response.status_code != 200:
            raise SGLangServerError(f"{self.name}: {path} answered HTTP {response.status_code}: "
                                    f"{response.text[:500]}")
        if not response.content or response.content == b"null":
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    def _failure(self, path: str, exc: Exception, dead: str | None = None) -> SGLangServerError:
        dead = dead if dead is not None else self.why_dead()
        reason = dead if dead is not None else f"{type(exc).__name__}: {exc}"
        return SGLangServerError(f"{self.name}: {path} failed: {reason}")

    def _wait_for_death(self, exc: Exception) -> str | None:
        """Why the process is dead, watched for ``DEATH_GRACE_S`` after a dropped connection: the
        process's socket closes a moment before it can be reaped. None when it lives on."""
        if not _dropped(exc):
            return None
        deadline = time.monotonic() + DEATH_GRACE_S
        while (dead := self.why_dead()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead

    async def _await_death(self, exc: Exception) -> str | None:
        """``_wait_for_death`` without blocking the event loop."""
        if not _dropped(exc):
            return None
        deadline = time.monotonic() + DEATH_GRACE_S
        while (dead := self.why_dead()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return dead


def _dropped(exc: Exception) -> bool:
    return isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)


# ------------------------------------------------------------------------------ server process
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


LAUNCHER = (sys.executable, "-m", "sglang.launch_server")


class SGLangServer:
    """A server process we started: its URL, pid and log; ``close`` kills it and its children."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.process, self.url, self.log_path = process, url, log_path

    @property
    def name(self) -> str:
        return f"SGLang server {self.url} (pid {self.process.pid})"

    @classmethod
    def launch(
        cls,
        model_path: str,
        *,
        args: Sequence[str] = (),
        launcher: Sequence[str] = LAUNCHER,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> SGLangServer:
        """Start ``launcher --model-path model_path`` on a free port with ``args`` and wait until
        ``/health`` answers 200; raises ``SGLangServerError`` (the log's tail quoted) when the
        process exits first or ``startup_timeout_s`` passes, after killing it."""
        port = free_port()
        url = f"http://{HOST}:{port}"
        log_path = Path(tempfile.mkstemp(prefix=f"sglang-{port}-", suffix=".log")[1])
        command = [*launcher, "--model-path", model_path, "--host", HOST, "--port", str(port), *args]
        logger.info("starting SGLang: %s (log %s)", " ".join(command), log_path)
        with open(log_path, "wb") as log:
            # Its own session, so close() can kill the server's scheduler and detokenizer children too.
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**os.environ, **(env or {})})
        server = cls(process, url, log_path)
        # Its own session means it outlives us unless killed: at the latest when we exit.
        atexit.register(server.close)
        try:
            server.wait_healthy(startup_timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    def wait_healthy(self, timeout_s: float) -> None:
        client = SGLangClient(self.url, name=self.name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.why_dead()
            if dead is not None:
                raise SGLangServerError(f"{self.name} {dead} before it became healthy")
            if client.healthy(timeout_s=min(5.0, timeout_s)):
                return
            time.sleep(HEALTH_POLL_S)
        raise SGLangServerError(f"{self.name} did not become healthy within {timeout_s:.0f} s; "
                                f"its log ({self.log_path}) ends:\n{self.log_tail()}")

    def why_dead(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        return f"exited with code {code}; its log ({self.log_path}) ends:\n{self.log_tail()}"

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def close(self, grace_s: float = 10.0) -> None:
        """Terminate the server's process group; kill it if it has not exited after ``grace_s``."""
        atexit.unregister(self.close)
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(grace_s)


def launch_args(*, dtype: str, seed: int, max_batch_size: int, enforce_eager: bool,
                enable_prefix_caching: bool, device: torch.device, max_num_batched_tokens: int | None = None,
                enable_chunked_prefill: bool = True, tensor_parallel_size: int = 1,
                model_override_config: Mapping[str, Any] | None = None) -> list[str]:
    """The server flags that give hybridflow's semantics (see the module docstring).

    ``model_override_config`` (``model.override_config``) goes to ``--json-model-override-args``:
    SGLang applies it to the checkpoint's config, so it serves the model the trainer built.

    ``rollout.max_num_batched_tokens`` is SGLang's prefill budget per step twice over: the chunk size
    a long prompt is split into (``--chunked-prefill-size``; -1, SGLang's "off", with
    ``rollout.enable_chunked_prefill=false``) and the tokens one prefill batch takes
    (``--max-prefill-tokens``). None leaves both at SGLang's defaults.
    """
    args = ["--dtype", dtype, "--random-seed", str(seed), "--max-running-requests", str(max_batch_size),
            "--enable-deterministic-inference", "--enable-memory-saver", "--skip-server-warmup"]
    if max_num_batched_tokens is not None:
        args += ["--max-prefill-tokens", str(max_num_batched_tokens)]
    if not enable_chunked_prefill:
        args += ["--chunked-prefill-size", "-1"]
    elif max_num_batched_tokens is not None:
        args += ["--chunked-prefill-size", str(max_num_batched_tokens)]
    if tensor_parallel_size > 1:  # rollout.tensor_model_parallel_size: SGLang splits the model over that many GPUs
        args += ["--tp-size", str(tensor_parallel_size)]
    if device.type == "cuda" and device.index is not None:
        args += ["--base-gpu-id", str(device.index)]
    if device.type == "cpu":
        args += ["--device", "cpu"]
    if model_override_config:
        args += ["--json-model-override-args", json.dumps(dict(model_override_config), sort_keys=True)]
    if enforce_eager:
        args.append("--disable-cuda-graph")
    if not enable_prefix_caching:
        args.append("--disable-radix-cache")
    return args


# -------------------------------------------------------------------------------- weight sync
def join_update_group(host: str, port: int, *, rank: int, world_size: int, group_name: str, backend: str,
                      timeout_s: float) -> Any:
    """This process's member of the group a server builds on ``/init_weights_update_group``.

    The server builds it with torch's own group helper over a ``tcp://host:port`` rendezvous and a
    store prefixed by the group's name; the sender must build its side the same way for the two
    to meet (a standalone gloo or NCCL group would use other store keys).
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=group_name, backend_options=None, timeout=timeout,
    )
    # Ranks of this group are its own: broadcast(src=0) means the sender, not global rank 0.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class WeightPusher(Protocol):
    """Moves one checked bucket of ``(name, tensor)`` pairs into the server's model."""

    def push(self, bucket: list[NamedTensor]) -> None: ...


class DistributedWeightSync:
    """Buckets pushed to the server over a torch.distributed group: this process is rank 0, the
    server's tensor-parallel ranks follow (``/init_weights_update_group``). Each bucket is one
    ``/update_weights_from_distributed`` call (names, dtypes, shapes) during which the tensors are
    broadcast in that order.

    ``backend``: gloo moves the bytes through host memory and works when the server shares this
    process's GPU; NCCL needs the server on another GPU (it refuses two ranks on one device).
    """

    def __init__(self, client: SGLangClient, *, backend: str = "gloo", device: torch.device | str = "cpu",
                 server_ranks: int = 1, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> None:
        self.client, self.backend, self.device = client, backend, torch.device(device)
        self.server_ranks, self.timeout_s = server_ranks, timeout_s
        self.group_name = ""  # set by each connection
        self._group: Any = None

    def push(self, bucket: list[NamedTensor]) -> None:
        if self._group is None:
            self._group = self._connect()
        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": False,  # once, after the whole update
        }
        tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]

        def send() -> None:
            works = [self._group.broadcast(t, 0) for t in tensors]
            for work in works:
                work.wait()

        self._beside_call("/update_weights_from_distributed", body, send)

    def _connect(self) -> Any:
        # A new name each time: torch keeps every group's name for the life of the process.
        self.group_name = f"hybridflow-weights-{uuid.uuid4().hex[:8]}"
        port = free_port()
        body = {"master_address": HOST, "master_port": port, "rank_offset": 1,
                "world_size": 1 + self.server_ranks, "group_name": self.group_name, "backend": self.backend}
        joined: list[Any] = []

        def join() -> None:
            joined.append(join_update_group(HOST, port, rank=0, world_size=1 + self.server_ranks,
                                            group_name=self.group_name, backend=self.backend,
                                            timeout_s=self.timeout_s))

        self._beside_call("/init_weights_update_group", body, join)
        return joined[0]

    def _beside_call(self, path: str, body: dict[str, Any], work: Callable[[], None]) -> None:
        """Run ``work`` (this side of a collective) while ``path`` runs on the server, which returns
        only once its side is done. If the server refuses first, ``work`` waits for peers that
        never come: the refusal is raised at once, and ``work``'s thread ends with the group's
        timeout, without being waited for. Any failure drops the group: the next push builds a
        new one."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sglang-sync")
        try:
            local = pool.submit(work)  # first: rank 0 hosts the rendezvous the server connects to
            call = pool.submit(self.client.post, path, body, self.timeout_s)
            concurrent.futures.wait([call, local], timeout=self.timeout_s,
                                    return_when=concurrent.futures.FIRST_EXCEPTION)
            if not call.done() or call.exception() is None:
                local.result(timeout=self.timeout_s)
            call.result(timeout=0 if call.done() else self.timeout_s)
        except BaseException:
            self._group = None
            raise
        finally:
            pool.shutdown(wait=False)


# ------------------------------------------------------------------------------------- engine
class SGLangEngine:
    """A ``RolloutEngine`` served by one SGLang server (see the module docstring).

    ``targets`` names every parameter and its shape (tensors on the meta device will do): each
    weight bucket is checked against it before any request about it reaches the server.
    ``weight_sync`` moves checked buckets (``DistributedWeightSync``). ``server``, when given, is
    the process this engine owns and kills on ``close``.
    """

    def __init__(
        self,
        client: SGLangClient,
        *,
        targets: Mapping[str, torch.Tensor],
        weight_sync: WeightPusher | None = None,
        seed: int = 0,
        server: SGLangServer | None = None,
    ) -> None:
        self.client, self.server, self.weight_sync = client, server, weight_sync
        self._targets = dict(targets)
        self._generator = torch.Generator().manual_seed(seed)
        self._in_flight = 0
        self._updating = False
        self._asleep = False  # the KV cache is released
        # SGLang refuses to resume a tag it did not release, so what is released is tracked exactly.
        self._weights_released = False  # by sleep(level=2): resumed before the next update's bytes
        self._weights_stale = False  # since sleep(level=2), until an update covers every parameter

    @property
    def name(self) -> str:
        return self.client.name

    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        """The ``request.params.n`` samples of one prompt; cancelling it aborts them on the server."""
        self._check_request(request)
        while self._updating:  # every request sees the old weights or the new ones, never a mix
            await asyncio.sleep(LIVENESS_POLL_S)
        seed = request.params.seed if request.params.seed is not None else self._draw_seed()
        base = request.request_id or uuid.uuid4().hex
        rids = [f"{base}-{index}-{uuid.uuid4().hex[:6]}" for index in range(request.params.n)]
        self._in_flight += 1
        try:
            outputs = await self.client.generate(generate_body(request, seed, rids))
        except (asyncio.CancelledError, SGLangServerError):
            # Cancelled or timed out here, the samples would still run there, holding its slots.
            if self.client.why_dead() is None:
                await self.client.abort(rids)
            raise
        finally:
            self._in_flight -= 1
        if len(outputs) != len(rids):
            raise SGLangServerError(f"{self.name}: /generate returned {len(outputs)} outputs for {len(rids)} samples")
        return [to_trajectory(request.prompt_ids, out, request.params.logprobs is not None) for out in outputs]

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        """``generate`` for every request concurrently, from synchronous code."""
        return serve_batch(self.generate, requests, self._check_request)

    # Pushes ``(name, tensor)`` pairs (Hugging Face names) to the server, bucket by bucket (``weight_update``).
    update_weights = update_weights_in_buckets

    @contextlib.contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[Callable[[list[NamedTensor]], None]]:
        """Yields ``apply(bucket)``: checks the bucket's names and shapes against ``targets`` (a
        mismatch raises before anything is sent) and pushes it. Requests wait until the block
        exits; then the server's cache is flushed (keys computed with old weights must not serve).
        ``version`` is ignored (no token versions here, see the module docstring)."""
        del version
        weight_sync = self.weight_sync
        if weight_sync is None:
            raise RuntimeError(f"{self.name}: this engine was built without a weight sync")
        covered: set[int] = set()

        def apply(bucket: list[NamedTensor]) -> None:
            check_bucket(bucket, self._targets)
            if self._weights_released:  # the weights' memory must exist before bytes land in it
                self.client.post("/resume_memory_occupation", {"tags": ["weights"]})
                self._weights_released = False
            weight_sync.push(bucket)
            covered.update(id(self._targets[name]) for name, _ in bucket)

        self._updating = True
        try:
            yield apply
            if self._weights_stale:
                self._check_restored(covered)
                self._weights_stale = False
            # Asleep, the cache is empty: SGLang flushed it when it released the KV cache.
            if not self._asleep:
                self.client.post("/flush_cache")
        finally:
            self._updating = False

    def sleep(self, level: int = 1) -> None:
        """Release the server's KV cache (level 1) and its weights too (level 2)."""
        if level not in LEVEL_TAGS:
            raise ValueError(f"SGLangEngine.sleep(): level must be 1 or 2, got {level!r}")
        if self._in_flight:
            raise RuntimeError(f"{self.name}: {self._in_flight} requests are still being generated; "
                               f"await them before sleeping")
        released = {"kv_cache": self._asleep, "weights": self._weights_released}
        tags = [tag for tag in LEVEL_TAGS[level] if not released[tag]]
        if tags:
            self.client.post("/release_memory_occupation", {"tags": tags})
        self._asleep = True
        if level == 2:
            self._weights_released = self._weights_stale = True

    def wake_up(self) -> None:
        """Resume the KV cache (weights released by level 2 come back with the next update)."""
        if self._asleep:
            self.client.post("/resume_memory_occupation", {"tags": ["kv_cache"]})
        self._asleep = False

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def _check_request(self, request: GenerationRequest) -> None:
        refuse_images(request, "sglang")
        label = repr(request.request_id) if request.request_id else "(no request_id)"
        if not request.prompt_ids:
            raise ValueError(f"request {label}: empty prompt_ids (at least one token is needed)")
        if self._asleep or self._weights_stale:
            state = "its weights were released (sleep level 2) and no full weight update came since" \
                if self._weights_stale else "it is asleep: call wake_up() first"
            raise RuntimeError(f"{self.name}: cannot generate request {label}: {state}")
        to_sglang_sampling_params(request.params, 0)  # refuses what SGLang cannot sample

    def _check_restored(self, covered: set[int]) -> None:
        missing = [name for name, t in self._targets.items() if id(t) not in covered]
        if missing:
            shown = ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"{self.name}: after sleep(level=2) a weight update must cover every parameter; "
                             f"{len(missing)} were not sent: {shown}")

    def _draw_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._generator))


# ------------------------------------------------------------------------------------ builder
def build_sglang_engine(
    *,
    model: torch.nn.Module,
    device: torch.device | str,
    dtype: torch.dtype | str,
    seed: int,
    max_batch_size: int,
    model_path: str | None = None,
    enforce_eager: bool = False,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    tensor_parallel_size: int = 1,
    model_override_config: Mapping[str, Any] | None = None,  # model.override_config
) -> SGLangEngine:
    """Launch a server for ``model_path`` and an engine over it (``rollout.name=sglang``). It takes
    no eos ids, pad id or tokenizer: the server reads its own from the checkpoint.

    ``model`` only lends the parameter names and shapes that weight updates are checked against;
    its memory is given back (moved to the meta device): the server holds the weights.
    """
    if model_path is None:
        raise ValueError("rollout.name=sglang: the SGLang server loads the checkpoint itself and needs its "
                         "directory (model_path)")
    device = torch.device(device)
    dtype_name = str(dtype).removeprefix("torch.")
    model.to("meta")
    targets = model.state_dict()
    server = SGLangServer.launch(model_path, launcher=LAUNCHER, args=launch_args(
        dtype=dtype_name, seed=seed, max_batch_size=max_batch_size, enforce_eager=enforce_eager,
        enable_prefix_caching=enable_prefix_caching, device=device, max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill, tensor_parallel_size=tensor_parallel_size,
        model_override_config=model_override_config))
    client = SGLangClient(server.url, name=server.name, why_dead=server.why_dead)
    sync = DistributedWeightSync(client, backend="gloo", device="cpu")
    return SGLangEngine(client, targets=targets, weight_sync=sync, seed=seed, server=server)
