"""The training engine on a vision-language batch: images and M-RoPE positions reach the forward."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.models.tiny import (
    VL_CHAT_TEMPLATE,
    VL_SPECIAL_TOKENS,
    VL_TOKEN_IDS,
    build_tiny_tokenizer,
    build_tiny_vl_model,
    build_tiny_vl_processor,
)
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import MultiModalInputs, Trajectory, collate_trajectories

PAD = VL_TOKEN_IDS["<|endoftext|>"]


@pytest.fixture(scope="module", autouse=True)
def threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def vision():
    return vision_processor()


def vision_processor():
    return build_tiny_vl_processor()


def square(colour, size=(56, 56)):
    from PIL import Image

    image = Image.new("RGB", size, (255, 255, 255))
    image.paste(colour, (14, 14, size[0] - 14, size[1] - 14))
    return image


def trajectories(vision) -> list[Trajectory]:
    """Rows of different lengths: one image, two images of different grids, and text only."""
    tok = build_tiny_tokenizer(VL_SPECIAL_TOKENS, VL_CHAT_TEMPLATE)
    prompts = [
        ([square((255, 0, 0))], "<|vision_start|><|image_pad|><|vision_end|>colour?"),
        ([square((0, 255, 0)), square((0, 0, 255), (112, 56))],
         "<|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|> same?"),
        ([], "plain text, no image"),
    ]
    out = []
    g = torch.Generator().manual_seed(0)
    for i, (images, text) in enumerate(prompts):
        ids = tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        multi_modal = None
        if images:
            inputs = vision.process(images)
            ids = vision.expand_image_tokens(ids, inputs["image_grid_thw"])
            multi_modal = MultiModalInputs(inputs["pixel_values"], inputs["image_grid_thw"])
        response = torch.randint(0, 256, (3 + 2 * i,), generator=g).tolist()
        out.append(Trajectory(ids, response, [1] * len(response), [0.0] * len(response), "length", group_id=i,
                              reward=float(i), multi_modal=multi_modal))
    return out


def hf_logprobs(model, t: Trajectory, vision) -> torch.Tensor:
    """One sample alone, unpadded, through the model's own forward (its own M-RoPE positions)."""
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    kwargs = {}
    if t.multi_modal is not None:
        kwargs = dict(pixel_values=t.multi_modal.pixel_values, image_grid_thw=t.multi_modal.image_grid_thw,
                      mm_token_type_ids=vision.token_types(ids))
    model.model.rope_deltas = None  # no state from an earlier call
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0].float()
    p = len(t.prompt_ids)
    logprobs = torch.log_softmax(logits[p - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]


def test_vl_logprobs_on_a_padded_batch_equal_each_sample_alone_through_hf(vision):
    model = build_tiny_vl_model(seed=1).eval()
    samples = trajectories(vision)
    batch = collate_trajectories(samples, pad_token_id=PAD)
    assert batch.multi_modal is not None and batch.multi_modal[2] is None
    for fused in (True, False):
        engine = TrainEngine(copy.deepcopy(model), optim=None, device=torch.device("cpu"), fused_lm_head=fused)
        for micro in (3, 1):  # one padded micro-batch, and rows alone (select carries the images)
            logprobs, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=micro)
            for i, t in enumerate(samples):
                expected = hf_logprobs(model, t, vision)
                assert (logprobs[i, : len(expected)] - expected).abs().max() < 1e-5, (fused, micro, i)
    # The images matter: without them (and their positions) the logprobs differ.
    text_only = copy.copy(batch)
    text_only.multi_modal = None
    engine = TrainEngine(copy.deepcopy(model), optim=None, device=torch.device("cpu"))
    blind, _ = engine.compute_logprobs(text_only, temperature=1.0, micro_batch_size=3)
    with_images, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=3)
    assert (blind[0] - with_images[0]).abs().max() > 1e-4


def test_vl_update_trains_the_vision_tower_and_packing_is_refused(vision):
    model = build_tiny_vl_model(seed=2)
    batch = collate_trajectories(trajectories(vision), pad_token_id=PAD)
    num_tokens, _ = batch_counts(batch.response_mask)

    def loss_fn(mb, logprobs, entropy):
        return agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    engine = TrainEngine(copy.deepcopy(model), OptimSpec(lr=0.0, grad_clip=0.0), torch.device("cpu"))
    engine.optimizer_step(batch.split(2), loss_fn, temperature=1.0, with_entropy=False)
    visual = [p.grad for n, p in engine.model.named_parameters() if n.startswith("model.visual.")]
    assert visual and all(g is not None for g in visual) and any(g.abs().sum() > 0 for g in visual)
    with pytest.raises(ValueError, match="sequence packing .* does not carry their images"):
        engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=3, use_remove_padding=True)
