"""The two kinds of problem a config can have, and how several are reported together.

A ``ConfigError`` is a mistake in the config itself: wrong on every machine, fixed by editing the
command line or the file. A ``MachineProblem`` is a config that is fine but cannot run on *this*
machine (no GPU, fewer GPUs than asked, an engine package not installed): ``hybridflow config
explain`` lists it as "cannot run here" and still exits 0, so a cluster's config can be checked on
a laptop, while ``hybridflow train`` refuses both kinds.
"""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """A config that cannot be used. The message names the dotted key (and the file or override
    it came from) and says what would be valid; ``key`` holds the dotted key when there is one."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class MachineProblem(ConfigError):
    """A valid config that this machine cannot run (a missing GPU, device or package); the
    message says what is missing and how to get it."""


class ConfigErrors(ConfigError):
    """Several problems found in one pass, each kept in ``errors`` (the message lists them all)."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        listed = "\n".join(f"  - {error}" for error in errors)
        super().__init__(f"{len(errors)} config errors:\n{listed}")
        self.errors = list(errors)


def raise_all(errors: Sequence[ConfigError]) -> None:
    """Raise nothing for no errors, the error itself for one, ``ConfigErrors`` for several."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


def flatten(errors: Sequence[ConfigError]) -> list[ConfigError]:
    """Every single error, ``ConfigErrors`` opened up."""
    out: list[ConfigError] = []
    for error in errors:
        out += flatten(error.errors) if isinstance(error, ConfigErrors) else [error]
    return out
