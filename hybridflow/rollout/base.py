"""The rollout engine protocol and the rollout dtype rule.

A rollout engine is request-level: one ``GenerationRequest`` (a prompt and ``params.n``) in, its
``n`` trajectories out. Callers never see batches; engines batch concurrent requests themselves,
which is what lets agent loops, validation and training rollouts share one engine.

``factory`` (``build_rollout_engine``, ``ROLLOUT_ENGINES``) imports the engines. What the engines
share lies below them all: batch serving from synchronous code in ``hybridflow.utils.aio``, the
request checks (``refuse_images``, ``check_sampling_params``) in ``hybridflow.inference.sampling``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from hybridflow.types import GenerationRequest, Trajectory
from hybridflow.utils.device import CpuFeatures, cpu_features

if TYPE_CHECKING:
    from hybridflow.inference.precision import DtypeChoice

logger = logging.getLogger(__name__)


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout backend offers the rollout worker and the agent loops."""

    async def generate(self, request: GenerationRequest) -> list[Trajectory]:
        """The ``request.params.n`` samples of one prompt, in sample order.

        Concurrent calls are batched together. Each trajectory has ``group_id`` 0; the caller
        assigns groups.
        """
        ...

    def generate_batch(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        """Serve ``requests`` concurrently from plain synchronous code; results in request order.

        Leaves no event loop or thread behind.
        """
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Copy new parameters in, by Hugging Face parameter name (a streamed state dict).

        An unknown name or a shape mismatch raises and names the parameter. Tensors are cast to
        the engine's dtype and device. Sequences being decoded continue with the new weights.
        ``version`` is the policy version tokens generated from now on record in
        ``Trajectory.token_versions`` (default: the engine's last + 1); engines that record no
        versions (vLLM, SGLang) accept and ignore it.
        """
        ...

    def weight_update(
        self, version: int | None = None
    ) -> AbstractContextManager[Callable[[list[tuple[str, torch.Tensor]]], None]]:
        """A context in which a whole update arrives in parts: it yields ``apply(bucket)`` (checks
        and copies one list of ``(name, tensor)`` pairs); no generation step runs until it exits,
        so no step sees a mix of old and new weights. ``version`` as in ``update_weights``."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Release generation memory while the trainer needs the device: level 1 the KV cache (and
        any prefix cache), level 2 the weights as well; after level 2 the next weight update must
        cover every parameter before the engine generates again."""
        ...

    def wake_up(self) -> None:
        """Make the engine ready to generate again after ``sleep`` (weights dropped by level 2
        come back with the next full weight update, not here)."""
        ...


ROLLOUT_DTYPE_RULES = ("auto", "tune")
"""``rollout.dtype`` values that are decided here rather than named: ``auto`` by a rule of the
hardware and the model (``precision.rule_cpu_rollout_dtype``), ``tune`` by measuring."""


def choose_rollout_dtype(
    dtype: str,
    device: torch.device | str,
    *,
    model: torch.nn.Module | None = None,
    batch: int = 1,
    max_logprob_mismatch: float | None = None,
    cpu: CpuFeatures | None = None,
    num_parameters: int | None = None,
) -> DtypeChoice:
    """``rollout.dtype`` and why (with the figures, when it measured): an explicit dtype is kept;
    ``auto`` and ``tune`` are bfloat16 on a GPU (the usual rollout precision there).

    On a CPU ``auto`` follows ``precision.rule_cpu_rollout_dtype``: bfloat16 only with bf16
    hardware (avx512_bf16/AMX, ``cpu`` or this machine's) and a model of at least
    ``precision.BF16_MIN_PARAMETERS`` parameters (``num_parameters``, else counted on ``model``;
    neither: float32). ``tune`` measures instead: a probe of ``model`` at ``batch`` rows must find
    bf16 decode faster and its logprobs within ``max_logprob_mismatch`` (default: the health check's
    threshold) of fp32; see ``precision``. Without a model to probe it stays float32.
    """
    from hybridflow.inference import precision

    if dtype not in ROLLOUT_DTYPE_RULES:
        return precision.DtypeChoice(dtype, "set explicitly")
    if torch.device(device).type == "cuda":
        return precision.DtypeChoice("bfloat16", f"{dtype} on a GPU")
    cpu = cpu or cpu_features()
    if dtype == "auto":
        if num_parameters is None and model is not None:
            num_parameters = sum(p.numel() for p in model.parameters())
        choice = precision.rule_cpu_rollout_dtype(cpu, num_parameters)
    else:
        choice = _tune(cpu, model, batch, max_logprob_mismatch)
    logger.info("rollout.dtype=%s on %s: %s (%s)", dtype, cpu.describe(), choice.dtype, choice.reason)
    return choice


def _tune(cpu: CpuFeatures, model: torch.nn.Module | None, batch: int, max_logprob_mismatch: float | None) -> DtypeChoice:
    """``rollout.dtype=tune`` on a CPU: measured on ``model`` (``precision.tune_cpu_rollout_dtype``)."""
    from hybridflow.inference import precision

    threshold = precision.DEFAULT_MAX_LOGPROB_MISMATCH if max_logprob_mismatch is None else max_logprob_mismatch

    def probe() -> precision.PrecisionProbe:
        if model is None:
            raise _NoModel
        return precision.probe_decode_precision(model, batch=min(batch, precision.PROBE_MAX_BATCH))

    try:
        return precision.tune_cpu_rollout_dtype(cpu, probe, max_logprob_mismatch=threshold)
    except _NoModel:
        return precision.DtypeChoice("float32", "bf16 hardware, but no model to measure bf16 on")


class _NoModel(Exception):
    """Raised inside a probe that has no model to measure."""
