"""A rollout engine's ``generate`` over HTTP: the client side of ``rollout.mode=server``.

In server mode (verl's name for it) every rollout replica serves its engine behind hybridflow's
HTTP server (``serving/server.py``: ``POST /generate``, token ids in; response ids, sampled-token
logprobs and finish reasons out) and the replica's requests and agent loops reach the engine
through this client instead of a method call. Outputs are the engine's, byte for byte: the
request carries the same ``SamplingParams`` (its per-request seed included) and nothing is
re-tokenised, so a run gives the same trajectories in either mode.

A server that is gone (refuses connections, drops one mid-request, answers with an error) fails
the request with an error naming the replica and the URL; connecting is bounded by
``connect_timeout_s``. Generation itself has no read timeout of its own: a long batch is normal,
and a hung replica is the controller's watchdog's to name.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any, TypeVar

from hybridflow.types import GenerationRequest, Trajectory
from hybridflow.utils.aio import run_sync

try:
    import httpx
except ImportError as exc:  # an optional extra, like the server
    raise ImportError("rollout.mode=server needs httpx: pip install 'hybridflow[serve]'") from exc


_T = TypeVar("_T")


class ReplicaHttpError(RuntimeError):
    """A request to a replica's server failed; the message names the replica and the URL."""


class HttpEngineClient:
    """``generate`` and ``generate_batch`` of the engine served at ``base_url`` (``POST /generate``).

    One ``httpx.AsyncClient`` per event loop: ``generate_batch`` and the agent runner run each
    batch on a fresh loop, and a client's connections belong to the loop that opened them.
    """

    def __init__(self, base_url: str, *, name: str, connect_timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self._timeout = httpx.Timeout(None, connect=connect_timeout_s)
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def _session(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # The previous loop is closed (its batch is over); its client's sockets went with it.
            self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout,
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            self._client_loop = loop
        return self._client

    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        body = {"prompt_ids": list(request.prompt_ids), "sampling_params": dataclasses.asdict(request.params)}
        if request.request_id:
            body["request_id"] = request.request_id
        try:
            response = await self._session().post("/generate", json=body)
        except httpx.HTTPError as error:
            raise ReplicaHttpError(f"{self.name} ({self.base_url}): {type(error).__name__}: {error}") from error
        if response.status_code != 200:
            raise ReplicaHttpError(f"{self.name} ({self.base_url}) answered {response.status_code}: "
                                   f"{_error_message(response)}")
        return [_trajectory(request, sample) for sample in response.json()["samples"]]

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        async def batch() -> list[list[Trajectory]]:
            return list(await asyncio.gather(*(self.generate(r) for r in requests)))

        return self.run_sync(batch()) if requests else []

    def run_sync(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` (which calls ``generate``) on a fresh event loop from synchronous code
        (a batch, agent episodes), closing this loop's connections before returning."""

        async def run() -> _T:
            try:
                return await coroutine
            finally:
                await self._close_session()

        return run_sync(run())

    async def aclose(self) -> None:
        """Close the connections of the loop this is awaited on (a persistent loop's, at its end)."""
        await self._close_session()

    async def _close_session(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = self._client_loop = None


def _trajectory(request: GenerationRequest, sample: dict[str, Any]) -> Trajectory:
    response_ids = [int(t) for t in sample["response_ids"]]
    top = sample.get("top_logprobs")
    versions = sample.get("token_versions")  # absent from servers that predate partial rollout
    return Trajectory(
        prompt_ids=list(request.prompt_ids),
        response_ids=response_ids,
        loss_mask=[1] * len(response_ids),
        rollout_logprobs=[float(x) for x in sample["rollout_logprobs"]],
        finish_reason=str(sample["finish_reason"]),
        top_logprobs=None if top is None else [{int(k): float(v) for k, v in entry} for entry in top],
        stop_reason=sample.get("stop_reason"),
        token_versions=None if versions is None else [int(v) for v in versions],
    )


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


