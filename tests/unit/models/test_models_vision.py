"""The tiny Qwen2-VL directory: it loads back through hybridflow.models.vision and runs on an image."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data.images import decode_image
from hybridflow.models.loading import load_causal_lm, load_tokenizer, meta_causal_lm
from hybridflow.models.tiny import VL_TOKEN_IDS, write_tiny_model, write_tiny_vl_model
from hybridflow.models.vision import is_vision_language, load_vision_processor


def red_square():
    from PIL import Image

    image = Image.new("RGB", (56, 56), (0, 0, 255))
    image.paste((255, 0, 0), (14, 14, 42, 42))
    return image


def test_tiny_vl_directory_loads_as_an_image_text_model_and_answers_from_the_pixels(tmp_path):
    d = write_tiny_vl_model(tmp_path / "vl")
    assert is_vision_language(d)
    tok = load_tokenizer(d)
    vision = load_vision_processor(d, tok)
    assert vision.image_token_id == VL_TOKEN_IDS["<|image_pad|>"] and vision.merge_size == 2
    model = load_causal_lm(d).eval()  # what the actor, the reference and the rollout load
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    meta = meta_causal_lm(d)
    assert [n for n, _ in meta.named_parameters()] == [n for n, _ in model.named_parameters()]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def logits_for(image):
        inputs = vision.process([image])
        ids = vision.expand_image_tokens(tok.encode(text, add_special_tokens=False), inputs["image_grid_thw"])
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            return model(input_ids=input_ids, mm_token_type_ids=vision.token_types(input_ids), **inputs).logits[0, -1]

    red = logits_for(red_square())
    assert red.shape == (272,)
    # The image reaches the logits: another picture, other logits; the same picture, the same.
    from PIL import Image

    assert not torch.allclose(red, logits_for(Image.new("RGB", (56, 56), (0, 255, 0))))
    assert torch.equal(red, logits_for(red_square()))


def test_text_only_models_are_not_vision_language_and_say_so(tmp_path):
    d = write_tiny_model(tmp_path / "text")
    assert not is_vision_language(d)
    with pytest.raises(FileNotFoundError, match="without preprocessor_config.json"):
        load_vision_processor(d, load_tokenizer(d))


def test_decode_image_returns_rgb():
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (8, 8), 100).save(buffer, format="PNG")
    assert decode_image(buffer.getvalue()).mode == "RGB"
