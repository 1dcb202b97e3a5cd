"""Name resolution shared by the agent registries (loops, parsers, interactions, tools).

Every registry is a visible dict from a config name to a ``module:attribute`` path, and a user
may give such a path instead of a name: one spelling for built-ins and extensions alike, and
importing a registry never imports what it lists.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def resolve_object(path: str, what: str, known: Mapping[str, str] | None = None) -> Any:
    """The object at ``module:attribute`` (``attribute`` may be dotted).

    Raises:
        ValueError: ``path`` is neither a known name nor a ``module:attribute`` path, the
            module cannot be imported, or it has no such attribute; the message names ``what``
            was being looked up and the known names.
    """
    names = f"; known names: {', '.join(sorted(known))}" if known else ""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"unknown {what} {path!r}: give a registered name or a 'module:Name' path{names}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {error}") from error
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attribute!r}") from None
    return target
