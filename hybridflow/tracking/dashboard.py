"""The live run page: ``hybridflow dashboard <runs folder>`` serves one local web page of the runs
under a folder, their curves updating as ``metrics.jsonl`` grows, and their rollout dumps.

Stdlib only (``http.server``), so it runs wherever ``hybridflow`` is installed, next to a
training run, without the serve extra. The page itself is one static file, ``dashboard.html``
(package data): plain JS drawing SVG, no CDN, no build step, so it works on a machine with no
network.

What the server may read is the runs folder and nothing else: a run is named by its path
relative to the folder and is looked up in the folder's listing (never joined into a path as
given), every file it opens is resolved and checked to lie under the folder (a symlink that leads
out is refused), and anything else is a 404. The JSON API:

- ``GET /api/runs``: the runs (name, metrics size, last change, whether rollouts were dumped);
- ``GET /api/metrics?run=R&offset=N``: the complete metric records after byte ``N`` of the run's
  ``metrics.jsonl`` and the offset to ask from next, so a poll reads only what was appended
  (at most ``MAX_METRICS_BYTES`` per answer; ``more`` says when to ask again at once);
- ``GET /api/rollout_steps?run=R``: the steps of ``trainer.rollout_data_dir`` dumps;
- ``GET /api/rollouts?run=R&step_min=&step_max=&reward_min=&reward_max=&limit=``: dumped samples
  of those steps whose score lies in the range (at most ``MAX_ROLLOUT_ROWS``).
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import yaml

from hybridflow.tracking.loggers import METRICS_FILENAME, STEP_KEY

log = logging.getLogger(__name__)

PAGE_FILENAME = "dashboard.html"
MAX_METRICS_BYTES = 4 << 20
"""Most bytes of metrics.jsonl one answer reads: a 10,000-step run's file is ~30 MB, so a page
opened on it catches up in a few requests instead of one huge one; a live poll reads far less."""
MAX_ROLLOUT_ROWS = 200
"""Most samples one rollout answer holds: a dump row can be ~20 KB (4 x dump_max_chars)."""
RUN_SEARCH_DEPTH = 3
"""How deep under the folder runs are looked for (runs/<run>, runs/<project>/<run>, ...): deep
enough for grouped runs, shallow enough that listing a big folder stays a few hundred stats."""
RUN_MARKERS = (METRICS_FILENAME, "config.yaml")
"""A folder holding either is a run (config.yaml alone: a run still setting up)."""
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class NotFound(Exception):
    """A run, file or route that is not there (or not under the runs folder): a 404."""


class BadRequest(Exception):
    """A query value that does not parse: a 400."""


@dataclass(frozen=True)
class Run:
    name: str  # its path relative to the runs folder, "/"-separated; "." when the folder is a run
    path: Path  # resolved, under the runs folder


class RunsFolder:
    """The runs under one folder, read on every call (a few stats), so new runs appear live."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root_path = Path(root).expanduser()
        if not root_path.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no such runs folder", str(root_path))
        self.root = root_path.resolve()

    def _inside(self, path: Path) -> Path | None:
        """``path`` resolved when it lies under the runs folder (symlinks followed), else None."""
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError):  # a symlink loop
            return None
        return resolved if resolved == self.root or resolved.is_relative_to(self.root) else None

    def _scan(self, folder: Path, depth: int) -> Iterator[Path]:
        if any((folder / marker).is_file() for marker in RUN_MARKERS):
            yield folder  # a run's own subfolders (checkpoints, rollouts) are not runs
            return
        if depth >= RUN_SEARCH_DEPTH:
            return
        try:
            children = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError:
            return
        for child in children:
            if child.name.startswith(".") or not child.is_dir():
                continue
            inside = self._inside(Path(child.path))
            if inside is not None and inside != self.root:
                yield from self._scan(Path(child.path), depth + 1)

    def runs(self) -> list[Run]:
        found: dict[str, Run] = {}
        for folder in self._scan(self.root, 0):
            relative = folder.relative_to(self.root).as_posix() if folder != self.root else "."
            resolved = self._inside(folder)
            if resolved is not None:
                found.setdefault(relative, Run(relative, resolved))
        return list(found.values())

    def run(self, name: str) -> Run:
        """The run of that name, looked up in the listing: a name is never used as a path."""
        for run in self.runs():
            if run.name == name:
                return run
        raise NotFound(f"no run named {name!r} under {self.root}")

    def _file(self, path: Path) -> Path | None:
        """``path`` when it is a regular file under the runs folder."""
        inside = self._inside(path)
        return inside if inside is not None and inside.is_file() else None

    def describe(self, run: Run) -> dict[str, Any]:
        metrics = self._file(run.path / METRICS_FILENAME)
        stat = metrics.stat() if metrics is not None else None
        return {
            "name": run.name,
            "metrics_bytes": stat.st_size if stat else 0,
            "modified": stat.st_mtime if stat else None,
            "has_rollouts": self.rollout_dir(run) is not None,
        }

    def listing(self) -> dict[str, Any]:
        return {"root": str(self.root), "now": time.time(), "runs": [self.describe(run) for run in self.runs()]}

    def metrics_since(self, name: str, offset: int) -> dict[str, Any]:
        """The metric records in the run's metrics.jsonl after byte ``offset``: only complete lines
        (a writer may be halfway through one), from where the last answer stopped."""
        run = self.run(name)
        path = self._file(run.path / METRICS_FILENAME)
        if path is None:
            return {"run": name, "offset": 0, "size": 0, "reset": offset > 0, "more": False, "records": []}
        with path.open("rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            reset = offset > size  # the file was replaced by a shorter one: read it from the start
            start = 0 if reset else offset
            stream.seek(start)
            chunk = stream.read(min(size - start, MAX_METRICS_BYTES))
        end = chunk.rfind(b"\n") + 1
        if end == 0 and len(chunk) == MAX_METRICS_BYTES:
            end = len(chunk)  # one line longer than a whole answer: skip it rather than stall on it
        records = [record for line in chunk[:end].splitlines() if (record := _record(line)) is not None]
        next_offset = start + end
        return {"run": name, "offset": next_offset, "size": size, "reset": reset,
                "more": next_offset < size and end > 0 and len(chunk) == MAX_METRICS_BYTES, "records": records}

    def rollout_dir(self, run: Run) -> Path | None:
        """The run's ``trainer.rollout_data_dir`` (from its config.yaml), when it lies under the
        runs folder: a dump written elsewhere is not served."""
        config = self._file(run.path / "config.yaml")
        if config is None:
            return None
        try:
            tree = yaml.safe_load(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return None
        trainer = tree.get("trainer") if isinstance(tree, dict) else None
        configured = trainer.get("rollout_data_dir") if isinstance(trainer, dict) else None
        if not isinstance(configured, str) or not configured:
            return None
        folder = Path(configured).expanduser()
        inside = self._inside(folder if folder.is_absolute() else run.path / folder)
        return inside if inside is not None and inside.is_dir() else None

    def _rollout_files(self, run: Run) -> dict[int, Path]:
        folder = self.rollout_dir(run)
        if folder is None:
            return {}
        files = {}
        for entry in folder.iterdir():
            stem, dot, ext = entry.name.partition(".")
            if ext == "jsonl" and dot and stem.isdigit() and (path := self._file(entry)) is not None:
                files[int(stem)] = path
        return files

    def rollout_steps(self, name: str) -> dict[str, Any]:
        return {"run": name, "steps": sorted(self._rollout_files(self.run(name)))}

    def rollouts(
        self, name: str, *, step_min: int | None = None, step_max: int | None = None,
        reward_min: float | None = None, reward_max: float | None = None, limit: int = MAX_ROLLOUT_ROWS,
    ) -> dict[str, Any]:
        """The dumped samples of the steps in [step_min, step_max] whose score lies in
        [reward_min, reward_max], in step then dump order, at most ``limit``: files are read in
        order until that many matched, so a wide range costs no more than the rows it shows."""
        files = self._rollout_files(self.run(name))
        limit = max(1, min(limit, MAX_ROLLOUT_ROWS))
        rows: list[dict[str, Any]] = []
        truncated = False
        for step in sorted(files):
            if (step_min is not None and step < step_min) or (step_max is not None and step > step_max):
                continue
            with files[step].open("r", encoding="utf-8", errors="replace") as stream:
                for line in stream:
                    row = _row(line)
                    if row is None or not _score_in(row.get("score"), reward_min, reward_max):
                        continue
                    if len(rows) == limit:
                        truncated = True
                        break
                    rows.append(row | {"step": step})
            if truncated:
                break
        return {"run": name, "rows": rows, "truncated": truncated}


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as None: the JSON a browser parses has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _record(line: bytes) -> dict[str, Any] | None:
    """A metrics line's numbers (and its step); None for a line that is not a JSON object."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get(STEP_KEY), int):
        return None
    return {key: _finite(float(value)) if key != STEP_KEY else value for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def _row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None  # a line cut by a killed writer
    return _finite(row) if isinstance(row, dict) else None


def _score_in(score: Any, low: float | None, high: float | None) -> bool:
    if low is None and high is None:
        return True
    if not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score):
        return False  # a range asked for: a sample without a finite score is not in it
    return (low is None or score >= low) and (high is None or score <= high)


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a Host header, without its port ("[::1]:8000" -> "::1")."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class DashboardHandler(BaseHTTPRequestHandler):
    server: DashboardServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            self._check_host()
            status, body, content_type = self._route()
        except NotFound as exc:
            status, body, content_type = HTTPStatus.NOT_FOUND, _json({"error": str(exc)}), "application/json"
        except BadRequest as exc:
            status, body, content_type = HTTPStatus.BAD_REQUEST, _json({"error": str(exc)}), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")  # live data: never a stale copy
        self.end_headers()
        self.wfile.write(body)

    def _check_host(self) -> None:
        # Bound to loopback, answer only requests addressed to loopback: a web page elsewhere
        # cannot read the runs through DNS rebinding (its requests carry its own host name).
        if self.server.loopback_only and not _is_loopback(_host_name(self.headers.get("Host", ""))):
            raise NotFound("this server answers requests to localhost only")

    def _route(self) -> tuple[HTTPStatus, bytes, str]:
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        runs = self.server.runs
        if url.path in ("/", "/index.html"):
            return HTTPStatus.OK, self.server.page, "text/html; charset=utf-8"
        if url.path == "/api/runs":
            answer = runs.listing()
        elif url.path == "/api/metrics":
            answer = runs.metrics_since(_required(query, "run"), _int(query, "offset") or 0)
        elif url.path == "/api/rollout_steps":
            answer = runs.rollout_steps(_required(query, "run"))
        elif url.path == "/api/rollouts":
            answer = runs.rollouts(
                _required(query, "run"), step_min=_int(query, "step_min"), step_max=_int(query, "step_max"),
                reward_min=_float(query, "reward_min"), reward_max=_float(query, "reward_max"),
                limit=_int(query, "limit") or MAX_ROLLOUT_ROWS,
            )
        else:
            raise NotFound(f"no page {url.path!r}")
        return HTTPStatus.OK, _json(answer), "application/json"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        log.debug("%s " + format, self.address_string(), *args)  # a poll every 2 s: not for the console


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _required(query: dict[str, str], key: str) -> str:
    if not query.get(key):
        raise BadRequest(f"missing ?{key}=")
    return query[key]


_N = TypeVar("_N", int, float)


def _parsed(query: dict[str, str], key: str, parse: Callable[[str], _N], kind: str) -> tuple[str, _N | None]:
    """The parameter's text and its value by ``parse`` (None when absent or empty); a BadRequest
    saying it is not ``kind`` when it does not parse."""
    text = query.get(key, "").strip()
    if not text:
        return text, None
    try:
        return text, parse(text)
    except ValueError:
        raise BadRequest(f"{key}={text!r} is not {kind}") from None


def _int(query: dict[str, str], key: str) -> int | None:
    _, value = _parsed(query, key, int, "an integer")
    if value is not None and value < 0:
        raise BadRequest(f"{key}={value} is negative")
    return value


def _float(query: dict[str, str], key: str) -> float | None:
    text, value = _parsed(query, key, float, "a number")
    if value is not None and not math.isfinite(value):
        raise BadRequest(f"{key}={text!r} is not finite")
    return value


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True  # a browser's open connection never holds up Ctrl-C

    def __init__(self, runs: RunsFolder, host: str, port: int) -> None:
        if ":" in host:  # an IPv6 address (--host ::1): the class default is IPv4
            self.address_family = socket.AF_INET6
        super().__init__((host, port), DashboardHandler)
        self.runs = runs
        self.page = resources.files("hybridflow.tracking").joinpath(PAGE_FILENAME).read_bytes()
        self.loopback_only = _is_loopback(host)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}/"


def make_dashboard_server(root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0) -> DashboardServer:
    """A server of the runs under ``root``, bound and not yet serving (port 0: a free one; its
    ``url`` says which)."""
    return DashboardServer(RunsFolder(root), host, port)


def serve_in_thread(server: DashboardServer) -> threading.Thread:
    """Serve in a daemon thread (tests, notebooks); ``server.shutdown()`` stops it."""
    thread = threading.Thread(target=server.serve_forever, name="hybridflow-dashboard", daemon=True)
    thread.start()
    return thread
