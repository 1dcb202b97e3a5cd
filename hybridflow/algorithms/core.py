"""Masked statistics and registry helpers shared by every algorithm module.

Everything here is a pure function of its tensor arguments. Masks are float or bool tensors
broadcastable to the values; a mask entry of 0 means "this position does not exist" (padding,
tool output), so a value there must never leak into a result, not even as ``nan * 0``.

Shapes in trailing comments: B batch, R response tokens.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any, TypeVar

import torch

# verl's whitening constant: var + 1e-8 under the rsqrt, so an all-equal batch whitens to 0
# instead of dividing by zero.
WHITEN_EPS = 1e-8

F = TypeVar("F", bound=Callable[..., Any])


# --------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------


def _safe_count(count: torch.Tensor) -> torch.Tensor:
    """``count`` with zeros replaced by ones: the numerator is 0 there too, so x / 1 = 0."""
    return torch.where(count > 0, count, torch.ones_like(count))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask over ``dim`` (all elements when None).

    Positions with mask 0 are zeroed with ``where`` before the product, so a non-finite value
    there (a ``-inf`` logprob on padding) cannot turn the sum into nan.
    """
    mask = mask.to(x.dtype) if mask.dtype == torch.bool else mask
    x = torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    product = x * mask
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·mask / Σ mask over ``dim``; 0 where the mask sums to 0 (never nan)."""
    mask = mask.to(x.dtype) if mask.dtype == torch.bool else mask
    count = mask.expand_as(x).sum() if dim is None else mask.expand_as(x).sum(dim=dim)
    return masked_sum(x, mask, dim) / _safe_count(count)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked-in entries of ``x`` (a scalar), Bessel-corrected when ``unbiased``.

    verl raises when fewer than two entries are masked in; here the variance of zero or one
    sample is 0, so a degenerate batch (every response empty) whitens to zeros instead of
    crashing the step. With two or more entries the result is exactly verl's.
    """
    mask = mask.to(x.dtype) if mask.dtype == torch.bool else mask
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.expand_as(x).sum()
        bessel = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
        var = var * bessel
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean)·rsqrt(var + 1e-8) with masked statistics (Bessel-corrected variance).

    Values at masked-out positions are transformed too (callers multiply by the mask); with
    ``shift_mean=False`` the mean is added back, so only the scale changes.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# --------------------------------------------------------------------------------------------
# Names and registries
# --------------------------------------------------------------------------------------------


class UnknownNameError(ValueError, KeyError):
    """A name that is not in a registry. Both a ValueError (bad config value) and a KeyError
    (failed lookup), so callers can catch whichever reads naturally at their site."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def suggest(name: str, options: Iterable[str]) -> str:
    """The option closest to ``name``, or ``""`` when nothing is close.

    Case and ``-``/``_`` differences are forgiven first (``Token_Mean`` → ``token-mean``),
    then ``difflib`` similarity (cutoff 0.6) catches typos (``gpro`` → ``grpo``).
    """
    options = list(options)
    by_normal = {_normalise(o): o for o in options}
    key = _normalise(name)
    if key in by_normal:
        return by_normal[key]
    close = difflib.get_close_matches(key, list(by_normal), n=1, cutoff=0.6)
    return by_normal[close[0]] if close else ""


def unknown_name_message(what: str, name: str, options: Iterable[str]) -> str:
    """``unknown <what> 'name'; expected one of: a, b, c. Did you mean 'b'?``"""
    options = sorted(options)
    message = f"unknown {what} {name!r}; expected one of: {', '.join(options)}"
    closest = suggest(name, options)
    if closest:
        message += f". Did you mean {closest!r}?"
    return message


def register_into(registry: MutableMapping[str, F], name: str, what: str) -> Callable[[F], F]:
    """Decorator that adds a function to ``registry`` under ``name``.

    A second registration of the same name is an error: silently replacing a built-in
    estimator would change training results without a trace.
    """
    if not name or ":" in name:
        raise ValueError(f"{what} name must be non-empty and contain no ':' (got {name!r})")

    def decorator(fn: F) -> F:
        if name in registry and registry[name] is not fn:
            raise ValueError(
                f"{what} {name!r} is already registered to "
                f"{registry[name].__module__}.{registry[name].__qualname__}"
            )
        registry[name] = fn
        return fn

    return decorator


def resolve(registry: MutableMapping[str, F], name: str, what: str) -> F:
    """Look ``name`` up in ``registry``, or import it when it is a ``module:function`` path.

    The ``module:function`` escape hatch lets a user plug in their own function (with the
    registry's documented signature) from config without editing this package. Importing it
    runs that module's code, so treat such a config value like code.
    """
    if name in registry:
        return registry[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr:
            raise UnknownNameError(f"{what} path {name!r} must look like 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownNameError(f"{what} {name!r}: cannot import module {module_name!r}: {exc}") from exc
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise UnknownNameError(f"{what} {name!r}: module {module_name!r} has no callable {attr!r}")
        return fn  # type: ignore[no-any-return]
    raise UnknownNameError(unknown_name_message(what, name, registry))


def check_typed_call(fn: Callable[..., Any], what: str, name: str, signature_doc: str) -> None:
    """Raise ``UnknownNameError`` unless ``fn`` can be called as ``fn(inputs, params)``.

    A ``module:function`` path is checked at start-up, not at the first call minutes into the
    run: ``os:system`` is callable, yet no advantage estimator. A callable without an
    introspectable signature (a C builtin) is refused too, since nothing about it can be checked.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise UnknownNameError(
            f"{what} {name!r} has no inspectable signature (a builtin?); it must be a Python function "
            f"{signature_doc}"
        ) from None
    try:
        signature.bind(None, None)
    except TypeError as error:
        raise UnknownNameError(
            f"{what} {name!r}{signature} cannot be called as {signature_doc}: {error}"
        ) from None


def resolve_typed(
    registry: MutableMapping[str, F], name: str, what: str, signature_doc: str, check: Callable[[F], object]
) -> F:
    """``resolve``, with a user's ``module:function`` checked now, not at step 1: callable as
    ``fn(inputs, params)`` (``check_typed_call``) and then by ``check`` (what it declares).

    Raises ``UnknownNameError`` (a ValueError and a KeyError) listing the registered names and
    the closest one.
    """
    fn = resolve(registry, name, what)
    if name not in registry:
        check_typed_call(fn, what, name, signature_doc)
        check(fn)
    return fn


P = TypeVar("P")


def build_params(
    params_type: type[P], shared: Mapping[str, Any], specific: Mapping[str, Any], what: str
) -> P:
    """A frozen params record of ``params_type`` filled from plain settings.

    ``shared`` settings (``gamma``, ``clip_ratio_low``, ...) apply to many algorithms: each one
    takes the fields it has and ignores the rest. ``specific`` settings belong to one algorithm
    (``tau_pos`` to sapo); one that ``params_type`` has no field for is a mistake in the
    caller's config, so it raises a ValueError naming the key and ``what`` (the algorithm).
    Lists become tuples, so the record stays immutable.
    """
    if not dataclasses.is_dataclass(params_type):
        raise TypeError(f"{what}: params type {params_type!r} must be a dataclass")
    fields = {f.name for f in dataclasses.fields(params_type)}
    stray = sorted(set(specific) - fields)
    if stray:
        raise ValueError(
            f"{', '.join(stray)} do{'es' if len(stray) == 1 else ''} not apply to {what} "
            f"(its parameters: {', '.join(sorted(fields)) or 'none'})"
        )
    values = {**{k: v for k, v in shared.items() if k in fields}, **specific}
    return params_type(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise a ValueError naming every argument when the given tensors differ in shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}")
