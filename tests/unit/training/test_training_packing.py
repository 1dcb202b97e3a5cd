"""Packed (padding-free) forwards against padded ones, for the Qwen2, Llama, Qwen3, Mistral, Phi-3,
Qwen3-MoE and Mixtral families."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.models.loading import load_causal_lm
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.training.micro_batches import num_token_budget_micro_batches, token_budget_micro_batches
from hybridflow.training.packing import (
    VARLEN_ATTENTION,
    cu_seqlens_from_position_ids,
    enable_varlen_attention,
    pack_batch,
    sequence_lengths,
    unpack_responses,
)
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories

VOCAB = 272
PAD = 256
TOLERANCE = 1e-5  # fp32: packed and padded differ only in summation order


@pytest.fixture(scope="module", autouse=True)
def threads():
    torch.set_num_threads(1)


def trajectory(prompt: list[int], response: list[int], group_id: int = 0) -> Trajectory:
    n = len(response)
    return Trajectory(prompt, response, [1] * n, [0.0] * n, "stop", group_id=group_id)


def random_batch(seed: int, num: int = 9, max_prompt: int = 12, max_response: int = 40) -> TrainBatch:
    """Mixed lengths, one empty response, tool tokens (loss mask 0) in one sample."""
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for i in range(num):
        lp = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        lr = 0 if i == 3 else int(torch.randint(1, max_response + 1, (1,), generator=g))
        ids = torch.randint(0, 256, (lp + lr,), generator=g).tolist()
        trajectories.append(trajectory(ids[:lp], ids[lp:], group_id=i // 3))
    trajectories[1].loss_mask[:2] = [0, 0]
    return collate_trajectories(trajectories, pad_token_id=PAD)


def save(model: torch.nn.Module, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_family(name: str, root: Path) -> Path:
    """A tiny random-init model of each supported family, written as an HF directory."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD)
    torch.manual_seed(7)
    if name == "qwen2":
        spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        return write_tiny_model(root / name, spec, seed=7)
    if name == "qwen2-sliding":
        # The second layer slides over 5 tokens: the varlen path must band the mask like sdpa.
        config = Qwen2Config(**shape, use_sliding_window=True, sliding_window=5, max_window_layers=1)
        return save(Qwen2ForCausalLM(config), root / name)
    if name == "llama":
        return save(LlamaForCausalLM(LlamaConfig(**shape)), root / name)
    if name == "qwen3":
        return save(Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16)), root / name)
    if name == "mistral":  # every layer slides over 5 tokens
        return save(MistralForCausalLM(MistralConfig(**shape, sliding_window=5)), root / name)
    if name == "phi3":  # fused projections, a window of 7
        return save(Phi3ForCausalLM(Phi3Config(**shape, sliding_window=7)), root / name)
    if name == "qwen3_moe":
        config = Qwen3MoeConfig(**shape, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
        return save(Qwen3MoeForCausalLM(config), root / name)
    if name == "mixtral":
        return save(MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)), root / name)
    raise ValueError(name)


FAMILIES = ["qwen2", "qwen2-sliding", "llama", "qwen3", "mistral", "phi3", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_family(name, root) for name in FAMILIES}


def load(path: Path) -> torch.nn.Module:
    return load_causal_lm(path, dtype=torch.float32, device="cpu")


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference log-softmax gather, independent of the engine's chunked kernel."""
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]


def valid_response(batch: TrainBatch) -> torch.Tensor:
    return batch.attention_mask[:, batch.prompt_length :].bool()  # (B, R)


# ------------------------------------------------------------------------------ pack / unpack


def test_pack_hand_worked():
    batch = collate_trajectories(
        [trajectory([10, 11], [12, 13, 14]), trajectory([20], [21]), trajectory([30, 31], [])], pad_token_id=PAD
    )  # P=2, R=3
    packed = pack_batch(batch)
    assert packed.input_ids.tolist() == [[10, 11, 12, 13, 14, 20, 21, 30, 31]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 5, 7, 9] and packed.max_seqlen == 5
    # Token 12 is predicted at packed position 1 (token 11), 21 at 5 (token 20).
    assert packed.logit_positions.tolist() == [1, 2, 3, 5]
    assert packed.labels.tolist() == [12, 13, 14, 21]
    assert packed.response_index.tolist() == [0, 1, 2, 3]  # (B*R) slots: row 0 t0..2, row 1 t0
    out = unpack_responses(torch.tensor([1.0, 2.0, 3.0, 4.0]), packed)
    assert out.tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert sequence_lengths(batch) == [5, 2, 2]
    assert cu_seqlens_from_position_ids(packed.position_ids).tolist() == [0, 5, 7, 9]


def test_pack_refuses_what_it_cannot_pack():
    batch = collate_trajectories([trajectory([1, 2], [3, 4])], pad_token_id=PAD)
    holed = copy.copy(batch)
    holed.attention_mask = batch.attention_mask.clone()
    holed.attention_mask[0, 2] = 0  # padding between the prompt and the response's last token
    with pytest.raises(ValueError, match="padding between"):
        pack_batch(holed)
    no_prompt = collate_trajectories([trajectory([], [3, 4])], pad_token_id=PAD)
    with pytest.raises(ValueError, match="prompt token"):
        pack_batch(no_prompt)


# ------------------------------------------------------------------------------ logprob equivalence


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logprobs_match_padded(model_dirs, family):
    """Engine logprobs and entropy, packed vs padded, on every valid response token (fp32)."""
    batch = random_batch(seed=1)
    engine = TrainEngine(load(model_dirs[family]), optim=None, device=torch.device("cpu"))
    padded, padded_entropy = engine.compute_logprobs(batch, temperature=0.8, micro_batch_size=4, with_entropy=True)
    packed, packed_entropy = engine.compute_logprobs(
        batch, temperature=0.8, micro_batch_size=4, with_entropy=True, use_remove_padding=True
    )
    assert engine.model.config._attn_implementation == VARLEN_ATTENTION
    mask = valid_response(batch)
    assert (packed[mask] - padded[mask]).abs().max() < TOLERANCE
    assert (packed_entropy[mask] - padded_entropy[mask]).abs().max() < TOLERANCE
    assert bool((packed[~mask] == 0).all())
    # A packed row that leaked attention across samples would fail the check above; make sure
    # the comparison has teeth: a plain causal forward over the same row does differ.
    packed_batch = pack_batch(batch)
    inputs = packed_batch.model_inputs()
    inputs.update(cu_seq_lens_q=None, cu_seq_lens_k=None, position_ids=torch.arange(inputs["input_ids"].shape[1])[None])
    with torch.no_grad():
        leaky = engine.model(**inputs).logits[0].float() / 0.8
    leaky_lp = unpack_responses(token_logprobs(leaky, packed_batch.labels), packed_batch)
    assert (leaky_lp[mask] - padded[mask]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_sdpa_packed_mask_path_matches_padded(model_dirs, family):
    """Without the varlen kernel, transformers' own packed-sequence detection (block-diagonal
    mask from restarting position ids) gives the same logprobs: packing is correct on sdpa."""
    batch = random_batch(seed=2)
    model = load(model_dirs[family])
    assert model.config._attn_implementation == "sdpa"
    packed = pack_batch(batch)
    with torch.no_grad():
        logits = model(**packed.model_inputs()).logits[0].float()
        padded = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits.float()
    p = batch.prompt_length
    padded_lp = token_logprobs(padded[:, p - 1 : -1], batch.responses)
    packed_lp = unpack_responses(token_logprobs(logits, packed.labels), packed)
    mask = valid_response(batch)
    assert (packed_lp[mask] - padded_lp[mask]).abs().max() < TOLERANCE


def test_varlen_attention_leaves_unpacked_calls_bit_identical(model_dirs):
    """Swapping sdpa for the varlen kernel changes nothing for padded forwards and generation."""
    batch = random_batch(seed=3)
    sdpa = load(model_dirs["qwen3"])
    varlen = copy.deepcopy(sdpa)
    assert enable_varlen_attention(varlen) == VARLEN_ATTENTION
    kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, use_cache=False)
    with torch.no_grad():
        assert torch.equal(sdpa(**kwargs).logits, varlen(**kwargs).logits)
        p = batch.prompt_length
        prompt = dict(input_ids=batch.input_ids[:3, :p], attention_mask=batch.attention_mask[:3, :p])
        generate = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD)
        assert torch.equal(sdpa.generate(**prompt, **generate), varlen.generate(**prompt, **generate))


# ------------------------------------------------------------------------------ training and budgets


def test_packed_token_budget_gradients_match_padded_fixed(model_dirs):
    """Same mini-batch, same loss: padded fixed micro-batches vs packed token-budget ones give
    the same gradient (global normalisation makes the split irrelevant)."""
    batch = random_batch(seed=4, num=10)
    batch.advantages = torch.linspace(-1.0, 1.0, batch.batch_size)[:, None] * batch.response_mask
    num_tokens, _ = batch_counts(batch.response_mask)
    seen_shapes: list[tuple[int, ...]] = []

    def loss_fn(mb, logprobs, entropy):
        seen_shapes.append(tuple(logprobs.shape))
        per_token = -mb.advantages * logprobs - 0.01 * entropy
        return agg_loss(per_token, mb.response_mask, "token-mean", global_num_tokens=num_tokens), {}

    base = load(model_dirs["llama"])
    budget_micro_batches = token_budget_micro_batches(batch, 64)[0]
    grads = []
    for micro_batches, packed, checkpointing in (
        (batch.split(3), False, False),
        (budget_micro_batches, True, False),
        (budget_micro_batches, True, True),  # recomputation must see the same packed kwargs
    ):
        model = copy.deepcopy(base)
        if checkpointing:
            # transformers 5 renamed it; the old name still works but warns.
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        engine = TrainEngine(model, OptimSpec(lr=0.0, grad_clip=0.0), torch.device("cpu"))
        metrics = engine.optimizer_step(
            micro_batches, loss_fn, temperature=1.0, with_entropy=True, use_remove_padding=packed
        )
        grads.append((metrics["actor/grad_norm"], [p.grad.clone() for p in engine.model.parameters()]))
    assert grads[0][0] > 0
    for norm, tensors in grads[1:]:
        assert norm == pytest.approx(grads[0][0], rel=1e-5)
        for a, b in zip(grads[0][1], tensors):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert all(shape[1] == batch.response_length for shape in seen_shapes)  # loss_fn always sees (b, R)


def test_token_budget_logprobs_come_back_in_row_order(model_dirs):
    batch = random_batch(seed=5, num=12)
    engine = TrainEngine(load(model_dirs["qwen2"]), optim=None, device=torch.device("cpu"))
    micro_batches, partitions = token_budget_micro_batches(batch, 80)
    lengths = sequence_lengths(batch)
    assert len(micro_batches) > 2 and all(sum(lengths[i] for i in part) <= 80 for part in partitions)
    assert partitions != sorted(partitions)  # reordered, so restoring the order is tested
    reference, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=12)
    mask = valid_response(batch)
    for packed in (False, True):
        # Padded micro-batches count their padded slots, so they may need more than the packed ones.
        count = num_token_budget_micro_batches(batch, 80, padded=not packed) + 1
        logprobs, _ = engine.compute_logprobs(
            batch, temperature=1.0, micro_batch_size=1, use_remove_padding=packed, max_token_len=80,
            num_micro_batches=count,
        )
        assert (logprobs[mask] - reference[mask]).abs().max() < TOLERANCE


def test_varlen_attention_without_cu_seqlens_matches_sdpa_packing(model_dirs):
    """Callers that pass only restarting position ids (one packed row, or several) get what
    transformers' sdpa packing detection gives: the varlen kernel derives the segments itself,
    and several rows go to sdpa's own block mask."""
    sdpa = load(model_dirs["qwen2"])
    varlen = copy.deepcopy(sdpa)
    enable_varlen_attention(varlen)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    with torch.no_grad():
        reference = sdpa(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(varlen(input_ids=ids, position_ids=pos, use_cache=False).logits, reference)
        one_row = varlen(input_ids=ids[:1], position_ids=pos[:1], use_cache=False).logits
    assert (one_row - reference[:1]).abs().max() < TOLERANCE


def test_varlen_attention_under_bf16_autocast_differentiates_in_float32(monkeypatch):
    """On a CPU, a bf16-mixed forward that will be differentiated runs the packed attention in
    float32 (torch's bf16 flash-attention backward is several times slower there), and its result
    is the float32 attention's, rounded to bf16 once; a no-grad forward keeps bf16."""
    from hybridflow.training import packing

    seen: list[tuple[torch.dtype, bool]] = []
    segment = packing._segment_attention

    def spy(q, k, v, *args):
        seen.append((q.dtype, torch.is_autocast_enabled("cpu")))
        return segment(q, k, v, *args)

    monkeypatch.setattr(packing, "_segment_attention", spy)
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, h, 9, 8, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 9])

    def attend(q, k, v):
        out, _ = packing.varlen_sdpa_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu)
        return out

    exact_q = query.clone().requires_grad_(True)
    exact = attend(exact_q, key, value)
    exact.float().sum().backward()
    assert seen.pop() == (torch.float32, False)
    mixed_q = query.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = attend(mixed_q, key, value.bfloat16())  # as a bf16 v_proj hands it over
        assert seen.pop() == (torch.float32, False)
        assert mixed.dtype == torch.bfloat16
        mixed.float().sum().backward()
        torch.testing.assert_close(mixed.float(), exact.bfloat16().float(), rtol=0, atol=0.02)
        torch.testing.assert_close(mixed_q.grad, exact_q.grad, rtol=0, atol=0.02)
        with torch.no_grad():
            attend(query, key, value.bfloat16())
        assert seen.pop() == (torch.float32, True)  # no backward: autocast's bf16 kernel


def _per_group_index_copy_attention(query, key, value, cu):
    """The packed attention as the kernel assembled it before issue 35: each length group's output
    copied into the (N, H, D) result by an out-of-place ``index_copy``, one full copy per group."""
    from hybridflow.training import packing

    segments = cu.tolist()
    starts, lengths = segments[:-1], [e - s for s, e in zip(segments[:-1], segments[1:])]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    for group in packing._length_groups(lengths):
        longest = max(lengths[i] for i in group)
        t = torch.arange(longest)
        start = torch.tensor([starts[i] for i in group])[:, None]
        length = torch.tensor([lengths[i] for i in group])[:, None]
        index = (start + torch.minimum(t[None, :], length - 1)).reshape(-1)
        q, k, v = (x[0][:, index].unflatten(1, (len(group), longest)).transpose(0, 1) for x in (query, key, value))
        o = packing._segment_attention(q, k, v, None, 0.0, None)
        real = (t[None, :] < length).reshape(-1)
        out = out.index_copy(0, index[real], o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])[real])
    return out.unsqueeze(0)


def test_varlen_attention_output_and_gradients_are_bitwise_the_per_group_copies(monkeypatch):
    """Gathering every group's rows back to pack order at once (not a full index_copy per group,
    issue 35's memory) changes no bit of the output nor of the q, k, v gradients. (The SDPA path:
    where the CPU attention kernel runs, this is the path without it.)"""
    from hybridflow.training import cpu_attention, packing

    monkeypatch.setattr(cpu_attention, "available", lambda: False)

    lengths = [1, 3, 4, 5, 9, 12, 30, 31, 2, 17]  # several length groups, single-token sequences too
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, h, int(cu[-1]), 16, generator=g) for h in (4, 2, 2)]
    upstream = torch.randn(1, int(cu[-1]), 4, 16, generator=g)
    results = []
    for attend in (lambda q, k, v: packing.varlen_sdpa_attention(torch.nn.Module(), q, k, v, None,
                                                                 cu_seq_lens_q=cu)[0],
                   lambda q, k, v: _per_group_index_copy_attention(q, k, v, cu)):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        out = attend(*leaves)
        (out * upstream).sum().backward()
        results.append([out.detach(), *(x.grad for x in leaves)])
    for new, old in zip(*results, strict=True):
        assert torch.equal(new, old)

# ------------------------------------------------------------------------------ shape buckets


def test_bucketed_lengths_are_few_and_waste_at_most_an_eighth():
    from hybridflow.training.packing import MIN_BUCKET, bucketed_length

    sizes = [bucketed_length(n) for n in range(1, 8193)]
    assert all(size >= n for n, size in enumerate(sizes, start=1))
    assert sizes[:MIN_BUCKET] == [MIN_BUCKET] * MIN_BUCKET
    assert max((size - n) / n for n, size in enumerate(sizes, start=1) if n > MIN_BUCKET) <= 1 / 8
    assert len(set(sizes)) <= 60  # 8192 distinct token counts meet 57 matmul shapes
    assert sizes == sorted(sizes) and all(bucketed_length(s) == s for s in set(sizes))  # buckets are fixed points


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3_moe"])
@pytest.mark.parametrize("fused_lm_head", [True, False])
def test_bucketed_packs_give_the_same_logprobs_and_gradients(model_dirs, family, fused_lm_head):
    """Padding a pack to its bucket (a pad sequence after the real ones; zero rows for the head)
    changes no real token's logprob, entropy or gradient (fp32, bucketing forced on: the engine
    turns it on for reduced-precision CPU compute only), and the model does run bucketed shapes."""
    from hybridflow.training.packing import bucketed_length

    batch = random_batch(seed=6, num=10)
    batch.advantages = torch.linspace(-1.0, 1.0, batch.batch_size)[:, None] * batch.response_mask
    num_tokens, _ = batch_counts(batch.response_mask)
    micro_batches = token_budget_micro_batches(batch, 96)[0]

    def loss_fn(mb, logprobs, entropy):
        return agg_loss(-mb.advantages * logprobs - 0.01 * entropy, mb.response_mask, "token-mean",
                        global_num_tokens=num_tokens), {}

    base = load(model_dirs[family])
    results = []
    for bucket in (False, True):
        engine = TrainEngine(copy.deepcopy(base), OptimSpec(lr=0.0, grad_clip=0.0), torch.device("cpu"),
                             fused_lm_head=fused_lm_head)
        assert engine.forward_pass.bucket_shapes is False  # float32 on a CPU: MKL, no buckets
        engine.forward_pass.bucket_shapes = bucket
        tokens: list[int] = []
        hook = engine.model.get_input_embeddings().register_forward_pre_hook(
            lambda _m, args: tokens.append(args[0].shape[-1]))
        logprobs, entropy = engine.compute_logprobs(batch, temperature=0.8, micro_batch_size=4, with_entropy=True,
                                                    use_remove_padding=True)
        metrics = engine.optimizer_step(micro_batches, loss_fn, temperature=1.0, with_entropy=True,
                                        use_remove_padding=True)
        hook.remove()
        results.append((logprobs, entropy, metrics["actor/grad_norm"], [p.grad.clone() for p in engine.model.parameters()]))
        assert all(n == bucketed_length(n) for n in tokens) == bucket, tokens
    (lp0, ent0, norm0, grads0), (lp1, ent1, norm1, grads1) = results
    mask = valid_response(batch)
    assert (lp0[mask] - lp1[mask]).abs().max() < TOLERANCE and (ent0[mask] - ent1[mask]).abs().max() < TOLERANCE
    assert bool((lp1[~mask] == 0).all())
    assert norm0 > 0 and norm1 == pytest.approx(norm0, rel=1e-5)
    for a, b in zip(grads0, grads1):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_the_engine_buckets_shapes_for_reduced_precision_on_a_cpu(model_dirs):
    engine = TrainEngine(load(model_dirs["qwen2"]), OptimSpec(lr=1e-3), torch.device("cpu"),
                         mixed_precision=torch.bfloat16)
    assert engine.forward_pass.bucket_shapes is True
