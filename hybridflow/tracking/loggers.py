"""Where metrics go: a ``Tracker`` fans each step's metrics out to the chosen backends.

Backends, chosen by name (the config's ``trainer.logger`` list) in one registry,
``BACKEND_BUILDERS``:

- ``jsonl``: ``<output_dir>/metrics.jsonl``, one JSON object per ``log`` call with ``"step"``
  first, flushed every step so a killed run keeps every step it finished. Non-finite values
  are written as ``null`` so every line stays valid JSON (``NaN`` is not JSON). The file is
  appended to, so a resumed run continues the same file; ``read_metrics_jsonl`` merges the
  records of a step, later values winning.
- ``console``: one summary line per step, written with ``tqdm.write`` so it lands above a
  progress bar instead of tearing it.
- ``tensorboard``: ``<output_dir>/tensorboard`` through ``torch.utils.tensorboard``.
- ``wandb``: a Weights & Biases run.
- ``mlflow``: an MLflow run (experiment ``project``, run name ``experiment``) with the config as
  params, in ``MLFLOW_TRACKING_URI`` when set, else a local store in ``<output_dir>/mlruns``.

``tensorboard``, ``wandb`` and ``mlflow`` are optional dependencies, imported only when chosen.

``Tracker.log_generations`` sends validation samples (``trainer.log_val_generations``: input,
output, score) to the backends that show text: the console prints them, ``jsonl`` appends them
to ``<output_dir>/val_generations.jsonl``, ``tensorboard`` adds a text entry
(``val/generations``), ``wandb`` a table, ``mlflow`` a JSON artifact
(``val_generations/step_<k>.json``).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch
from tqdm import tqdm

from hybridflow.tracking import metrics as m
from hybridflow.utils.closing import ClosesOnExit

logger = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"
VAL_GENERATIONS_FILENAME = "val_generations.jsonl"
VAL_GENERATIONS_TAG = "val/generations"
TENSORBOARD_DIRNAME = "tensorboard"
STEP_KEY = "step"


def _scalar(key: str, value: Any, step: int) -> float | int:
    """A metric value as a Python number; an int stays an int (token counts read better)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {key!r} at step {step} is a tensor of shape {tuple(value.shape)}; "
                "log scalars only"
            )
        value = value.item()
    if isinstance(value, numbers.Integral):  # Python, numpy and bool
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"metric {key!r} at step {step} has non-numeric value {value!r} ({type(value).__name__})"
    )


def normalize_metrics(metrics: Mapping[str, Any], step: int) -> dict[str, float | int]:
    """Metrics as plain Python numbers (tensors and numpy scalars unwrapped), order kept.

    Raises with the key and step on a non-scalar or non-numeric value, and on a ``"step"`` key,
    which the JSONL record reserves for the step number.
    """
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if key == STEP_KEY:
            raise ValueError(
                f"metric key {STEP_KEY!r} is reserved for the step number (step {step})"
            )
        out[key] = _scalar(key, value, step)
    return out


def to_json_line(metrics: Mapping[str, float | int], step: int) -> str:
    """One JSONL record: ``{"step": step, <metrics in order>}``, non-finite values as null."""
    record: dict[str, float | int | None] = {STEP_KEY: step}
    for key, value in metrics.items():
        record[key] = value if math.isfinite(value) else None
    # allow_nan=False: a non-finite value that slipped through is a bug, not a silent "NaN".
    return json.dumps(record, allow_nan=False)


@dataclass(frozen=True)
class Generation:
    """One validation sample as logged (``trainer.log_val_generations``)."""

    input: str
    output: str
    score: float


class TrackingBackend(Protocol):
    """One destination for metrics; ``metrics`` holds plain numbers (``normalize_metrics``). A backend
    that shows text also has ``log_generations(samples: Sequence[Generation], step)``."""

    def log(self, metrics: Mapping[str, float | int], step: int) -> None: ...

    def close(self) -> None: ...


def generations_markdown(samples: Sequence[Generation], step: int) -> str:
    """The samples as one markdown text (TensorBoard's text panel renders it)."""
    parts = [f"**Validation generations, step {step}**"]
    for i, sample in enumerate(samples, start=1):
        parts.append(f"### Sample {i} (score {format_value(sample.score)})\n\n**Input**\n\n"
                     f"    {_indented(sample.input)}\n\n**Output**\n\n    {_indented(sample.output)}")
    return "\n\n".join(parts)


def _indented(text: str) -> str:
    # Four spaces per line: TensorBoard renders markdown, and an indented block keeps the text verbatim.
    return text.replace("\n", "\n    ")


class JsonlBackend:
    """Appends one JSON object per step to ``path`` and flushes it at once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = _ends_without_newline(self.path)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        if needs_newline:
            # A run killed mid-write leaves a partial last line; start on a fresh line so the
            # resumed run's first record is not glued to it (the partial line is skipped on read).
            self._file.write("\n")

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path}: JSONL metrics file is closed")
        self._file.write(to_json_line(metrics, step) + "\n")
        self._file.flush()

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        """One line per sample in ``val_generations.jsonl`` beside the metrics file."""
        with (self.path.parent / VAL_GENERATIONS_FILENAME).open("a", encoding="utf-8") as out:
            for sample in samples:
                row = {"step": step, "input": sample.input, "output": sample.output, "score": sample.score}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _ends_without_newline(path: Path) -> bool:
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


# What the console line shows, in order: (label, metric key).
CONSOLE_FIELDS: tuple[tuple[str, str], ...] = (
    ("score", m.SCORE_MEAN),
    ("val", m.VAL_SCORE_MEAN),
    ("resp_len", m.RESPONSE_LENGTH_MEAN),
    ("pg_loss", m.ACTOR_PG_LOSS),
    ("kl_loss", m.ACTOR_KL_LOSS),
    ("grad_norm", m.ACTOR_GRAD_NORM),
    # hybridflow sft's step (an RL step has none of these keys, an SFT step none of the above)
    ("loss", m.SFT_TRAIN_LOSS),
    ("val_loss", m.VAL_LOSS),
    ("grad_norm", m.SFT_GRAD_NORM),
)


def format_value(value: float | int) -> str:
    """Four significant digits: enough to see a trend, short enough for one line."""
    return f"{value:.4g}"


def format_console_line(metrics: Mapping[str, float | int], step: int) -> str:
    """``step 12 | score 0.431 | val 0.52 | resp_len 38.25 | pg_loss -0.0123 | ... | 4.21 s/step``.

    Metrics absent from this step are left out (validation appears only on validation steps,
    ``kl_loss`` only when a KL loss is used).
    """
    parts = [f"step {step}"]
    for label, key in CONSOLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {format_value(metrics[key])}")
    if m.TIMING_STEP in metrics:
        parts.append(f"{metrics[m.TIMING_STEP]:.2f} s/step")
    return " | ".join(parts)


class ConsoleBackend:
    """Prints ``format_console_line`` per step via ``tqdm.write`` (safe beside a progress bar).

    ``stream`` None means ``sys.stdout`` as it is at each write, so redirection and test
    capture see the output.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        tqdm.write(format_console_line(metrics, step), file=self._stream or sys.stdout)

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        for i, sample in enumerate(samples, start=1):
            tqdm.write(f"[val step {step}, sample {i}/{len(samples)}, score {format_value(sample.score)}]\n"
                       f"[input] {sample.input}\n[output] {sample.output}", file=self._stream or sys.stdout)

    def close(self) -> None:
        pass


class TensorBoardBackend:
    """Scalars under ``log_dir`` (one tag per metric key); the run config as a text entry."""

    def __init__(self, log_dir: str | Path, config: Mapping[str, Any] | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                f"the 'tensorboard' logger needs the tensorboard package ({err}); "
                "install it with: pip install 'hybridflow[tensorboard]'"
            ) from err
        self.log_dir = Path(log_dir)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))
        if config:
            text = json.dumps(dict(config), indent=2, sort_keys=True, default=str)
            # Indented by four spaces: TensorBoard renders text as markdown, this keeps it verbatim.
            self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()))

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        # Flushed each step, like the JSONL file, so a crash loses nothing already logged.
        self._writer.flush()

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        self._writer.add_text(VAL_GENERATIONS_TAG, generations_markdown(samples, step), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    """A Weights & Biases run: ``wandb.init(project, name, config, dir)``; ``finish`` on close."""

    def __init__(
        self, *, project: str, name: str, config: Mapping[str, Any], output_dir: str | Path
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                f"the 'wandb' logger needs the wandb package ({err}); "
                "install it with: pip install 'hybridflow[wandb]'"
            ) from err
        self._run: Any = wandb.init(
            project=project, name=name, config=dict(config), dir=str(output_dir)
        )

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        import wandb

        table = wandb.Table(columns=["step", "input", "output", "score"],
                            data=[[step, s.input, s.output, s.score] for s in samples])
        self._run.log({VAL_GENERATIONS_TAG: table}, step=step)

    def close(self) -> None:
        self._run.finish()


MLFLOW_DIRNAME = "mlruns"
# MLflow's limits: a param value's length, and how many params / metrics one log_batch call takes.
MLFLOW_MAX_PARAM_CHARS = 6000
MLFLOW_MAX_PARAMS_PER_BATCH = 100
MLFLOW_MAX_METRICS_PER_BATCH = 1000
_MLFLOW_INVALID = re.compile(r"[^/\w.\- :]")


def mlflow_metric_key(key: str) -> str:
    """``key`` in the characters MLflow accepts (verl's spelling of the same mapping: ``@`` becomes
    ``_at_``, repeated slashes one, anything but letters, digits and ``_/.- :`` an underscore)."""
    return _MLFLOW_INVALID.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: one per leaf, named by its path with ``/`` (as verl names them)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            params |= flatten_params(value, f"{name}/")
        else:
            params[name] = json.dumps(value, default=str) if not isinstance(value, str) else value
    return params


class MlflowBackend:
    """An MLflow run through ``MlflowClient`` (no global active run, so nothing leaks into other code
    using MLflow's fluent API). The store is ``MLFLOW_TRACKING_URI`` when set (a server, a database),
    else MLflow's file store in ``<output_dir>/mlruns`` (``mlflow ui --backend-store-uri`` reads it;
    MLflow 3 keeps that store behind ``MLFLOW_ALLOW_FILE_STORE``, which is set for this process when
    unset). ``MLFLOW_RUN_ID`` continues that run instead of starting one, as verl does."""

    def __init__(self, *, project: str, name: str, config: Mapping[str, Any], output_dir: str | Path) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise ImportError(
                f"the 'mlflow' logger needs the mlflow package ({err}); "
                "install it with: pip install 'hybridflow[mlflow]'"
            ) from err
        self._metric, self._param = Metric, Param
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(output_dir).resolve() / MLFLOW_DIRNAME).as_uri()
        self.tracking_uri = uri
        self._client: Any = MlflowClient(tracking_uri=uri)
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if run_id:
            self.run_id = run_id
        else:
            experiment = self._client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
            self.run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, v[:MLFLOW_MAX_PARAM_CHARS]) for k, v in flatten_params(config).items()]
        for start in range(0, len(params), MLFLOW_MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[start : start + MLFLOW_MAX_PARAMS_PER_BATCH])

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(mlflow_metric_key(k), float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), MLFLOW_MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[start : start + MLFLOW_MAX_METRICS_PER_BATCH])

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        rows = [{"input": s.input, "output": s.output, "score": s.score} for s in samples]
        self._client.log_dict(self.run_id, {"step": step, "samples": rows}, f"val_generations/step_{step}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


@dataclass(frozen=True)
class RunInfo:
    """What a backend may need to know about the run."""

    output_dir: Path
    project: str
    experiment: str
    config: Mapping[str, Any] = field(default_factory=dict)


BACKEND_BUILDERS: dict[str, Callable[[RunInfo], TrackingBackend]] = {
    "console": lambda run: ConsoleBackend(),
    "jsonl": lambda run: JsonlBackend(run.output_dir / METRICS_FILENAME),
    "tensorboard": lambda run: TensorBoardBackend(
        run.output_dir / TENSORBOARD_DIRNAME, config=run.config
    ),
    "wandb": lambda run: WandbBackend(
        project=run.project, name=run.experiment, config=run.config, output_dir=run.output_dir
    ),
    "mlflow": lambda run: MlflowBackend(
        project=run.project, name=run.experiment, config=run.config, output_dir=run.output_dir
    ),
}
BACKEND_NAMES: tuple[str, ...] = tuple(BACKEND_BUILDERS)


def _check_backend_names(names: Sequence[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name not in BACKEND_BUILDERS:
            close = difflib.get_close_matches(name, BACKEND_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown tracking backend {name!r}: valid backends are "
                f"{', '.join(BACKEND_NAMES)}{hint}"
            )
        if name in seen:
            raise ValueError(f"tracking backend {name!r} is listed twice")
        seen.add(name)


class Tracker(ClosesOnExit):
    """Sends each step's metrics to every chosen backend.

    Use as a context manager (or call ``close``) so files are closed and remote runs finished
    even when training raises. Backend names are checked before any backend is created, so a
    typo fails before files are opened or a wandb run is started.
    """

    def __init__(
        self,
        backends: Sequence[str],
        *,
        output_dir: str | Path,
        project: str,
        experiment: str,
        config: Mapping[str, Any],
    ) -> None:
        if isinstance(backends, str):  # "jsonl" would otherwise iterate as j, s, o, n, l
            raise TypeError(
                f"Tracker backends must be a list of names, got the string {backends!r}"
            )
        names = list(backends)
        _check_backend_names(names)
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        run = RunInfo(self.output_dir, project, experiment, config)
        self._backends: list[tuple[str, TrackingBackend]] = []
        self._closed = False
        try:
            for name in names:
                self._backends.append((name, BACKEND_BUILDERS[name](run)))
        except BaseException:
            self.close()
            raise

    @property
    def backend_names(self) -> list[str]:
        return [name for name, _ in self._backends]

    @property
    def metrics_path(self) -> Path:
        """The JSONL metrics file (written only when the ``jsonl`` backend is chosen)."""
        return self.output_dir / METRICS_FILENAME

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics (numbers or one-element tensors) to every backend."""
        if self._closed:
            raise RuntimeError(f"Tracker.log(step={step}) after close()")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"Tracker.log: step must be an integer >= 0, got {step!r}")
        step = int(step)
        values = normalize_metrics(metrics, step)
        for name, backend in self._backends:
            try:
                backend.log(values, step)
            except Exception as err:
                raise RuntimeError(
                    f"tracking backend {name!r} failed to log step {step}: {err}"
                ) from err

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        """Validation samples (input, output, score) to every backend that shows text."""
        if self._closed:
            raise RuntimeError(f"Tracker.log_generations(step={step}) after close()")
        for name, backend in self._backends:
            log = getattr(backend, "log_generations", None)
            if log is None:
                continue
            try:
                log(samples, step)
            except Exception as err:
                raise RuntimeError(f"tracking backend {name!r} failed to log the generations of step {step}: "
                                   f"{err}") from err

    def close(self) -> None:
        """Close every backend (each one, even if another fails); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        for name, backend in self._backends:
            try:
                backend.close()
            except Exception as err:  # keep closing the others; report the first failure
                logger.error("tracking backend %r failed to close: %s", name, err)
                first_error = first_error or err
        if first_error is not None:
            raise first_error



class _BarSafeHandler(logging.StreamHandler):
    """A console handler that prints through ``tqdm.write``: the bar's line is cleared, the record
    printed on a line of its own, and the bar drawn again below it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


# Loggers whose console handlers print while the bar is shown: ours (through the root logger)
# and transformers' (its own stderr handler, not propagated to the root).
LOGGER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"),
}
"""trainer.logger names that need an optional package: name -> (module to import, hybridflow extra)."""


def missing_logger_packages(names: Sequence[str]) -> list[str]:
    """One line per chosen logger whose package is not installed (checked at start-up, with the
    config, rather than when the first metric is written)."""
    import importlib.util

    return [f"trainer.logger={name} needs the {module} package: pip install 'hybridflow[{extra}]'"
            for name in names if name in LOGGER_PACKAGES
            for module, extra in [LOGGER_PACKAGES[name]] if importlib.util.find_spec(module) is None]


_CONSOLE_LOGGERS = ("", "transformers")


def _is_console_handler(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


def _bar_safe(handler: logging.StreamHandler) -> _BarSafeHandler:
    safe = _BarSafeHandler(handler.stream)
    safe.setLevel(handler.level)
    safe.setFormatter(handler.formatter)
    for log_filter in handler.filters:
        safe.addFilter(log_filter)
    return safe


def _route_console_logs_through_tqdm() -> list[tuple[logging.Logger, list[logging.Handler]]]:
    """Swap each console handler of ``_CONSOLE_LOGGERS`` for one that writes through ``tqdm.write``
    (without it a record is printed onto the end of the bar's line); returns what to put back."""
    saved = []
    for name in _CONSOLE_LOGGERS:
        logger_ = logging.getLogger(name)
        if any(_is_console_handler(h) for h in logger_.handlers):
            saved.append((logger_, list(logger_.handlers)))
            logger_.handlers = [_bar_safe(h) if _is_console_handler(h) else h for h in logger_.handlers]
    return saved


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressBar(ClosesOnExit):
    """A tqdm bar over training steps; ``update(step, summary)`` moves it and shows the summary.

    ``enabled=False`` makes every method a no-op, so the loop calls it unconditionally.
    ``initial_step`` starts the bar where a resumed run picks up. While the bar is shown, console
    log records are printed through ``tqdm.write``, each on a line of its own above the bar.
    """

    def __init__(
        self,
        total_steps: int,
        enabled: bool,
        *,
        initial_step: int = 0,
        file: TextIO | None = None,
    ) -> None:
        if total_steps < 0:
            raise ValueError(f"ProgressBar: total_steps must be >= 0, got {total_steps}")
        self._bar: tqdm | None = None
        self._saved_handlers: list[tuple[logging.Logger, list[logging.Handler]]] = []
        if enabled:
            self._bar = tqdm(
                total=total_steps,
                initial=initial_step,
                unit="step",
                desc="training",
                dynamic_ncols=True,
                file=file,
            )
            self._saved_handlers = _route_console_logs_through_tqdm()

    @classmethod
    def for_console(cls, total_steps: int, enabled: bool, *, initial_step: int = 0) -> ProgressBar:
        """The run's bar on stderr, drawn only where stderr is a terminal: a redirected log
        (``> train.log``, a cluster job's output file) would fill with the bar's carriage-return
        redraws, and it has the console logger's per-step lines anyway."""
        return cls(total_steps, enabled and _is_terminal(sys.stderr), initial_step=initial_step)

    @property
    def step(self) -> int | None:
        """The step the bar shows (None when disabled)."""
        return None if self._bar is None else int(self._bar.n)

    def update(self, step: int, summary: Mapping[str, float | int]) -> None:
        """Move the bar to ``step`` (an absolute step, not an increment) and show ``summary``."""
        if self._bar is None:
            return
        self._bar.set_postfix({k: format_value(v) for k, v in summary.items()}, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for logger_, handlers in reversed(self._saved_handlers):
            logger_.handlers = handlers
        self._saved_handlers = []



@dataclass
class MetricsRecord:
    """All metrics logged for one step (null values read back as NaN)."""

    step: int
    metrics: dict[str, float]


def read_metrics_jsonl(path: str | Path) -> list[MetricsRecord]:
    """Read a ``metrics.jsonl`` into one record per step, sorted by step.

    Lines with the same step are merged, later values winning: a step may be logged in parts
    (training, then validation), and a resumed run re-logs the steps it repeats. A line that
    is not a JSON object with an integer ``"step"`` (typically the partial last line of a
    killed run) is skipped with a warning naming the file and line; a missing file raises.
    """
    path = Path(path)
    merged: dict[int, dict[str, float]] = {}
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                logger.warning(
                    "%s:%d: skipping unreadable metrics line (%s)", path, line_number, err
                )
                continue
            step = record.get(STEP_KEY) if isinstance(record, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                logger.warning(
                    "%s:%d: skipping metrics line without an integer %r",
                    path,
                    line_number,
                    STEP_KEY,
                )
                continue
            values = merged.setdefault(step, {})
            for key, value in record.items():
                if key == STEP_KEY:
                    continue
                if value is None:
                    values[key] = math.nan
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    values[key] = float(value)
                else:
                    logger.warning(
                        "%s:%d: skipping non-numeric metric %r=%r", path, line_number, key, value
                    )
    return [MetricsRecord(step, merged[step]) for step in sorted(merged)]
