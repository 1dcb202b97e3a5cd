"""Supervised fine-tuning on (prompt messages, answer) pairs, and the built-in model's warm start.

RL only improves a policy that sometimes succeeds: a random-init model never earns a reward.
The built-in tiny model therefore gets a short SFT stage made by this code (not a shipped
binary) before RL; ``scripts/make_warm_start.py`` shows how its accuracy grows with steps. The result is cached under ``warm_start.cache_dir`` keyed by every setting
that shapes it, so only the first run on a machine pays for it.

SFT reuses the RL data path: each pair becomes a ``Trajectory`` whose response is the answer
plus EOS, collated into a ``TrainBatch`` and trained with the same engine; the loss is
token-mean negative log-likelihood over the response tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.data import ResumableSampler
from hybridflow.models.loading import load_causal_lm, load_tokenizer
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories

log = logging.getLogger(__name__)

# Bump when the warm-start recipe changes so stale caches are not reused.
WARM_START_VERSION = 1


@dataclass
class SFTSpec:
    steps: int
    batch_size: int
    lr: float
    seed: int
    warmup_steps: int = 20
    teacher_slip_rate: float = 0.0  # recorded here so the cache key covers the data recipe


def sft_trajectories(pairs: list[tuple[list[dict[str, Any]], str]], tokenizer) -> list[Trajectory]:
    """Each (messages, answer) as a trajectory: templated prompt, answer tokens + EOS."""
    out = []
    for messages, answer in pairs:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        response_ids = tokenizer.encode(answer, add_special_tokens=False) + [int(tokenizer.eos_token_id)]
        n = len(response_ids)
        out.append(Trajectory(prompt_ids, response_ids, [1] * n, [0.0] * n, finish_reason="stop"))
    return out


def run_sft(
    model_dir: str | os.PathLike,
    pairs: list[tuple[list[dict[str, Any]], str]],
    out_dir: str | os.PathLike,
    spec: SFTSpec,
    device: torch.device,
    on_step: Callable[[int, TrainEngine, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Fine-tune the model in ``model_dir`` on ``pairs`` and write the result to ``out_dir``.

    ``on_step(step, engine, metrics)`` runs after every optimizer step (evaluation, snapshots).
    """
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, device=device)
    engine = TrainEngine(
        model,
        OptimSpec(lr=spec.lr, weight_decay=0.0, warmup_steps=spec.warmup_steps, scheduler="cosine",
                  min_lr_ratio=0.1, total_steps=spec.steps, grad_clip=1.0),
        device,
    )
    examples = sft_trajectories(pairs, tokenizer)
    sampler = ResumableSampler(len(examples), spec.batch_size, shuffle=True, seed=spec.seed)
    pad = int(tokenizer.pad_token_id)
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    for step in range(1, spec.steps + 1):
        batch = collate_trajectories([examples[i] for i in sampler.next_batch()], pad)
        num_tokens, _ = batch_counts(batch.response_mask)

        def nll(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
            loss = agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens)
            return loss, {"sft/loss": float(agg_loss(-logprobs.detach(), mb.response_mask, "token-mean"))}

        metrics = engine.optimizer_step([batch], nll, temperature=1.0, with_entropy=False)
        if on_step is not None:
            on_step(step, engine, metrics)
        if step % 50 == 0 or step == spec.steps:
            log.info("warm start step %d/%d  loss %.3f  %.0f s", step, spec.steps, metrics["sft/loss"],
                     time.perf_counter() - start)
    out = Path(out_dir)
    engine.model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    metrics["sft/time_s"] = time.perf_counter() - start
    return metrics


def _cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def prepare_builtin_model(
    cache_dir: str | os.PathLike,
    *,
    pairs: list[tuple[list[dict[str, Any]], str]] | None,
    pairs_key: str,
    spec: SFTSpec | None,
    device: torch.device,
    model_spec: TinyModelSpec = TinyModelSpec(),
) -> Path:
    """The built-in tiny model as an HF directory, warm-started when ``spec`` is given. Cached.

    The directory appears atomically (written under a temporary name, then renamed), so an
    interrupted warm start never leaves a half-written model that a later run would trust.
    """
    key = _cache_key({
        "version": WARM_START_VERSION,
        "model": model_spec.key(),
        "sft": None if spec is None else vars(spec),
        "data": pairs_key if spec is not None else None,
    })
    final = Path(cache_dir).expanduser() / f"builtin-tiny-{key}"
    if (final / "config.json").is_file():
        log.info("built-in model: using cached %s", final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    init_dir = tmp / "init"
    write_tiny_model(init_dir, model_spec, seed=0)
    if spec is None:
        result = init_dir
    else:
        if not pairs:
            raise ValueError("warm start needs (prompt, answer) pairs")
        log.info("built-in model: warm start (%d SFT steps, once per machine; cached in %s)", spec.steps, final)
        result = tmp / "sft"
        run_sft(init_dir, pairs, result, spec, device)
    if not final.exists():  # another process may have finished the same warm start first
        os.replace(result, final)
    shutil.rmtree(tmp, ignore_errors=True)
    return final
