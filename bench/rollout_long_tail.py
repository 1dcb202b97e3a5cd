"""Generated tokens/s on a GRPO-shaped, long-tailed workload: NativeEngine vs HF ``generate``.

Workload: ``--prompts`` chat prompts x ``--n`` samples, temperature 1, responses that end with EOS
at a per-sample length drawn from a lognormal (median ``--median-tokens``, sigma ``--sigma``),
capped at ``--max-tokens``. RL rollouts look like this: most responses are short, a few run long.

The same length oracle drives both sides: a logits processor that forbids EOS before the sample's
target length and forces it at that length (``target_lengths``). HF gets it as a ``LogitsProcessor``
(rows ordered prompt-major, as ``num_return_sequences`` expands them); the engine as a
``logits_processors`` entry keyed by request id and sample index. Both sides therefore generate
exactly the same number of tokens per sample, and the comparison is tokens/s on equal work.

Both sides decode at most ``--max-batch-size`` sequences together, on the same random-weight model
(``--model tiny``: the built-in ~0.9M-parameter Qwen2; ``--model qwen2-20m``: a ~20M-parameter
Qwen2-shaped model), with fixed torch threads. Each side gets one short untimed warm-up run, then
``--repeats`` timed runs; the median is reported with the ratio.

    python bench/rollout_long_tail.py --model tiny
    python bench/rollout_long_tail.py --model qwen2-20m
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LogitsProcessor as HFLogitsProcessor
from transformers import LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from hybridflow.inference.native import LogitsRows, NativeEngine
from hybridflow.types import GenerationRequest, SamplingParams

EOS_TOKEN_ID = 258  # <|im_end|> of the built-in tokenizer
PAD_TOKEN_ID = 256  # <|endoftext|>


def build_model(name: str) -> torch.nn.Module:
    """A random-weight model; the same seed gives both sides identical weights."""
    if name == "tiny":
        return build_tiny_model(TinyModelSpec(), seed=0)
    if name == "qwen2-20m":
        config = Qwen2Config(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=PAD_TOKEN_ID,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return Qwen2ForCausalLM(config)
    raise ValueError(f"unknown --model {name!r}")


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


def target_lengths(prompts: int, n: int, median: float, sigma: float, cap: int, seed: int = 0) -> torch.Tensor:
    """Response lengths (prompts, n), EOS included: lognormal(log median, sigma), in [1, cap]."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn((prompts, n), generator=generator, dtype=torch.float64)
    return (math.log(median) + sigma * normal).exp().round().clamp(1, cap).long()


def force_lengths(logits: torch.Tensor, generated: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The oracle: no EOS before a row's target length, only EOS at it. generated/targets (B,)."""
    logits = logits.clone()
    at_target = (generated + 1 >= targets)[:, None]  # the token being drawn is the target-th one
    eos_only = torch.full_like(logits, float("-inf"))
    eos_only[:, EOS_TOKEN_ID] = 0.0
    logits[:, EOS_TOKEN_ID] = float("-inf")
    return torch.where(at_target, eos_only, logits)


class HFOracle(HFLogitsProcessor):
    """``force_lengths`` for HF ``generate``: rows are prompt-major, ``prompt_width`` is the padded prompt."""

    def __init__(self, targets: torch.Tensor, prompt_width: int) -> None:
        self.targets = targets.reshape(-1)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = torch.full((scores.shape[0],), input_ids.shape[1] - self.prompt_width)
        return force_lengths(scores, generated, self.targets)


class EngineOracle:
    """``force_lengths`` for the engine: request id ``str(prompt index)``, sample index."""

    def __init__(self, targets: torch.Tensor) -> None:
        self.targets = targets

    def __call__(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
        prompt_rows = [int(r) for r in rows.request_ids]
        targets = self.targets[prompt_rows, rows.sample_indices]
        return force_lengths(logits, rows.output_lengths, targets)


def engine_run(engine: NativeEngine, prompts: list[list[int]], n: int, max_tokens: int) -> int:
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens)
    requests = [GenerationRequest(prompt_ids=p, params=params, request_id=str(i)) for i, p in enumerate(prompts)]
    results = engine.generate_batch(requests)
    return sum(len(t.response_ids) for trajectories in results for t in trajectories)


@torch.inference_mode()
def hf_run(
    model: torch.nn.Module, prompts: list[list[int]], targets: torch.Tensor, n: int, max_tokens: int, max_batch_size: int
) -> int:
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
            logits_processor=LogitsProcessorList([HFOracle(targets[start : start + len(chunk)], width)]),
        )
        for row in output[:, width:].tolist():
            generated += row.index(EOS_TOKEN_ID) + 1 if EOS_TOKEN_ID in row else len(row)
    return generated


def median_tokens_per_s(run: Callable[[], int], warm_up: Callable[[], int], repeats: int) -> tuple[float, int]:
    warm_up()  # first-call allocations and lazy initialisation are not throughput
    rates, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates), tokens


def add_workload_args(parser: argparse.ArgumentParser, model: str = "tiny") -> None:
    """The long-tailed GRPO workload's options (shared with ``rollout_replicas.py``)."""
    parser.add_argument("--model", default=model, choices=("tiny", "qwen2-20m"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--median-tokens", type=float, default=32.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed for comparability)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-hf", action="store_true", help="time the engine only (profiling)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    prompts = build_prompts(args.prompts)
    targets = target_lengths(args.prompts, args.n, args.median_tokens, args.sigma, args.max_tokens)
    warm = (prompts[:2], targets[:2, :2], 2, 8)  # prompts, targets, n, max_tokens of the warm-up

    engine = NativeEngine(
        model=build_model(args.model),
        eos_token_ids=[EOS_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
        max_batch_size=args.max_batch_size,
        device=args.device,
        dtype=dtype,
        seed=0,
        logits_processors=[EngineOracle(targets)],
    )
    engine_rate, engine_tokens = median_tokens_per_s(
        lambda: engine_run(engine, prompts, args.n, args.max_tokens),
        lambda: engine_run(engine, warm[0], warm[2], warm[3]),
        args.repeats,
    )
    expected = int(targets.sum())
    print(
        f"workload: {args.model}, {args.prompts} prompts x n={args.n}, lognormal lengths (median "
        f"{args.median_tokens:g}, sigma {args.sigma:g}, cap {args.max_tokens}; mean {targets.float().mean():.1f}, "
        f"max {int(targets.max())}, {expected} tokens), max_batch_size={args.max_batch_size}, {args.dtype} on "
        f"{args.device}, {args.threads} threads, median of {args.repeats}"
    )
    print(f"native_engine  {engine_rate:10.1f} tokens/s  ({engine_tokens} tokens in the last run)")
    if args.skip_hf:
        return
    hf_model = build_model(args.model).to(device=args.device, dtype=dtype).eval()
    hf_rate, hf_tokens = median_tokens_per_s(
        lambda: hf_run(hf_model, prompts, targets, args.n, args.max_tokens, args.max_batch_size),
        lambda: hf_run(hf_model, warm[0], warm[1], warm[2], warm[3], args.max_batch_size),
        args.repeats,
    )
    print(f"hf_generate    {hf_rate:10.1f} tokens/s  ({hf_tokens} tokens in the last run)")
    print(f"ratio native/hf: {engine_rate / hf_rate:.2f}x")


if __name__ == "__main__":
    main()
