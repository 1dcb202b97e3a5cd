"""``actor.use_torch_compile``: torch.compile on the trainer's decoder layers, with a way back.

Each decoder layer is compiled on its own (``Module.compile``), as torchtitan does under FSDP2: the
layers are the repeated work, FSDP2's hooks stay outside the compiled regions, and one compiled
graph serves every layer of the same shape. The first call compiles (on a CPU, Inductor's C++
code: about a minute for a small model); packed micro-batches change length, so Dynamo marks the
token dimension dynamic after the first recompile instead of compiling per length.

A build of torch or a model that the compiler cannot handle must not end the run: the first
compile failure (forward or backward) turns every layer back to eager with one warning naming the
key, and the engine redoes that work eagerly (``TrainEngine``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hybridflow.training.distributed import decoder_layers

log = logging.getLogger(__name__)

CONFIG_KEY = "actor.use_torch_compile"


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failing compile raises: Dynamo's errors (a backend failure in the forward is wrapped in
    one) and Inductor's own (a backward compiled lazily raises it unwrapped), where this torch has them."""
    from torch._dynamo import exc as dynamo_exc

    errors: list[type[BaseException]] = [dynamo_exc.TorchDynamoException]
    try:
        from torch._inductor import exc as inductor_exc
    except ImportError:  # a torch without Inductor: Dynamo's errors are all there is
        return tuple(errors)
    for name in ("InductorError", "CppCompileError"):
        error = getattr(inductor_exc, name, None)
        if isinstance(error, type) and issubclass(error, BaseException):
            errors.append(error)
    return tuple(errors)


class LayerCompiler:
    """The compiled decoder layers of one model, and the switch back to eager."""

    def __init__(self, model: torch.nn.Module, backend: str | Callable[..., Any] = "inductor") -> None:
        self.layers = decoder_layers(model)
        for layer in self.layers:
            layer.compile(backend=backend)
        self.active = True
        self.errors = compile_errors()

    def fall_back(self, error: BaseException) -> None:
        """Every layer eager again (``Module.compile`` keeps its compiled call in ``_compiled_call_impl``)."""
        for layer in self.layers:
            layer._compiled_call_impl = None
        self.active = False
        log.warning("%s=true: torch.compile failed on this model with this torch build (%s: %s); the trainer's "
                    "forward runs eagerly from here (set %s=false to skip the attempt)", CONFIG_KEY,
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "", CONFIG_KEY)

    def run(self, work: Callable[[], Any], undo: Callable[[], None] = lambda: None) -> Any:
        """``work()``; if compiling fails inside it, ``undo()`` what it did, go eager and run it again."""
        if not self.active:
            return work()
        try:
            return work()
        except self.errors as error:
            undo()
            self.fall_back(error)
            return work()
