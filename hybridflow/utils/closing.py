"""``with obj:`` for the objects that own something until ``close()``: workers, files, a bar."""

from __future__ import annotations

from typing import Any, Self


class ClosesOnExit:
    """A mixin for a class with an idempotent ``close()``: ``with`` returns the object and closes it
    on the way out, whether the block returned or raised (the exception then propagates)."""

    def close(self) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
