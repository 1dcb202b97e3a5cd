"""Starting a server: ``hybridflow serve`` (``serve``: the model directory and the port checked
before the weights load, the chat template rendered once) and ``ServerThread``, an app served in a
thread of its own (how a rollout replica serves its engine, ``rollout.mode=server``)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import torch

from hybridflow.inference.native import NativeEngine, resolve_dtype
from hybridflow.models.loading import eos_token_ids, load_causal_lm
from hybridflow.serving.guards import host_check_for, is_loopback
from hybridflow.serving.llm import serving_engine
from hybridflow.serving.schema import ServerLimits
from hybridflow.serving.server import create_app
from hybridflow.serving.web import FastAPI

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 256  # vLLM's max_num_seqs default
# Conversations rendered with the chat template at start-up, in order until one renders: some
# templates insist on a system turn first, which is strict, not broken.
TEMPLATE_PROBES = (
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"}],
)


class ServeError(Exception):
    """A reason ``hybridflow serve`` cannot start, as one line: what failed, where, and the fix."""


def chat_template_source(model_dir: Path) -> str:
    """Where transformers read the default chat template of ``model_dir`` from: the file to fix."""
    jinja = model_dir / "chat_template.jinja"  # takes priority over tokenizer_config.json's entry
    return str(jinja) if jinja.is_file() else f"{model_dir / 'tokenizer_config.json'}'s chat_template"


def check_chat_template(tokenizer: Any, source: str) -> None:
    """Render the tokenizer's chat template on small conversations (``TEMPLATE_PROBES``) as a chat
    request would be; ``ServeError`` naming ``source`` when it renders none. No template: chat
    requests get a 400 saying so, and completions work, so there is nothing to check."""
    if getattr(tokenizer, "chat_template", None) is None:
        logger.info("the model has no chat template: /v1/chat/completions answers 400, /v1/completions works")
        return
    first: Exception | None = None
    for conversation in TEMPLATE_PROBES:
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            tokenizer.encode(text, add_special_tokens=False)
            return
        except Exception as exc:  # jinja's syntax and runtime errors, raise_exception, anything a template does
            first = first or exc
    assert first is not None
    line = getattr(first, "lineno", None)  # jinja's TemplateSyntaxError knows the template line
    where = f" at line {line}" if line else ""
    raise ServeError(
        f"the chat template in {source} cannot render a one-message conversation: {type(first).__name__}{where}: "
        f"{_one_line(first).rstrip('.')}; fix the template (or delete it to serve /v1/completions only)"
    ) from first


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line, short enough to read (library messages can be pages)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def check_serve_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    """``model_dir`` if it is a local HF model directory; otherwise ``ServeError``."""
    path = Path(model_dir).expanduser()
    fix = "point it at a Hugging Face model directory (config.json, *.safetensors, tokenizer files) or use builtin:tiny"
    if not path.is_dir():
        raise ServeError(f"model_dir {str(model_dir)!r} is not a local directory (hybridflow never downloads); {fix}")
    if not (path / "config.json").is_file():
        raise ServeError(f"model_dir {str(path)!r} has no config.json; {fix}")
    return path


def build_server_engine(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_model_len: int | None = None,
    seed: int = 0,
    kv_cache_memory_bytes: int | None = None,
) -> tuple[NativeEngine, Any, int]:
    """Load a local HF directory: the engine, its tokenizer, and the context length it serves.

    What a user can get wrong (the directory, its files, the engine settings) raises ``ServeError``;
    the library's own exception is logged at debug level.
    """
    from transformers import AutoTokenizer

    path = check_serve_model_dir(model_dir)
    if max_model_len is not None and max_model_len < 2:
        raise ServeError(f"--max-model-len {max_model_len} leaves no room for a prompt and a token; use 2 or more")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for bad files
        logger.debug("tokenizer load failed", exc_info=True)
        raise ServeError(
            f"cannot load the tokenizer from {path}: {_one_line(exc)}; the directory needs the model's "
            "tokenizer files (tokenizer.json or tokenizer_config.json)"
        ) from exc
    check_chat_template(tokenizer, chat_template_source(path))  # before the weights: seconds, not minutes
    try:
        model = load_causal_lm(path, dtype=resolve_dtype(dtype), device=device)
        eos = eos_token_ids(path, tokenizer)
    except Exception as exc:
        logger.debug("model load failed", exc_info=True)
        raise ServeError(
            f"cannot load the model from {path}: {_one_line(exc)}; the directory needs config.json and "
            "*.safetensors weights of a causal LM the native engine supports (hybridflow/inference/families.py)"
        ) from exc
    max_model_len = max_model_len or int(model.config.max_position_embeddings)
    try:
        engine = serving_engine(model, tokenizer, eos, max_batch_size=max_batch_size, device=device, dtype=dtype,
                                seed=seed, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes)
    except (ValueError, NotImplementedError) as exc:  # unsupported architecture, bad sizes
        logger.debug("engine start failed", exc_info=True)
        raise ServeError(
            f"cannot serve the model in {path}: {_one_line(exc)}; check --max-batch-size, --max-model-len "
            "and --dtype"
        ) from exc
    return engine, tokenizer, max_model_len


def warn_if_exposed(host: str) -> bool:
    """Log a loud warning when ``host`` is not a loopback address; True if it is exposed."""
    if is_loopback(host):
        return False
    logger.warning(
        "!!! hybridflow serve is listening on %s: anyone who can reach this address can use the model. "
        "The server has no authentication; bind 127.0.0.1 and use an SSH tunnel or a proxy instead. !!!",
        host,
    )
    return True


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one), or ``ServeError`` saying why not.

    Bound before the model loads, so a taken port fails in a second rather than after the load.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, OverflowError, UnicodeError) as exc:
        raise ServeError(f"cannot listen on --host {host!r} --port {port}: {_one_line(exc)}; use an address "
                         "of this machine (127.0.0.1 by default) and a port in 0-65535") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what uvicorn does: restarts do not wait
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {exc.strerror or _one_line(exc)}; pick another --port or stop "
            "the process that uses it"
        ) from exc
    return sock


def serve(
    model_dir: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info",
    limits: ServerLimits | None = None,
    allowed_hosts: Collection[str] = (),
    **engine_kwargs: Any,
) -> None:
    """Load the model and serve it with uvicorn until interrupted (``hybridflow serve``).

    Raises ``ServeError`` (one line) for what the user can fix: the directory, the port, settings.
    """
    import uvicorn

    check_serve_model_dir(model_dir)
    sock = bind_socket(host, port)
    try:
        engine, tokenizer, max_model_len = build_server_engine(model_dir, **engine_kwargs)
        app = create_app(
            engine,
            tokenizer,
            model_name=served_model_name or str(model_dir),
            max_model_len=max_model_len,
            limits=limits,
            host_check=host_check_for(host, allowed_hosts),
        )
        warn_if_exposed(host)  # last thing before the "serving on" line, where it is seen
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        logger.info("hybridflow serve: %s on http://%s:%d/v1", served_model_name or model_dir, shown, bound_port)
        uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])
    finally:
        sock.close()


class ServerThread:
    """An app served by uvicorn on ``host`` (a free port) in a daemon thread with its own event
    loop: how a rollout replica serves its engine over HTTP (``rollout.mode=server``) while its
    worker goes on taking the controller's calls. The engine then runs on that thread's loop only.

    Start-up is bounded (``start_timeout_s``): a server that is not answering by then is an error
    naming ``name``, not a hang. ``close`` stops it and waits for the thread.
    """

    def __init__(self, app: FastAPI, *, name: str, host: str = "127.0.0.1", start_timeout_s: float = 30.0) -> None:
        import threading

        import uvicorn

        self.name = name
        self._sock = bind_socket(host, 0)
        bound_host, port = self._sock.getsockname()[:2]
        self.url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{port}"
        # No access log: a training step makes hundreds of requests.
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"server-{name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                why = f": {_one_line(self._error)}" if self._error is not None else f" within {start_timeout_s:g} s"
                raise ServeError(f"{name}: the HTTP server did not start{why}")
            time.sleep(0.01)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as error:  # reported by __init__ (start-up) or logged (later)
            self._error = error
            logger.exception("%s: the HTTP server stopped", self.name)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
