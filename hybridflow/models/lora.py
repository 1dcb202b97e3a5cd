"""LoRA adapters through PEFT: wrapping a causal LM, and its weights as the base model's.

``apply_lora`` wraps a loaded model with PEFT's ``get_peft_model``: every weight is frozen and
each targeted linear layer gets trainable ``lora_A`` (r x in) and ``lora_B`` (out x r, zero at
start), so the model computes ``W x + (B A x) * alpha / r``. The training engine is given the
wrapped model's inner Hugging Face model (``PeftModel.get_base_model()``: the same modules, the
LoRA layers injected in place), so its forwards, packing, fused LM head and FSDP2 sharding see
an ordinary model; the optimizer holds what requires grad: the adapters alone.

Names in that model's state dict differ from the base model's: a wrapped layer holds
``<layer>.base_layer.weight`` and ``<layer>.lora_A.default.weight``, ``...lora_B.default.weight``.
A rollout engine knows only the base names, so a weight sync sends merged weights under them
(``LoraLayout.base_weights`` to plan, ``merge_rows`` to compute each): ``W + (B @ A) * scaling``,
the very expression PEFT's ``merge_and_unload`` adds, so one rank's merged tensors equal it bitwise.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER = "default"  # PEFT's name for the one adapter we train
BASE_LAYER = ".base_layer"
ALL_LINEAR = "all-linear"
LORA_MANIFEST = "lora.json"  # in a LoRA actor checkpoint's model/ folder


@dataclass(frozen=True)
class LoraSpec:
    """``actor.lora`` as PEFT needs it (``rank`` > 0)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    dropout: float = 0.0
    exclude_modules: str | None = None  # a regex of module names left without an adapter (PEFT's, as verl's)

    def peft_config(self):
        from peft import LoraConfig, TaskType

        targets: str | list[str] = ALL_LINEAR if list(self.target_modules) == [ALL_LINEAR] else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=self.dropout,
                          exclude_modules=self.exclude_modules, bias="none", task_type=TaskType.CAUSAL_LM)


def apply_lora(model: torch.nn.Module, spec: LoraSpec):
    """``get_peft_model(model, LoraConfig(...))``: the returned ``PeftModel`` wraps ``model``,
    whose targeted linear layers now carry adapters; only the adapters require grad. Raises a
    ValueError naming ``actor.lora.target_modules`` when no module matches."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, spec.peft_config())
    except ValueError as exc:
        raise ValueError(f"actor.lora.target_modules={list(spec.target_modules)}: {exc}") from exc
    return peft_model


def keep_adapters_in(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Cast the trainable parameters (the adapters) to ``dtype`` in place, whatever the frozen base's
    dtype. With a bf16 base (``actor.lora.base_dtype``) PEFT creates each adapter in fp32, draws
    its initial A there, then moves it to the base layer's bf16 and (its default
    ``autocast_adapter_dtype``) back to fp32: A starts rounded to bf16, B at zero. This makes the
    fp32 adapters, which Adam's ~1e-6 relative updates need, independent of PEFT's default.

    In the forward, PEFT's LoRA layer runs the base layer on its input as it comes (bf16 from the
    bf16 embeddings and norms) and casts that input to the adapter's dtype for ``B @ A @ x``, so
    without autocast the adapter's math is fp32 and its sum with the base output rounds to bf16;
    under bf16 autocast (``model.dtype=bfloat16``) both matmuls run in bf16, as with an fp32 base."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)


@dataclass(frozen=True)
class LoraLayer:
    """One wrapped linear layer, by state-dict names."""

    base: str  # the base model's name of its weight: ``<layer>.weight``
    lora_a: str  # ``<layer>.lora_A.default.weight``  (r, in)
    lora_b: str  # ``<layer>.lora_B.default.weight``  (out, r)
    scaling: float  # alpha / r (or PEFT's rank-stabilised variant)


class LoraLayout:
    """Where the adapters sit in a PEFT-wrapped model's state dict, and how its names map back to
    the base model's. Built once from the modules (``from_model``); names survive FSDP2 sharding."""

    def __init__(self, layers: Sequence[LoraLayer]) -> None:
        self.layers = {layer.base: layer for layer in layers}
        self.adapter_names = frozenset(n for layer in layers for n in (layer.lora_a, layer.lora_b))

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> LoraLayout:
        from peft.tuners.lora import LoraLayer as PeftLoraLayer

        layers = []
        for name, module in model.named_modules():
            if isinstance(module, PeftLoraLayer) and ADAPTER in module.lora_A:
                if getattr(module, "fan_in_fan_out", False):
                    raise ValueError(f"{name}: LoRA on a transposed (fan_in_fan_out) layer is not supported")
                layers.append(LoraLayer(
                    base=f"{name}.weight", lora_a=f"{name}.lora_A.{ADAPTER}.weight",
                    lora_b=f"{name}.lora_B.{ADAPTER}.weight", scaling=float(module.scaling[ADAPTER]),
                ))
        if not layers:
            raise ValueError("the model has no LoRA layers")
        return cls(layers)

    @staticmethod
    def base_name(name: str) -> str:
        """``q_proj.base_layer.weight`` -> ``q_proj.weight``; other names unchanged."""
        return name.replace(BASE_LAYER + ".", ".")

    def base_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The state dict's entries without the adapters, under the base model's names, in order
        (the tensors are the wrapped model's own: the base weights, not yet merged)."""
        return [(self.base_name(n), t) for n, t in named if n not in self.adapter_names]

    def adapters(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The adapter entries of a state dict (``lora_A``/``lora_B`` by their names)."""
        return {n: t for n, t in named if n in self.adapter_names}

    def merge_rows(self, name: str, rows: torch.Tensor, adapters: dict[str, torch.Tensor],
                   row_range: tuple[int, int] | None = None) -> torch.Tensor:
        """The base weight ``name``'s rows (all, or ``row_range`` of dim 0) with its adapter merged:
        ``W + (B @ A) * scaling`` as PEFT merges (a new tensor); a weight without an adapter is
        returned as it is. ``adapters`` holds full A and B tensors."""
        layer = self.layers.get(name)
        if layer is None:
            return rows
        a, b = adapters[layer.lora_a], adapters[layer.lora_b]
        if row_range is not None:
            b = b[row_range[0] : row_range[1]]
        delta = (b.to(rows.device) @ a.to(rows.device)) * layer.scaling
        # One rounding, in the weight's dtype, as PEFT's in-place merge (W += delta) does. A bf16
        # base (actor.lora.base_dtype) and fp32 adapters add in fp32 (type promotion) and round to
        # bf16 once: what a bf16 rollout would make of an fp32 merge; an fp32 rollout casts back.
        return (rows + delta).to(rows.dtype)

    def merged_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Full (gathered) state-dict entries as the base model's weights with every adapter merged."""
        named = list(named)
        adapters = self.adapters(named)
        return [(n, self.merge_rows(n, t, adapters)) for n, t in self.base_weights(named)]


# ``actor.lora.sync=adapter``: what a sync sends per adapted layer, under its base weight's name.
ADAPTER_A, ADAPTER_B, ADAPTER_SCALING = ".lora_A", ".lora_B", ".lora_scaling"


def adapter_payload(layout: LoraLayout, adapters: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The adapters as a weight sync sends them (``actor.lora.sync=adapter``): for each adapted
    weight ``<layer>.weight``, ``<layer>.weight.lora_A`` (r, in), ``.lora_B`` (out, r) and
    ``.lora_scaling`` (a 0-d tensor), from full A and B tensors."""
    payload = []
    for base, layer in layout.layers.items():
        payload += [(base + ADAPTER_A, adapters[layer.lora_a]), (base + ADAPTER_B, adapters[layer.lora_b]),
                    (base + ADAPTER_SCALING, torch.tensor(layer.scaling, dtype=torch.float64))]
    return payload


def is_adapter_payload(names: Iterable[str]) -> bool:
    return any(n.endswith(ADAPTER_SCALING) for n in names)


class AdapterMerger:
    """The rollout side of ``actor.lora.sync=adapter``: a copy of the base weights, taken before
    any sync wrote into the model, and the merge ``W + (B @ A) * scaling`` of a received adapter
    into weights the engine takes by their base names (the same expression as the merged sync,
    so with a base of the actor's dtype both give the same tensors). Memory: the copy of the base
    weights, one more model's worth of the adapted layers."""

    def __init__(self, model: torch.nn.Module, rank: int) -> None:
        self.base = {n: t.detach().clone() for n, t in model.state_dict().items() if t.dim() == 2}
        self.rank = rank

    def targets(self) -> dict[str, torch.Tensor]:
        """What an adapter sync may bring, by name, as meta tensors of the right shapes (a
        broadcast receiver checks each bucket's names and shapes against them before its data)."""
        out: dict[str, torch.Tensor] = {}
        for name, base in self.base.items():
            rows, cols = base.shape
            out[name + ADAPTER_A] = torch.empty((self.rank, cols), device="meta")
            out[name + ADAPTER_B] = torch.empty((rows, self.rank), device="meta")
            out[name + ADAPTER_SCALING] = torch.empty((), device="meta")
        return out

    def merged(self, payload: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        received = dict(payload)
        out = []
        for name in sorted({n.removesuffix(ADAPTER_SCALING) for n in received if n.endswith(ADAPTER_SCALING)}):
            if name not in self.base:
                raise ValueError(f"update_weights: adapter for unknown weight {name!r} (the rollout model has no "
                                 f"such 2-d weight)")
            base = self.base[name]
            a, b = received[name + ADAPTER_A].to(base.device), received[name + ADAPTER_B].to(base.device)
            delta = (b @ a) * float(received[name + ADAPTER_SCALING])
            out.append((name, (base + delta).to(base.dtype)))
        return out


def trainable_parameter_count(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters that require grad, all parameters)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def write_lora_manifest(model_dir: Path, base_model_path: str, spec: LoraSpec) -> None:
    """``model/lora.json`` of a LoRA checkpoint: the base model's directory and the adapter's
    shape, what an export needs to rebuild the policy around the saved adapter weights."""
    payload = {"base_model_path": str(Path(base_model_path).resolve()), **dataclasses.asdict(spec)}
    (model_dir / LORA_MANIFEST).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_lora_manifest(model_dir: Path) -> tuple[str, LoraSpec] | None:
    """(base model path, spec) from ``model/lora.json``; None when the folder has none (no LoRA)."""
    path = model_dir / LORA_MANIFEST
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
        spec = LoraSpec(rank=int(payload["rank"]), alpha=float(payload["alpha"]),
                        target_modules=tuple(payload["target_modules"]), dropout=float(payload["dropout"]),
                        exclude_modules=payload.get("exclude_modules"))  # absent in older checkpoints
        return str(payload["base_model_path"]), spec
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a LoRA manifest: {exc}") from exc


def merge_adapter_into_base(base: torch.nn.Module, spec: LoraSpec, adapters: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``base`` (a freshly loaded base model) with the saved adapter weights (state-dict names of
    the wrapped model, as a checkpoint holds them) merged in by PEFT's ``merge_and_unload``: a
    plain model of the base class, its weights W + (B @ A) * scaling."""
    peft_model = apply_lora(base, spec)
    inner = peft_model.get_base_model()
    expected = {n for n, p in inner.named_parameters() if p.requires_grad}
    if set(adapters) != expected:
        missing, unexpected = sorted(expected - set(adapters)), sorted(set(adapters) - expected)
        raise ValueError(f"the adapter weights do not match actor.lora's layers: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    inner.load_state_dict(adapters, strict=False)
    return peft_model.merge_and_unload(safe_merge=False)


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's save_pretrained writes the adapter here


def load_adapter(model: torch.nn.Module, path: str | Path, spec: LoraSpec):
    """``model`` wrapped by PEFT around the saved adapter in the folder ``path``
    (``actor.lora.adapter_path``; verl's lora_adapter_path): ``PeftModel.from_pretrained`` with
    the adapter trainable, as verl loads it, instead of ``apply_lora``'s fresh adapters.

    The folder's adapter_config.json must describe ``spec`` (config loading fills actor.lora from
    it) and its weights file must hold every adapter the wrapped model has, no more: PEFT itself
    only warns about a missing adapter and starts it fresh. Any problem is a ValueError in one line
    naming ``path``."""
    from peft import PeftModel
    from safetensors import safe_open

    folder = Path(path).expanduser()
    weights = folder / ADAPTER_WEIGHTS
    try:
        with safe_open(str(weights), framework="pt") as saved:
            saved_names = set(saved.keys())
        peft_model = PeftModel.from_pretrained(model, str(folder), is_trainable=True)
    except Exception as exc:  # noqa: BLE001 - a missing file, bad JSON or a corrupt tensor file: name the folder
        raise ValueError(f"actor.lora.adapter_path={str(path)!r}: cannot load the adapter: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    config = peft_model.peft_config[ADAPTER]
    saved_targets = sorted(config.target_modules) if not isinstance(config.target_modules, str) \
        else [config.target_modules]
    if (config.r, float(config.lora_alpha), saved_targets) != (spec.rank, float(spec.alpha),
                                                                sorted(spec.target_modules)):
        raise ValueError(f"actor.lora.adapter_path={str(path)!r} holds an adapter of rank {config.r}, alpha "
                         f"{config.lora_alpha}, targets {saved_targets}, not actor.lora's rank {spec.rank}, alpha "
                         f"{spec.alpha}, targets {sorted(spec.target_modules)}")
    # PEFT saves names without the adapter's name: ``...q_proj.lora_A.weight``.
    wanted = {n.replace(f".{ADAPTER}.", ".") for n, p in peft_model.named_parameters() if p.requires_grad}
    if saved_names != wanted:
        missing, unexpected = sorted(wanted - saved_names), sorted(saved_names - wanted)
        raise ValueError(f"actor.lora.adapter_path={str(path)!r}: {ADAPTER_WEIGHTS} does not match the model's "
                         f"adapters: missing {missing[:2]}{'...' if len(missing) > 2 else ''}, unexpected "
                         f"{unexpected[:2]}{'...' if len(unexpected) > 2 else ''} (saved from another model?)")
    return peft_model
