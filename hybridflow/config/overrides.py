"""Command-line overrides in Hydra's grammar, the one verl's users type.

``key=value`` sets a key, ``+key=value`` and ``++key=value`` set it too (in Hydra they add a key
the YAML lacks; here every key is checked against the schema and the verl alias table all the
same, so ``+`` is no way around a typo), ``~key`` puts a key back to its schema default, and
``group@package=option`` picks a file of a ``--config-name`` composition. Values are read by
Hydra's own override parser (hydra-core): ``null``, ``true``/``True``, numbers (``1e-5``), lists
``[a,b]``, mappings ``{lr:1e-5}``, quoted text ``'a b'``, interpolations ``${...}``.

Rules of ours on top: a text key keeps the text as written where Hydra reads a number or boolean
(``trainer.experiment_name=1.10``) or cannot read it at all (``trainer.output_dir=~/runs``, a
comma that Hydra would take for a sweep). A value outside Hydra's grammar that YAML reads
(``data.train_files=[~/a.parquet]``, ``~`` for null) is read as YAML, as hybridflow always has;
what neither reads, or a sweep of a non-text key, is an error naming the key (the loader's).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from hybridflow.config.errors import ConfigError

SET, ADD, FORCE_ADD, DELETE = "set", "add", "force_add", "delete"

_PREFIXED_KEY_RE = re.compile(r"(\+\+|\+|~)?([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")

EXPECTED = "expected the form section.key=value, e.g. actor.optim.lr=1e-5"


@dataclass(frozen=True)
class ParsedOverride:
    """One override, parsed. ``value`` is Hydra's reading (None for ``~key``); ``raw`` is the text
    after the first ``=`` as typed; ``problem`` is why Hydra's grammar could not read the value
    (then ``value`` is ``raw``; only a text key accepts it)."""

    text: str
    kind: str  # SET, ADD, FORCE_ADD or DELETE
    key: str  # dotted, as written (verl's spelling or ours)
    value: Any
    raw: str
    has_value: bool  # False for a bare ``~key``
    package: str | None = None  # ``group@package=option``: a group choice of a composition
    problem: str | None = None
    is_sweep: bool = False  # ``a,b``: Hydra's one-run-per-value sweep

    @property
    def is_group_choice(self) -> bool:
        """``group@pkg=option`` or ``group/sub=option``: chooses a file in a --config-name composition."""
        return self.package is not None or "/" in self.key


@functools.cache
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser  # ~0.3 s: only when overriding

    return OverridesParser.create()


def parse_override(text: str) -> ParsedOverride:
    """``text`` read with Hydra's grammar; ``ConfigError`` for a malformed key or missing ``=``."""
    stripped = text.strip()
    key_text, sep, raw = stripped.partition("=")
    key_text = key_text.strip()
    match = _PREFIXED_KEY_RE.fullmatch(key_text)
    is_delete = key_text.startswith("~")
    if not sep and not is_delete:
        raise ConfigError(f"malformed override {text!r}: no '='; {EXPECTED}")
    if match is None and not _looks_like_group(key_text):
        raise ConfigError(
            f"malformed override {text!r}: {key_text!r} is not a dotted key; {EXPECTED} "
            f"(Hydra's prefixes: +key=value and ++key=value set a key, ~key resets it)"
        )
    raw = raw.strip()
    try:
        parsed = _parser().parse_override(f"{key_text}={raw}" if sep else key_text)
    except Exception as error:  # noqa: BLE001 - Hydra's grammar errors, and its functions' (``int(x)``)
        if match is None:
            raise ConfigError(f"malformed override {text!r}: {_one_line(error)}") from error
        # The key is fine: the value is outside Hydra's grammar (see the module docstring).
        kind = {"+": ADD, "++": FORCE_ADD, "~": DELETE}.get(match.group(1) or "", SET)
        return ParsedOverride(text, kind, match.group(2), raw, raw, bool(sep), problem=_one_line(error))
    kind = {"CHANGE": SET, "ADD": ADD, "FORCE_ADD": FORCE_ADD, "DEL": DELETE}[parsed.type.name]
    problem = None
    if parsed.is_sweep_override():
        problem = (f"{raw!r} is a sweep in Hydra's grammar (one run per value), which hybridflow does not run; "
                   f"write a list as [a,b], or quote text that holds a comma: key='a,b'")
        value: Any = raw
    elif not raw:
        value = None  # ``key=``: null, as hybridflow has always read it (Hydra would say ''; no key wants that)
    else:
        value = _plain(parsed.value())
    return ParsedOverride(text, kind, parsed.key_or_group, value, raw, bool(sep), parsed.package, problem,
                          parsed.is_sweep_override())


def _looks_like_group(key: str) -> bool:
    """``actor@actor_rollout_ref.actor``, ``~critic``, ``hydra/launcher``: Hydra's group syntax."""
    return bool(re.fullmatch(r"(\+\+|\+|~)?[A-Za-z_][\w./-]*(@[\w.]*)?", key)) and ("@" in key or "/" in key)


def _plain(value: Any) -> Any:
    """Hydra's parsed value as plain Python (its quoted strings are a str subclass)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())
