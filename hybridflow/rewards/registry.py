"""The built-in rule rewards, chosen by a dataset row's ``data_source``.

``DEFAULT_SCORERS`` is the whole dispatch table: read it to see which data source gets which
scorer, add a line to support a new one. Anything else goes through a custom reward function
(``custom.py``), which may call ``default_compute_score`` for the sources it does not handle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridflow.rewards import arithmetic, calculator, code, colour_square, geo3k, gsm8k, search_r1
from hybridflow.rewards import math as math_reward

if TYPE_CHECKING:
    from hybridflow.rewards.sandbox_fusion import SandboxFusionSettings

# A scorer takes the response text and the ground truth and returns a score, or a dict holding
# "score" plus extra values for the metrics (see manager.py for how each is handled).
Scorer = Callable[..., float | dict[str, Any]]

DEFAULT_SCORERS: dict[str, Scorer] = {
    arithmetic.DATA_SOURCE: arithmetic.compute_score,
    calculator.DATA_SOURCE: calculator.compute_score,
    colour_square.DATA_SOURCE: colour_square.compute_score,
    # Runs the response's code against the row's tests in the sandbox; importing it is cheap (the
    # sandbox probes the machine on the first score, in the scoring worker, not at import).
    code.DATA_SOURCE: code.compute_score,
    geo3k.DATA_SOURCE: geo3k.compute_score,
    gsm8k.DATA_SOURCE: gsm8k.compute_score,
    **{source: math_reward.compute_score for source in math_reward.DATA_SOURCES},
    **{source: search_r1.compute_score for source in search_r1.DATA_SOURCES},
}


class UnknownDataSourceError(KeyError):
    """No built-in scorer for a data source. A ``KeyError`` whose text reads as a sentence
    (plain ``KeyError`` would print the message inside quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def scorers_for(sandbox_fusion: SandboxFusionSettings | None = None) -> dict[str, Scorer]:
    """The dispatch table of a run: ``DEFAULT_SCORERS``, plus verl's code-contest sources
    (``sandbox_fusion.DATA_SOURCES``) scored by a SandboxFusion service when one is configured."""
    if sandbox_fusion is None:
        return DEFAULT_SCORERS
    from hybridflow.rewards import sandbox_fusion as service

    return {**DEFAULT_SCORERS, **service.scorers(sandbox_fusion)}


def known_data_sources(sandbox_fusion: bool = False) -> list[str]:
    """The sources the built-in scorers score; ``sandbox_fusion``: with a SandboxFusion service's."""
    if not sandbox_fusion:
        return sorted(DEFAULT_SCORERS)
    from hybridflow.rewards.sandbox_fusion import DATA_SOURCES as SERVICE_SOURCES

    return sorted({*DEFAULT_SCORERS, *SERVICE_SOURCES})


def unknown_data_source_message(data_sources: list[str]) -> str:
    """One message for every caller that rejects data sources, so they all read the same."""
    names = ", ".join(repr(source) for source in data_sources)
    from hybridflow.rewards.sandbox_fusion import DATA_SOURCES as SERVICE_SOURCES

    service = [source for source in data_sources if source in SERVICE_SOURCES]
    hint = f" {service} are scored by a SandboxFusion service: set reward.sandbox_fusion.url." if service else ""
    return (
        f"no built-in reward for data_source {names}; known: {known_data_sources()}.{hint} "
        "Fix the dataset's data_source column, or set reward.custom_reward_function.path "
        "to a file with fn(data_source, solution_str, ground_truth, extra_info)."
    )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    sandbox_fusion: SandboxFusionSettings | None = None,
) -> float | dict[str, Any]:
    """Score one response with the built-in scorer for ``data_source``.

    Same signature as a custom reward function, so a custom function can fall back to it.
    ``sandbox_fusion``: the run's SandboxFusion service, for the sources it scores (``scorers_for``).

    Raises:
        UnknownDataSourceError: (a ``KeyError``) ``data_source`` has no built-in scorer; the
            message lists the known ones.
    """
    scorer = scorers_for(sandbox_fusion).get(data_source)
    if scorer is None:
        raise UnknownDataSourceError(unknown_data_source_message([data_source]))
    return scorer(solution_str, ground_truth)
