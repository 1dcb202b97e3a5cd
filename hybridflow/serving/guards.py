"""What runs before any endpoint: the ``Host`` check against DNS rebinding, the body's size
limit and its Unicode check (``RequestGuard``, ASGI middleware), and the watch for a client that
has gone."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

from hybridflow.serving.errors import ApiError
from hybridflow.serving.web import JSONResponse

# Names and addresses a loopback-bound server answers to, besides --allowed-hosts.
LOOPBACK_HOST_NAMES = ("localhost", "127.0.0.1", "[::1]")

# A lone surrogate reaches Python only through a JSON escape (UTF-8 bytes cannot encode one), so
# a body without such an escape needs no further look; a surrogate pair (an escaped emoji) matches
# too and is then found to be fine.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def host_name(host_header: str) -> str:
    """The name or address of a ``Host`` header, without its port: ``[::1]:8000`` -> ``::1``."""
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 literal, bracketed so its colons are not a port
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") > 1:  # an unbracketed IPv6 address (not valid HTTP, but unambiguous)
        return host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host


class HostCheck:
    """Which ``Host`` headers a server answers: loopback names and addresses, plus ``extra``.

    A web page can point a DNS name of its own at 127.0.0.1 (DNS rebinding) and then read a
    loopback-bound server's answers as same-origin; its requests still carry that name in ``Host``,
    which is what is checked. ``"*"`` in ``extra`` allows every host.
    """

    def __init__(self, extra: Collection[str] = ()) -> None:
        self.extra = frozenset(host_name(h) for h in extra)

    def allows(self, host_header: str | None) -> bool:
        if "*" in self.extra:
            return True
        if not host_header:
            return False
        name = host_name(host_header)
        return is_loopback(name) or name in self.extra


def host_check_for(bind_host: str, allowed_hosts: Collection[str] = ()) -> HostCheck | None:
    """The check a server bound to ``bind_host`` applies: loopback-bound servers answer loopback
    names (and ``allowed_hosts``); others answer every host unless ``allowed_hosts`` is given."""
    if is_loopback(bind_host) or allowed_hosts:
        return HostCheck([*allowed_hosts, bind_host])
    return None


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RequestGuard:
    """ASGI middleware run before routing: the ``Host`` check, then the body's size.

    The body is read here, up to ``max_body_bytes`` (refused with 413 past it, without reading the
    rest), and handed on whole; later ``receive`` calls reach the server, so the endpoints still
    see the client's disconnect.
    """

    def __init__(self, app: Any, *, host_check: HostCheck | None, max_body_bytes: int) -> None:
        self.app, self.host_check, self.max_body_bytes = app, host_check, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.host_check is not None and not self.host_check.allows(headers.get("host")):
            await self._refuse(scope, receive, send, self._host_error(headers.get("host")))
            return
        too_large = ApiError(
            413,
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
            "(raise it with hybridflow serve --max-request-bytes)",
            code="request_too_large",
        )
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            error = too_large if declared.isdigit() else ApiError(400, f"invalid Content-Length {declared!r}")
            await self._refuse(scope, receive, send, error)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole body: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._refuse(scope, receive, send, too_large)
                return
            if not message.get("more_body", False):
                break
        if (error := _lone_surrogate_error(bytes(body))) is not None:
            await self._refuse(scope, receive, send, error)
            return
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _host_error(host: str | None) -> ApiError:
        shown = repr(host) if host else "(none)"
        return ApiError(
            421,
            f"Host header {shown} is not allowed: this server answers requests addressed to "
            f"{', '.join(LOOPBACK_HOST_NAMES)} (protection against DNS rebinding); to reach it under "
            "another name, start it with hybridflow serve --allowed-hosts NAME",
            code="host_not_allowed",
        )

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def _lone_surrogate_error(body: bytes) -> ApiError | None:
    """A 400 naming the first string (or key) of a JSON body that holds a lone surrogate; None
    when there is none, or when the body is not JSON (the endpoint then says so)."""
    if SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    # Iterative, in document order: the body's depth is the client's to choose.
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if (position := _lone_surrogate_at(node)) is not None:
                return ApiError(400, f"{path or 'the body'}: {_surrogate_reason(node, position)}", path or None)
        elif isinstance(node, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            for key in node:
                if (position := _lone_surrogate_at(key)) is not None:
                    where = f"the key {ascii(key)}" + (f" in {path}" if path else "")
                    return ApiError(400, f"{where}: {_surrogate_reason(key, position)}", path or None)
            stack.extend((item, f"{path}.{key}" if path else key) for key, item in reversed(node.items()))
    return None


def _lone_surrogate_at(text: str) -> int | None:
    """The position of the first lone surrogate in ``text``, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _surrogate_reason(text: str, position: int) -> str:
    # The surrogate is shown escaped: the character itself cannot be written as UTF-8.
    return (
        f"character {position} is a lone surrogate (\\u{ord(text[position]):04x}), which is not Unicode text; "
        "send text as UTF-8, and escape a character beyond U+FFFF as a pair (\\ud83d\\ude00)"
    )


async def client_gone(receive: Receive) -> None:
    """Return once the client has disconnected (the request's body has been read already).

    uvicorn's ``receive`` waits until the connection closes; a server that kept answering with
    empty body messages instead would make this spin, so after a few it stops listening.
    """
    for _ in range(16):
        if (await receive())["type"] == "http.disconnect":
            return
    await asyncio.Event().wait()


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable from outside
