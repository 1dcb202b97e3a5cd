"""Step 2 of the GPU kit: the native engine's bf16 decode against HF ``generate`` and the HBM
roofline, with and without CUDA graphs, and the rollout-vs-trainer logprob mismatch in bf16.

Models: random-weight Qwen2ForCausalLM shaped like Qwen2.5-0.5B and -1.5B (tied embeddings),
bf16. Each (shape, batch) decodes ``prompt`` random tokens + exactly ``max_tokens`` new tokens
(``ignore_eos``). Decode rate, per engine: every run is timed twice, generating ``max_tokens``
and 1 token, so the prefill cancels out:

    decode tokens/s = batch x (max_tokens - 1) / (t_full - t_one)          (medians)

Roofline: a decode step reads every weight once and every cached key and value of every row:

    bytes/step = weight bytes + batch x (prompt + (max_tokens - 1) / 2) x KV bytes per position
    bound tokens/s = batch x copy bandwidth / bytes/step                   (measured bandwidth)

Logprob mismatch: the engine samples 64 responses (bf16); the trainer scores the same tokens
(``TrainEngine.compute_logprobs``), once with fp32 weights and once in bf16 autocast over fp32
weights (``model.dtype=bfloat16`` on one GPU). Reported: mean and max |rollout - trainer| over
response tokens, and the k3 estimate of KL(rollout || trainer).

    python -m bench.gpu.decode --json decode.json [--dry-run]
"""

from __future__ import annotations

import gc

import torch

from bench.gpu.common import (
    EOS_TOKEN_ID, PAD_TOKEN_ID, QWEN25_05B, QWEN25_15B, Results, Shape, build_qwen2, copy_bandwidth, median_time,
    num_parameters, pick_device, step_arguments,
)
from hybridflow.inference.native import NativeEngine
from hybridflow.training.engine import TrainEngine
from hybridflow.types import GenerationRequest, SamplingParams, collate_trajectories


def requests_for(prompts: list[list[int]], max_tokens: int, temperature: float = 1.0) -> list[GenerationRequest]:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    return [GenerationRequest(prompt_ids=p, params=params, request_id=str(i)) for i, p in enumerate(prompts)]


def native_rate(engine: NativeEngine, prompts: list[list[int]], max_tokens: int, repeats: int,
                device: torch.device) -> float | None:
    full = median_time(lambda: engine.generate_batch(requests_for(prompts, max_tokens)), device, repeats)
    one = median_time(lambda: engine.generate_batch(requests_for(prompts, 1)), device, repeats)
    return decode_tokens_per_s(len(prompts), max_tokens, full, one)


def hf_rate(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, repeats: int,
            device: torch.device) -> float | None:
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                           top_k=0, pad_token_id=PAD_TOKEN_ID)

    full = median_time(lambda: generate(max_tokens), device, repeats)
    one = median_time(lambda: generate(1), device, repeats)
    return decode_tokens_per_s(len(prompts), max_tokens, full, one)


def decode_tokens_per_s(batch: int, max_tokens: int, full_s: float, one_s: float) -> float | None:
    """The decode rate without the prefill; None when the full run was not slower than the
    one-token run (timing noise swamped the decode: toy sizes on a loaded CPU)."""
    if full_s <= one_s:
        return None
    return batch * (max_tokens - 1) / (full_s - one_s)


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def kv_bytes_per_position(shape: Shape, dtype: torch.dtype) -> int:
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * (
        shape.hidden_size // shape.num_attention_heads) * dtype.itemsize


def build_on(shape: Shape, max_positions: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    # Random init of a 1.5B model takes seconds on a CPU and milliseconds on the device.
    with torch.device(device):
        model = build_qwen2(shape, max_positions)
    return model.to(dtype)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_table(results: Results, shape: Shape, batches: list[int], prompt: int, max_tokens: int, repeats: int,
                 device: torch.device, bandwidth: float) -> None:
    dtype = torch.bfloat16
    modes = ["eager", "cuda_graph"] if device.type == "cuda" else ["eager"]
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        prompts = torch.randint(2, shape.vocab_size, (batch, prompt), generator=generator).tolist()
        weight_bytes = None
        row: dict[str, float | int] = {}
        for mode in modes:
            with results.guard(f"decode {shape.name} batch {batch} native {mode}"):
                model = build_on(shape, prompt + max_tokens, device, dtype)
                weight_bytes = num_parameters(model) * dtype.itemsize
                engine = NativeEngine(model=model, eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
                                      max_batch_size=batch, device=device, dtype=dtype, decode_mode=mode)
                row[f"native_{mode}_tokens_s"] = rounded(native_rate(engine, prompts, max_tokens, repeats, device))
                del engine, model
                release(device)
        with results.guard(f"decode {shape.name} batch {batch} hf generate"):
            model = build_on(shape, prompt + max_tokens, device, dtype)
            weight_bytes = num_parameters(model) * dtype.itemsize
            row["hf_generate_tokens_s"] = rounded(hf_rate(model, prompts, max_tokens, repeats, device))
            del model
            release(device)
        if weight_bytes is not None:
            step_bytes = weight_bytes + batch * (prompt + (max_tokens - 1) / 2) * kv_bytes_per_position(shape, dtype)
            bound = batch * bandwidth / step_bytes
            row["roofline_tokens_s"] = round(bound, 1)
            best = max((v for k, v in row.items() if k.startswith("native_") and v), default=None)
            if best is not None:
                row["native_best_fraction_of_roofline"] = round(best / bound, 3)
                if row.get("hf_generate_tokens_s"):
                    row["native_best_over_hf"] = round(best / row["hf_generate_tokens_s"], 2)
        results.put(f"decode/{shape.name}/batch_{batch}", row)


def logprob_mismatch(results: Results, shape: Shape, samples: int, prompt: int, max_tokens: int,
                     device: torch.device) -> None:
    model = build_on(shape, prompt + max_tokens, device, torch.float32)
    trainer_fp32 = TrainEngine(model, None, device)
    rollout_model = build_on(shape, prompt + max_tokens, device, torch.float32)  # same seed: same weights
    engine = NativeEngine(model=rollout_model, eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
                          max_batch_size=samples, device=device, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, shape.vocab_size, (samples, prompt), generator=generator).tolist()
    trajectories = [t for group in engine.generate_batch(requests_for(prompts, max_tokens)) for t in group]
    del engine, rollout_model
    release(device)
    batch = collate_trajectories(trajectories, PAD_TOKEN_ID)
    mask = batch.response_mask.bool()
    rollout = batch.rollout_logprobs[mask]
    figures = {}
    for name, mixed in (("trainer_fp32", None), ("trainer_bf16_autocast", torch.bfloat16)):
        trainer = trainer_fp32 if mixed is None else TrainEngine(model, None, device, mixed_precision=mixed)
        logprobs, _ = trainer.compute_logprobs(batch, temperature=1.0, micro_batch_size=16)
        logprobs = logprobs.float().cpu()[mask]
        delta = logprobs - rollout  # log(pi_trainer / pi_rollout)
        figures[name] = {"mean_abs": round(float(delta.abs().mean()), 5), "max_abs": round(float(delta.abs().max()), 4),
                         "k3_kl": round(float((delta.exp() - 1 - delta).mean()), 6)}
    figures["tokens"] = int(mask.sum())
    results.put(f"logprob_mismatch/{shape.name}/rollout_bf16", figures)


def main() -> None:
    args = step_arguments(__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    results = Results(args.json, "decode", args.dry_run)
    device = pick_device(args.dry_run)
    if args.dry_run:
        shapes, batches, prompt, max_tokens, repeats, samples = [QWEN25_05B.toy()], [1, 4], 8, 6, 1, 4
    else:
        shapes, batches, prompt, max_tokens, repeats, samples = [QWEN25_05B, QWEN25_15B], [1, 64, 256], 128, 64, 2, 64
    bandwidth = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (32 << 20))
    results.put("settings", {"prompt_tokens": prompt, "max_tokens": max_tokens, "repeats": repeats,
                             "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "dtype": "bfloat16"})
    # Value order: the 0.5B table and its logprob check first, then the 1.5B table.
    decode_table(results, shapes[0], batches, prompt, max_tokens, repeats, device, bandwidth)
    with results.guard(f"logprob mismatch {shapes[0].name}"):
        logprob_mismatch(results, shapes[0], samples, prompt, max_tokens, device)
    for shape in shapes[1:]:
        decode_table(results, shape, batches, prompt, max_tokens, repeats, device, bandwidth)


if __name__ == "__main__":
    main()
