"""Vision-language models (Qwen2-VL, Qwen2.5-VL): detecting them, their image processor, M-RoPE
positions. The model itself loads with ``hybridflow.models.loading.load_causal_lm``.

Why not ``AutoProcessor``: transformers' Qwen2-VL processor always builds a video processor as
well, and that needs torchvision, which a text-RL install does not have. A prompt needs only
the tokenizer and the image processor, so they are loaded separately and the one thing the
processor adds, expanding each ``<|image_pad|>`` placeholder to one token per merged patch, is
``VisionProcessor.expand_image_tokens`` (the rule of ``Qwen2VLProcessor``: ``grid_thw.prod() //
merge_size**2`` tokens per image).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.models.loading import VL_MODEL_TYPES, check_model_dir, hf_progress_bars_off

# VL_MODEL_TYPES: the model types whose processor and forward this module knows (same token
# scheme, same get_rope_index); ``load_causal_lm`` loads them with their vision tower.
__all__ = ["VL_MODEL_TYPES", "VisionProcessor", "is_vision_language", "load_vision_processor", "mrope_position_ids"]
IMAGE_TOKEN = "<|image_pad|>"


def model_type_of(path: str | os.PathLike) -> str | None:
    """``model_type`` from the config.json of a local model directory (None when it has none)."""
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("model_type")


def is_vision_language(path: str | os.PathLike) -> bool:
    """Whether the model at ``path`` is a vision-language model this project knows."""
    return model_type_of(path) in VL_MODEL_TYPES


@dataclass(frozen=True)
class VisionProcessor:
    """What turns a prompt's images into model inputs: the image processor and the token that
    stands for one merged patch. ``hybridflow.data.dataset`` uses it through its
    ``ImageInputs`` protocol (the data layer does not import models)."""

    image_processor: Any  # transformers' Qwen2VLImageProcessor (PIL backend without torchvision)
    image_token_id: int
    merge_size: int

    def process(self, images: list[Any]) -> dict[str, torch.Tensor]:
        """``pixel_values`` (all images' patches, stacked) and ``image_grid_thw`` (one row per image)."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """transformers' ``mm_token_type_ids``: 1 on image tokens, 0 on text (same shape as
        ``input_ids``). Qwen2-VL's forward needs it with images to place M-RoPE positions."""
        return (input_ids == self.image_token_id).to(torch.int32)

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """Image tokens per image: one per merged patch (merge_size x merge_size patches)."""
        return [int(n) for n in (grid_thw.prod(dim=-1) // (self.merge_size**2)).tolist()]

    def expand_image_tokens(self, ids: list[int], grid_thw: torch.Tensor) -> list[int]:
        """``ids`` with the k-th image placeholder repeated once per merged patch of image k."""
        counts = self.tokens_per_image(grid_thw)
        placeholders = sum(1 for t in ids if t == self.image_token_id)
        if placeholders != len(counts):
            raise ValueError(f"{placeholders} image placeholders in the prompt for {len(counts)} images")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_token_id:
                out.extend([t] * counts[k])
                k += 1
            else:
                out.append(t)
        return out


def load_vision_processor(path: str | os.PathLike, tokenizer, trust_remote_code: bool = False) -> VisionProcessor:
    """The image processor of the model at ``path`` (preprocessor_config.json) and ``tokenizer``'s
    image placeholder id. A directory without an image processor is an error naming the file."""
    from transformers import AutoImageProcessor

    p = check_model_dir(path)
    if not (p / "preprocessor_config.json").is_file():
        raise FileNotFoundError(
            f"{p} is a {model_type_of(p)} model without preprocessor_config.json: a vision-language "
            "model needs its image processor saved next to it"
        )
    with hf_progress_bars_off():
        image_processor = AutoImageProcessor.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if image_token_id is None or image_token_id == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer in {p} has no {IMAGE_TOKEN} token; is it the model's own tokenizer?")
    return VisionProcessor(image_processor, int(image_token_id), int(image_processor.merge_size))


def mrope_position_ids(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None
) -> torch.Tensor:
    """M-RoPE position ids of a padded batch with images.  # (B, L) -> (3, B, L)

    Qwen2-VL rotates each head's frequencies in three sections by (temporal, height, width)
    positions: an image token's are its patch's place in the image, text tokens' are all three
    the running position, which after an image resumes at its start + max(h, w) / merge_size.
    The model's own ``get_rope_index`` computes them; they are passed to the forward explicitly
    because, left to itself, the model caches ``rope_deltas`` between calls (a generation's state
    that a training forward must not read). ``image_grid_thw`` lists the images of all rows in
    row order (None: no images); padding (attention_mask 0) gets position 0.
    """
    inner = getattr(model, "model", model)
    get_rope_index = getattr(inner, "get_rope_index", None)
    if get_rope_index is None:
        raise TypeError(f"{type(model).__name__} has no get_rope_index: not a Qwen2-VL-style model")
    token_types = (input_ids == model.config.image_token_id).to(torch.int32)
    position_ids, _ = get_rope_index(
        input_ids, mm_token_type_ids=token_types, image_grid_thw=image_grid_thw, attention_mask=attention_mask
    )
    return position_ids


# Where vision-language models keep their image encoder: Qwen2-VL / Qwen2.5-VL (``model.visual`` in
# transformers >= 4.52, ``visual`` before), LLaVA-style ``vision_tower``, and ``vision_model``.
_VISION_TOWER_PATHS = ("model.visual", "visual", "model.vision_tower", "vision_tower", "model.vision_model",
                       "vision_model")


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The image encoder of a vision-language model, or None for a text-only one."""
    for path in _VISION_TOWER_PATHS:
        module: Any = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.Module):
            return module
    return None


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """verl's actor.freeze_vision_tower: the image encoder's parameters stop requiring grad, so the
    optimizer never holds them and they keep their loaded values. Returns how many were frozen (0:
    no vision tower, which verl also only reports)."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    params = [p for p in tower.parameters() if p.requires_grad]
    tower.requires_grad_(False)
    return sum(p.numel() for p in params)
