"""Generated tokens/s: NativeEngine vs Hugging Face ``model.generate`` on the same workload.

Workload: the built-in tiny model, ``--prompts`` chat prompts (different lengths) x ``--n`` samples,
temperature 1, up to ``--max-tokens`` tokens each, at most ``--max-batch-size`` sequences decoded
together by both sides. Each side gets one untimed warm-up run, then ``--repeats`` timed runs;
the median is reported. Generated tokens count real tokens only: up to and including EOS, never
the padding HF appends after a finished row.

    python bench/rollout_first_engine.py --threads 2

Prints one line per side and the ratio (native / HF); above 1 means the native engine is faster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from hybridflow.rollout.native import NativeEngine
from hybridflow.types import GenerationRequest, SamplingParams

EOS_TOKEN_ID = 258  # <|im_end|> of the built-in tokenizer
PAD_TOKEN_ID = 256  # <|endoftext|>


def build_prompts(count: int) -> list[list[int]]:
    """Chat-templated arithmetic questions; operand sizes vary so prompt lengths differ."""
    tokenizer = build_tiny_tokenizer()
    prompts = []
    for i in range(count):
        a, b = 7 ** (i % 9) + i, 3 * i + 1
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def native_run(engine: NativeEngine, prompts: list[list[int]], n: int, max_tokens: int) -> int:
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens)
    results = engine.generate_batch([GenerationRequest(prompt_ids=p, params=params) for p in prompts])
    return sum(len(t.response_ids) for trajectories in results for t in trajectories)


@torch.inference_mode()
def hf_run(model: torch.nn.Module, prompts: list[list[int]], n: int, max_tokens: int, max_batch_size: int) -> int:
    """HF ``generate`` over chunks of prompts whose n samples fit ``max_batch_size`` rows."""
    prompts_per_chunk = max(1, max_batch_size // n)
    generated = 0
    for start in range(0, len(prompts), prompts_per_chunk):
        chunk = prompts[start : start + prompts_per_chunk]
        width = max(len(p) for p in chunk)
        input_ids = torch.full((len(chunk), width), PAD_TOKEN_ID, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, prompt in enumerate(chunk):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[i, width - len(prompt) :] = 1
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            num_return_sequences=n,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=PAD_TOKEN_ID,
        )
        responses = output[:, width:]
        for row in responses.tolist():
            generated += row.index(EOS_TOKEN_ID) + 1 if EOS_TOKEN_ID in row else len(row)
    return generated


def median_tokens_per_s(run: Callable[[], int], repeats: int) -> tuple[float, int]:
    run()  # warm-up: first-call allocations and lazy initialisation are not throughput
    rates, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (fixed for comparability)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    prompts = build_prompts(args.prompts)

    hf_model = build_tiny_model(TinyModelSpec(), seed=0).to(device=args.device, dtype=dtype).eval()
    engine = NativeEngine(
        model=build_tiny_model(TinyModelSpec(), seed=0),
        eos_token_ids=[EOS_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
        max_batch_size=args.max_batch_size,
        device=args.device,
        dtype=dtype,
        seed=0,
    )
    hf_rate, hf_tokens = median_tokens_per_s(
        lambda: hf_run(hf_model, prompts, args.n, args.max_tokens, args.max_batch_size), args.repeats
    )
    native_rate, native_tokens = median_tokens_per_s(
        lambda: native_run(engine, prompts, args.n, args.max_tokens), args.repeats
    )
    print(
        f"workload: {args.prompts} prompts x n={args.n}, max_tokens={args.max_tokens}, "
        f"max_batch_size={args.max_batch_size}, {args.dtype} on {args.device}, {args.threads} threads, "
        f"median of {args.repeats}"
    )
    print(f"hf_generate    {hf_rate:10.1f} tokens/s  ({hf_tokens} tokens in the last run)")
    print(f"native_engine  {native_rate:10.1f} tokens/s  ({native_tokens} tokens in the last run)")
    print(f"ratio native/hf: {native_rate / hf_rate:.2f}x")


if __name__ == "__main__":
    main()
