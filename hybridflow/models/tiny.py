"""The built-in tiny model: a Qwen2-architecture transformer with a byte-level tokenizer.

It is written as an ordinary Hugging Face directory (config.json, model.safetensors,
tokenizer.json, chat template) and loaded back with ``from_pretrained`` like any user model,
so the built-in run exercises the same loading code a real model does.

Tokenizer: every byte is one token (ASCII text is character-level), plus the three Qwen chat
special tokens. The vocabulary is stored in *byte-level* form (GPT-2's byte-to-unicode map)
because transformers rebuilds ``model_type=qwen2`` tokenizers as byte-level BPE: a plain
character vocabulary would silently lose spaces on the way back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch

from hybridflow.models.loading import hf_progress_bars_off
from hybridflow.utils.files import give_default_modes

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the rest (control bytes, space, ...) are shifted
    to code points from 256 up, so every byte is a visible, whitespace-free character.
    """
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    mapping: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def build_tiny_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS, chat_template: str = CHAT_TEMPLATE):
    """A byte-level Qwen2-style fast tokenizer with a ChatML template (vocab 256 + specials: 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(byte_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting; every byte stays its own token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    return fast


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the built-in model. The defaults give ~0.9M parameters."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    vocab_size: int = 272  # 259 tokens rounded up to a multiple of 16

    def key(self) -> str:
        return (
            f"h{self.hidden_size}-i{self.intermediate_size}-l{self.num_hidden_layers}"
            f"-a{self.num_attention_heads}-kv{self.num_key_value_heads}-v{self.vocab_size}"
        )


DECODER_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "max_position_embeddings")
"""The decoder's shape: fields of both specs (``TinyModelSpec``, ``TinyVLSpec``) and keys of the
transformers config (a VL model's ``text_config``) they become."""


def decoder_shape(spec: Any) -> dict[str, int]:
    """The spec's decoder shape as transformers config keyword arguments (``DECODER_SHAPE_KEYS``)."""
    return {key: getattr(spec, key) for key in DECODER_SHAPE_KEYS}


def tiny_config(spec: TinyModelSpec = TinyModelSpec()):
    """The built-in model's ``Qwen2Config`` of the given shape."""
    from transformers import Qwen2Config

    tokenizer_vocab = 256 + len(SPECIAL_TOKENS)
    if spec.vocab_size < tokenizer_vocab:
        raise ValueError(f"vocab_size {spec.vocab_size} < tokenizer vocabulary {tokenizer_vocab}")
    return Qwen2Config(
        **decoder_shape(spec),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=258,  # <|im_end|>
        pad_token_id=256,  # <|endoftext|>
        rope_theta=10000.0,
    )


def build_tiny_model(spec: TinyModelSpec = TinyModelSpec(), seed: int = 0):
    """A randomly initialised Qwen2ForCausalLM of the given shape (fp32, CPU)."""
    from transformers import Qwen2ForCausalLM

    return _seeded(Qwen2ForCausalLM, tiny_config(spec), seed)


def _seeded(model_class, config, seed: int):
    """``model_class(config)`` initialised from ``seed`` without touching the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config)


def write_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> Path:
    """Write a random-init tiny model and its tokenizer as a Hugging Face directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with hf_progress_bars_off():
        build_tiny_model(spec, seed).save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)
    give_default_modes(out)  # safetensors writes mode 0600
    return out



def write_tiny_reward_model(out_dir: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> Path:
    """A random-init tiny reward model (``Qwen2ForSequenceClassification``, one label, the built-in
    tokenizer and chat template) as a Hugging Face directory: what ``reward_model.model.path``
    loads, for tests and examples. The head's weights are drawn like the rest, so scores differ
    between texts (a zero head would score every text 0)."""
    from transformers import Qwen2ForSequenceClassification

    config = tiny_config(spec)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with hf_progress_bars_off():
        model.save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)
    give_default_modes(out)
    return out


# ------------------------------------------------------------------ a tiny vision-language model
# Qwen2-VL's special tokens after the three chat ones (ids 259..262): an image is
# <|vision_start|> <|image_pad|> x N <|vision_end|> in the token stream, N from its patch grid.
VL_SPECIAL_TOKENS = SPECIAL_TOKENS + ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VL_TOKEN_IDS = {token: 256 + i for i, token in enumerate(VL_SPECIAL_TOKENS)}
# Qwen2-VL's chat template, reduced to what the tiny model needs: a message's content is a
# string, or a list of {"type": "image"} / {"type": "text", "text": ...} parts (how a
# multimodal prompt reaches a processor's template); an image part becomes its placeholder.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The image processor's pixel budget, in units of one merged patch (28 x 28 pixels with
# patch 14 and merge 2): every image is resized to between 4 and 16 merged patches, i.e.
# 4..16 image tokens, so a test prompt stays a few dozen tokens.
VL_MERGED_PATCH_PIXELS = 28 * 28
VL_MIN_PIXELS = 4 * VL_MERGED_PATCH_PIXELS
VL_MAX_PIXELS = 16 * VL_MERGED_PATCH_PIXELS


@dataclass(frozen=True)
class TinyVLSpec:
    """Shape of the tiny Qwen2-VL: a 2-layer text model and a 2-block vision tower (~0.2M
    parameters). ``hidden_size / num_attention_heads / 2`` must equal ``sum(mrope_section)``:
    M-RoPE splits each head's rotary frequencies into temporal, height and width sections."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_num_heads: int = 2
    max_position_embeddings: int = 512
    vocab_size: int = 272  # 263 tokens rounded up to a multiple of 16


def tiny_vl_config(spec: TinyVLSpec = TinyVLSpec()):
    """The tiny model's ``Qwen2VLConfig`` (transformers' own class: a text config and a vision config)."""
    from transformers import Qwen2VLConfig

    head_dim = spec.hidden_size // spec.num_attention_heads
    if sum(spec.mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    if spec.vocab_size < len(VL_TOKEN_IDS) + 256:
        raise ValueError(f"vocab_size {spec.vocab_size} < tokenizer vocabulary {256 + len(VL_TOKEN_IDS)}")
    return Qwen2VLConfig(
        text_config=dict(
            **decoder_shape(spec),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(spec.mrope_section)},
            bos_token_id=None,
            eos_token_id=VL_TOKEN_IDS["<|im_end|>"],
            pad_token_id=VL_TOKEN_IDS["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=spec.vision_depth,
            embed_dim=spec.vision_embed_dim,
            hidden_size=spec.hidden_size,  # the merger projects vision features to the text width
            num_heads=spec.vision_num_heads,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=VL_TOKEN_IDS["<|image_pad|>"],
        video_token_id=VL_TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=VL_TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=VL_TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def build_tiny_vl_model(spec: TinyVLSpec = TinyVLSpec(), seed: int = 0):
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` of the given shape (fp32, CPU)."""
    from transformers import Qwen2VLForConditionalGeneration

    return _seeded(Qwen2VLForConditionalGeneration, tiny_vl_config(spec), seed)


def build_tiny_vl_processor():
    """The tiny model's ``VisionProcessor`` (PIL image processor, small pixel budget), in memory."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hybridflow.models.vision import VisionProcessor

    image_processor = Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS)
    return VisionProcessor(image_processor, VL_TOKEN_IDS["<|image_pad|>"], int(image_processor.merge_size))


def write_tiny_vl_model(out_dir: str | os.PathLike, spec: TinyVLSpec = TinyVLSpec(), seed: int = 0) -> Path:
    """Write a random-init tiny Qwen2-VL, its tokenizer and its image processor as a Hugging
    Face directory (config.json, model.safetensors, tokenizer files, preprocessor_config.json).

    The image processor is transformers' PIL ``Qwen2VLImageProcessor`` (no torchvision needed)
    with a small pixel budget. No processor_config.json is written: transformers' Qwen2-VL
    processor also builds a video processor, which needs torchvision; hybridflow loads the
    tokenizer and the image processor separately (``hybridflow.models.vision``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with hf_progress_bars_off():
        build_tiny_vl_model(spec, seed).save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer(VL_SPECIAL_TOKENS, VL_CHAT_TEMPLATE).save_pretrained(out)
    build_tiny_vl_processor().image_processor.save_pretrained(out)
    give_default_modes(out)
    return out
