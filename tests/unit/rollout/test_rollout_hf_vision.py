"""The HF-forward rollout engine for vision-language models against the trainer's recomputation."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.models.tiny import (
    VL_CHAT_TEMPLATE,
    VL_SPECIAL_TOKENS,
    VL_TOKEN_IDS,
    build_tiny_tokenizer,
    build_tiny_vl_model,
    build_tiny_vl_processor,
)
from hybridflow.rollout.hf_vision import HFVisionEngine
from hybridflow.training.engine import TrainEngine
from hybridflow.types import GenerationRequest, MultiModalInputs, SamplingParams, collate_trajectories

EOS, PAD = VL_TOKEN_IDS["<|im_end|>"], VL_TOKEN_IDS["<|endoftext|>"]


@pytest.fixture(scope="module", autouse=True)
def threads():
    torch.set_num_threads(1)


def square(colour, size=(56, 56)):
    from PIL import Image

    image = Image.new("RGB", size, (255, 255, 255))
    image.paste(colour, (14, 14, size[0] - 14, size[1] - 14))
    return image


def requests(temperature: float, max_tokens: int = 6) -> list[GenerationRequest]:
    """One image, two images of different grids, and a text-only prompt."""
    tok, vision = build_tiny_tokenizer(VL_SPECIAL_TOKENS, VL_CHAT_TEMPLATE), build_tiny_vl_processor()
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [([square((255, 0, 0))], f"{image}colour?"),
               ([square((0, 255, 0)), square((0, 0, 255), (112, 56))], f"{image} and {image} same?"),
               ([], "plain text, no image")]
    out = []
    for i, (images, text) in enumerate(prompts):
        ids = tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        multi_modal = None
        if images:
            inputs = vision.process(images)
            ids = vision.expand_image_tokens(ids, inputs["image_grid_thw"])
            multi_modal = MultiModalInputs(inputs["pixel_values"], inputs["image_grid_thw"])
        params = SamplingParams(n=3, temperature=temperature, max_tokens=max_tokens, seed=10 + i, top_p=0.9)
        out.append(GenerationRequest(ids, params, multi_modal=multi_modal))
    return out


def test_rollout_logprobs_agree_with_the_trainer_on_image_and_text_prompts():
    model = build_tiny_vl_model(seed=5)
    engine = HFVisionEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD)
    groups = engine.generate_batch(requests(temperature=0.8))
    samples = [t for group in groups for t in group]
    assert [t.multi_modal is None for t in samples] == [False] * 6 + [True] * 3
    assert all(len(t.response_ids) == 6 or t.finish_reason == "stop" for t in samples)
    assert len({tuple(t.response_ids) for t in samples[:3]}) > 1  # the n samples differ
    batch = collate_trajectories(samples, pad_token_id=PAD)
    trainer = TrainEngine(copy.deepcopy(model), optim=None, device=torch.device("cpu"))
    logprobs, _ = trainer.compute_logprobs(batch, temperature=0.8, micro_batch_size=4)
    mask = batch.response_mask.bool()
    assert (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max() < 1e-4
    # Seeded: the same samples again, whatever ran before.
    again = engine.generate_batch(requests(temperature=0.8)[1:2])[0]
    assert [t.response_ids for t in again] == [t.response_ids for t in groups[1]]


def test_greedy_decoding_equals_argmax_of_the_full_forward_and_stops_at_eos():
    model = build_tiny_vl_model(seed=6)
    # Cached decoding with its own positions against one uncached forward of the trainer.
    engine = HFVisionEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD)
    request = requests(temperature=0.0, max_tokens=5)[0]
    sample = engine.generate_batch([request])[0][0]
    batch = collate_trajectories([sample], pad_token_id=PAD)
    trainer = TrainEngine(copy.deepcopy(model), optim=None, device=torch.device("cpu"), fused_lm_head=False)
    logits = trainer.forward_pass._response_logits(batch, 1.0)[0]  # (R, V) from one uncached forward with M-RoPE
    assert sample.response_ids == logits.argmax(-1).tolist()[: len(sample.response_ids)]
    token = sample.response_ids[-1]
    first = sample.response_ids.index(token)  # a stop id ends the sample where it first appears
    stop = engine.generate_batch([GenerationRequest(request.prompt_ids, SamplingParams(
        temperature=0.0, max_tokens=5, stop_token_ids=[token]), multi_modal=request.multi_modal)])[0][0]
    assert stop.response_ids == sample.response_ids[: first + 1]
    assert stop.finish_reason == "stop" and stop.stop_reason == token


def test_unsupported_settings_and_weight_updates_are_checked():
    model = build_tiny_vl_model(seed=7)
    engine = HFVisionEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD)
    request = requests(temperature=1.0)[2]
    request.params.stop = ["x"]
    with pytest.raises(ValueError, match="does not implement stop strings"):
        engine.generate_batch([request])
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])
    name, weight = next(iter(model.named_parameters()))
    engine.update_weights([(name, weight + 1.0)])
    assert torch.equal(dict(engine.model.named_parameters())[name], weight + 1.0)


def test_the_native_engine_refuses_a_request_with_images():
    from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
    from hybridflow.inference.native import NativeEngine

    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    engine = NativeEngine(model=build_tiny_model(spec), eos_token_ids=[258], pad_token_id=256, max_batch_size=4)
    request = requests(temperature=1.0)[0]
    with pytest.raises(ValueError, match="has images, and the native rollout engine generates from text only"):
        engine.generate_batch([request])


def test_image_placeholders_are_never_sampled_and_the_trainer_names_one_in_a_response():
    """A model that prefers the image token still never emits it (the trainer's forward would take
    it for a slot of image features); the logprobs stay the unfiltered ones the trainer computes."""
    model = build_tiny_vl_model(seed=8)
    image_pad = VL_TOKEN_IDS["<|image_pad|>"]
    with torch.no_grad():
        model.lm_head.weight[image_pad] *= 50.0  # tied: also the image token's input embedding, as it happens
    engine = HFVisionEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=PAD)
    samples = [t for group in engine.generate_batch(requests(temperature=1.0)) for t in group]
    assert all(image_pad not in t.response_ids for t in samples)
    batch = collate_trajectories(samples, pad_token_id=PAD)
    trainer = TrainEngine(copy.deepcopy(model), optim=None, device=torch.device("cpu"))
    logprobs, _ = trainer.compute_logprobs(batch, temperature=1.0, micro_batch_size=4)
    mask = batch.response_mask.bool()
    assert (logprobs[mask] - batch.rollout_logprobs[mask]).abs().max() < 1e-4
    samples[0].response_ids[0] = image_pad
    with pytest.raises(ValueError, match="a response holds the image placeholder token"):
        trainer.compute_logprobs(collate_trajectories(samples, pad_token_id=PAD), temperature=1.0, micro_batch_size=4)
