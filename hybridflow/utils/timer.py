"""Phase timing for the ``timing_s/*`` metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from hybridflow.utils.watchdog import activity


class PhaseTimer:
    """Accumulates wall time per named phase; ``metrics()`` returns ``timing_s/<phase>``."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name``; it is also an open activity that the watchdog holds to its limit."""
        start = time.perf_counter()
        try:
            with activity("phase", name):
                yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def seconds(self, name: str) -> float:
        return self._seconds.get(name, 0.0)

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self._seconds.items()}
