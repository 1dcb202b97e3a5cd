"""Decode tokens/s of the native engine against the memory-bandwidth bound (a GPU figure).

Workload: a random-weight model shaped like Qwen2.5-0.5B (24 layers, hidden 896, 14 query and 2
key/value heads, vocabulary 151,936, tied embeddings) in ``--dtype`` (bf16 by default), ``--batch``
sequences of ``--prompt-tokens`` random tokens each decoding exactly ``--max-tokens`` tokens
(``ignore_eos``), per decode mode (``eager``; ``cuda_graph`` on a GPU).

Decode rate: each run is timed twice, generating ``--max-tokens`` and 1 token per sequence; the
difference is the time of ``max_tokens - 1`` decode steps without the prefill, so

    decode tokens/s = batch x (max_tokens - 1) / (t_full - t_one)        (medians of --repeats)

Bandwidth bound: a decode step must read every weight once (the tied embedding as the LM head) and
every cached key and value of every row; the best a step can do is those bytes at the device's
copy bandwidth, measured here (a large device-to-device copy; read + write bytes per second):

    bytes/step = weight bytes + batch x (prompt + (max_tokens - 1) / 2) x KV bytes per position
    bound tokens/s = batch / (bytes/step / copy bandwidth);   fraction = measured / bound

    python bench/rollout_gpu_decode.py                       # on a GPU: batch 1, 64, 256
    python bench/rollout_gpu_decode.py --device cpu --dtype float32 --layers 2 --batch 1 8 --max-tokens 16

The CPU form checks the script (and gives the CPU's own figure at a reduced depth).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.inference.native import NativeEngine, resolve_dtype
from hybridflow.types import GenerationRequest, SamplingParams

EOS_TOKEN_ID = 151645  # Qwen2.5's <|im_end|>; ignore_eos keeps every sequence running anyway
PAD_TOKEN_ID = 151643


def build_model(layers: int, max_positions: int) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=True, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second by a large copy on ``device`` (median of ``repeats``)."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() * 4 / statistics.median(times)


def run(engine: NativeEngine, prompts: list[list[int]], max_tokens: int, device: torch.device) -> float:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [GenerationRequest(prompt_ids=p, params=params, request_id=str(i)) for i, p in enumerate(prompts)]
    synchronize(device)
    start = time.perf_counter()
    engine.generate_batch(requests)
    synchronize(device)
    return time.perf_counter() - start


def decode_rate(engine: NativeEngine, prompts: list[list[int]], max_tokens: int, repeats: int,
                device: torch.device) -> float:
    run(engine, prompts, max_tokens, device)  # warm-up: cache sizing, kernel selection, graph captures
    full = statistics.median(run(engine, prompts, max_tokens, device) for _ in range(repeats))
    one = statistics.median(run(engine, prompts, 1, device) for _ in range(repeats))
    return len(prompts) * (max_tokens - 1) / (full - one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--layers", type=int, default=24, help="24 is the 0.5B shape; fewer for a quick check")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU runs)")
    parser.add_argument("--modes", nargs="+", default=None, help="decode modes (default: eager, plus cuda_graph on CUDA)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype)
    modes = args.modes or (["eager", "cuda_graph"] if device.type == "cuda" else ["eager"])
    reference = build_model(args.layers, args.prompt_tokens + args.max_tokens)
    weight_bytes = sum(p.numel() for p in reference.parameters()) * dtype.itemsize
    config = reference.config
    kv_bytes_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * dtype.itemsize
    bandwidth = copy_bandwidth(device, nbytes=min(1 << 30, 4 * weight_bytes))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} threads"
    print(f"device: {name}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; model: {args.layers} layers, "
          f"{weight_bytes / 1e9:.2f} GB of {args.dtype} weights; prompt {args.prompt_tokens}, {args.max_tokens} tokens")
    context = args.prompt_tokens + (args.max_tokens - 1) / 2
    generator = torch.Generator().manual_seed(0)
    for batch in args.batch:
        prompts = torch.randint(0, PAD_TOKEN_ID, (batch, args.prompt_tokens), generator=generator).tolist()
        step_bytes = weight_bytes + batch * context * kv_bytes_per_position
        bound = batch * bandwidth / step_bytes
        for mode in modes:
            engine = NativeEngine(model=build_model(args.layers, args.prompt_tokens + args.max_tokens),
                                  eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID, max_batch_size=batch,
                                  device=device, dtype=dtype, decode_mode=mode)
            rate = decode_rate(engine, prompts, args.max_tokens, args.repeats, device)
            print(f"batch {batch:4d}  {mode:10s}  {rate:10.1f} tokens/s  bound {bound:10.1f}  "
                  f"fraction {rate / bound:.2f}  ({step_bytes / 1e9:.3f} GB/step)")
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
