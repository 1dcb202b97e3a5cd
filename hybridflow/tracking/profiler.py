"""torch.profiler traces of chosen training steps (``trainer.profile.steps``), and their summary.

One profiler per process: a step's trace is recorded by the controller's process (which runs the
loop and every in-process role) and, on Ray, by each rank's process, each written as a Chrome
trace (``<run>/profile/step_<k>/<process>.pt.trace.json``) that ``chrome://tracing``, Perfetto,
TensorBoard's profiler plugin and HTA open. The phases of a step (``PhaseTimer``) and each call
into a Ray rank carry ``record_function`` ranges (``phase/<name>``, ``<role>/<method>``), so a trace
shows which phase an operator ran in; on a GPU the same ranges are NVTX ranges for ``nsys``.

``summarize_profile`` reads the traces back: the operators with the most self time (time in the
operator itself, not in the operators it called) and the seconds of each phase.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TRACE_SUFFIX = ".pt.trace.json"
PROFILE_DIR = "profile"
PHASE_PREFIX = "phase/"

_active: Any = None  # this process's running torch.profiler.profile
_active_path: Path | None = None


@dataclass(frozen=True)
class ProfileSettings:
    record_shapes: bool = False
    with_stack: bool = False
    profile_memory: bool = False


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / PROFILE_DIR / f"step_{step}"


def start_profile(path: Path, settings: ProfileSettings) -> bool:
    """Start recording this process into ``path`` (written by ``stop_profile``); False, doing
    nothing, when a recording already runs here (in-process roles share the controller's)."""
    global _active, _active_path
    if _active is not None:
        return False
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _active = profile(activities=activities, record_shapes=settings.record_shapes, with_stack=settings.with_stack,
                      profile_memory=settings.profile_memory)
    _active.__enter__()
    _active_path = path
    return True


def stop_profile() -> Path | None:
    """Stop this process's recording and write its trace; the trace's path (None if none ran)."""
    global _active, _active_path
    if _active is None:
        return None
    profiler, path = _active, _active_path
    _active = _active_path = None
    profiler.__exit__(None, None, None)
    assert path is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    return path


def start_rank_profile(worker: Any, out_dir: str, role: str, settings: ProfileSettings) -> bool:
    """``start_profile`` in a worker's process (called on every rank of a Ray worker group)."""
    name = f"{role.replace(' ', '_')}_rank{getattr(worker, 'rank', 0)}"
    return start_profile(Path(out_dir) / f"{name}{TRACE_SUFFIX}", settings)


def stop_rank_profile(worker: Any) -> str | None:
    path = stop_profile()
    return None if path is None else str(path)


# ---------------------------------------------------------------------- reading traces back
@dataclass
class ProfileSummary:
    traces: list[Path]
    top_ops: list[tuple[str, float, int]]  # (operator, self seconds, calls), most self time first
    phases: dict[str, float]  # phase -> seconds, over every trace


def summarize_profile(run_dir: str | Path, top: int = 15) -> ProfileSummary:
    """The top operators by self time and the per-phase seconds of every trace under
    ``<run_dir>/profile`` (or ``run_dir`` itself when it is a step folder)."""
    root = Path(run_dir)
    traces = sorted(root.rglob(f"*{TRACE_SUFFIX}"))
    if not traces:
        raise FileNotFoundError(f"no {TRACE_SUFFIX} files under {root} (set trainer.profile.steps to record some)")
    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    phases: dict[str, float] = defaultdict(float)
    for path in traces:
        for name, dur, own in _operator_self_times(_events(path)):
            if name.startswith(PHASE_PREFIX):
                phases[name[len(PHASE_PREFIX):]] += dur / 1e6
            else:
                self_us[name] += own
                calls[name] += 1
    ranked = sorted(self_us, key=lambda n: -self_us[n])[:top]
    return ProfileSummary(traces, [(n, self_us[n] / 1e6, calls[n]) for n in ranked], dict(phases))


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable Chrome trace ({error})") from error
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list (not a torch.profiler Chrome trace)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def _operator_self_times(events: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(name, duration µs, self µs) of each CPU operator and user range: its duration less its
    direct children's on the same thread (the trace's spans nest per thread)."""
    out = []
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "gpu_user_annotation"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for spans in by_thread.values():
        spans.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list[Any]] = []  # [end, name, dur, children's µs]
        for e in spans:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                end, name, d, children = stack.pop()
                out.append((name, d, d - children))
            if stack:
                stack[-1][3] += dur
            stack.append([start + dur, str(e.get("name")), dur, 0.0])
        out.extend((name, d, d - children) for _, name, d, children in stack)
    return out


def format_profile_summary(summary: ProfileSummary) -> str:
    lines = [f"{len(summary.traces)} trace(s): " + ", ".join(str(p) for p in summary.traces[:6])
             + (" ..." if len(summary.traces) > 6 else ""), "", "phases (s, all traces; share of the step):"]
    step = summary.phases.get("step")
    for phase, seconds in sorted(summary.phases.items(), key=lambda kv: -kv[1]):
        share = f"{seconds / step:6.1%}" if step and phase != "step" else ""
        lines.append(f"  {phase:<24} {seconds:9.3f}  {share}")
    lines += ["", f"{'operator':<48} {'self s':>9} {'calls':>7}"]
    for name, seconds, n in summary.top_ops:
        lines.append(f"{name[:48]:<48} {seconds:9.3f} {n:7d}")
    return "\n".join(lines)
