"""``trainer.profile.steps``: each chosen step recorded by torch.profiler in every process that
works on it (``hybridflow.tracking.profiler``): the controller's, which holds the loop and every
in-process role, and on Ray each rank's. Traces go to ``<run>/profile/step_<k>/``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from hybridflow.cluster.ray_group import RayWorkerGroup
from hybridflow.controller.setup import RunSetup
from hybridflow.tracking.profiler import (
    TRACE_SUFFIX,
    ProfileSettings,
    start_profile,
    start_rank_profile,
    step_dir,
    stop_profile,
    stop_rank_profile,
)

log = logging.getLogger(__name__)


@contextmanager
def profiled_step(run: RunSetup, step: int) -> Iterator[None]:
    """Record ``step`` if ``trainer.profile.steps`` names it; otherwise nothing."""
    p = run.cfg.trainer.profile
    if step not in p.steps:
        yield
        return
    out = step_dir(run.output_dir, step)
    settings = ProfileSettings(record_shapes=p.record_shapes, with_stack=p.with_stack, profile_memory=p.profile_memory)
    # Ray ranks are processes of their own; in-process roles are recorded by the controller's profiler.
    remote = [(role, group) for role, group in run.roles.named_groups() if isinstance(group, RayWorkerGroup)]
    start_profile(out / f"controller{TRACE_SUFFIX}", settings)
    try:
        for role, group in remote:
            group.call_all(start_rank_profile, str(out), role, settings)
        yield
    finally:
        for role, group in remote:
            group.call_all(stop_rank_profile)
        stop_profile()
        log.info("step %d profiled: %s (hybridflow profile-summary %s)", step, out, run.output_dir)
