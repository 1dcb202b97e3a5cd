"""Metrics (names and pure computations), loggers, progress bar, plots and the run summary."""

from hybridflow.tracking.loggers import (
    BACKEND_NAMES,
    ConsoleBackend,
    JsonlBackend,
    MetricsRecord,
    ProgressBar,
    TensorBoardBackend,
    Tracker,
    WandbBackend,
    format_console_line,
    read_metrics_jsonl,
)
from hybridflow.tracking.metrics import (
    compute_batch_metrics,
    compute_critic_metrics,
    compute_throughput_metrics,
    compute_validation_metrics,
    pass_at_k,
    reduce_metrics,
)
from hybridflow.tracking.plot import plot_run, summarize_run
from hybridflow.tracking.validation import compute_val_core_metrics, reward_variables

__all__ = [
    "BACKEND_NAMES",
    "ConsoleBackend",
    "JsonlBackend",
    "MetricsRecord",
    "ProgressBar",
    "TensorBoardBackend",
    "Tracker",
    "WandbBackend",
    "compute_batch_metrics",
    "compute_critic_metrics",
    "compute_throughput_metrics",
    "compute_val_core_metrics",
    "compute_validation_metrics",
    "format_console_line",
    "pass_at_k",
    "plot_run",
    "read_metrics_jsonl",
    "reduce_metrics",
    "reward_variables",
    "summarize_run",
]
