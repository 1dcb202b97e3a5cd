"""Running coroutines from synchronous code: every engine's ``generate_batch`` and the HTTP
client's blocking calls.

The engines (the native runtime in ``inference/``, the adapters in ``rollout/``) and the HTTP
client (``serving/``) all share these, so they live below all three; ``all_or_nothing`` gathers
the agent loop's episodes and the rollout stream's jobs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


def serve_batch(
    generate: Callable[[_R], Awaitable[_T]],
    requests: list[_R],
    check: Callable[[_R], None] | None = None,
) -> list[_T]:
    """``generate`` for every request concurrently, from synchronous code: each engine's
    ``generate_batch``. ``check`` refuses a bad request before any runs (the error names its
    position). Runs a private event loop that is closed before returning; called from inside a
    running loop (a notebook, an async caller of sync helpers), it runs that private loop in a
    short-lived thread, since the caller's loop is blocked for the call anyway."""
    for position, request in enumerate(requests):
        try:
            if check is not None:
                check(request)
        except ValueError as exc:
            raise ValueError(f"generate_batch: requests[{position}]: {exc}") from None
    if not requests:
        return []

    async def serve() -> list[_T]:
        return list(await asyncio.gather(*(generate(r) for r in requests)))

    return run_sync(serve())


def run_sync(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(coroutine)``, or, when this thread already runs a loop, the same in a fresh
    thread joined before returning (``asyncio.run`` refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-sync") as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def all_or_nothing(coroutines: Sequence[Awaitable[_T]]) -> list[_T]:
    """Every result in order, or the first error after cancelling the rest (``gather`` would
    leave them running)."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
