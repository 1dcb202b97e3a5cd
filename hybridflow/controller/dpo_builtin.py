"""Built-in preference pairs for ``hybridflow dpo``, made by our own code from the built-in model.

The built-in model's warm start imitates a flawed teacher (``warm_start.teacher_slip_rate``): it knows
the arithmetic but often writes the teacher's slip. Sampling it on the task's training prompts finds
its own wrong answers; each prompt with one gives a pair, the right answer chosen and the model's wrong
sample rejected (on-policy negatives, the pairs DPO learns most from). Held-out prompts give the
validation pairs the same way, and the held-out greedy accuracy before and after training is what the
built-in run reports. The pairs are written as JSON lines in the preference format users write, and
cached under ``warm_start.cache_dir`` keyed by the model and the settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.data.tasks.arithmetic import make_arithmetic_rows
from hybridflow.models.loading import load_causal_lm, load_tokenizer
from hybridflow.rewards.arithmetic import compute_score
from hybridflow.inference.native import NativeEngine
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory

log = logging.getLogger(__name__)

BUILTIN_SEED = 0  # the task's rows and the samples: the same pairs on every machine
MAX_ANSWER_TOKENS = 8  # the task's answers are at most a few digits and an end-of-turn token
GENERATION_BATCH = 256
PAIRS_VERSION = 1  # bump when the recipe changes, so stale cached pairs are not reused


@dataclass(frozen=True)
class BuiltinPairs:
    train_file: Path
    val_file: Path
    val_rows: list[dict[str, Any]]  # the held-out rows the greedy accuracy is measured on


def _engine(model_dir: str | os.PathLike, tokenizer) -> NativeEngine:
    model = load_causal_lm(model_dir)  # on the CPU: a few hundred short answers
    return NativeEngine(model=model, eos_token_ids=[int(tokenizer.eos_token_id)],
                        pad_token_id=int(tokenizer.pad_token_id), max_batch_size=GENERATION_BATCH,
                        seed=BUILTIN_SEED)


def _prompt_ids(tokenizer, row: dict[str, Any]) -> list[int]:
    text = tokenizer.apply_chat_template(list(row["prompt"]), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _generate(engine: NativeEngine, tokenizer, rows: list[dict[str, Any]], params: SamplingParams
              ) -> list[list[Trajectory]]:
    out: list[list[Trajectory]] = []
    for start in range(0, len(rows), GENERATION_BATCH):
        chunk = rows[start:start + GENERATION_BATCH]
        out += engine.generate_batch([GenerationRequest(_prompt_ids(tokenizer, row), params) for row in chunk])
    return out


def _correct(tokenizer, traj: Trajectory, row: dict[str, Any]) -> bool:
    text = tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    return traj.finish_reason == "stop" and compute_score(text, row["reward_model"]["ground_truth"]) > 0


def greedy_accuracy(model_dir: str | os.PathLike, rows: list[dict[str, Any]]) -> float:
    """The share of ``rows`` the model in ``model_dir`` answers right with greedy decoding."""
    tokenizer = load_tokenizer(model_dir)
    engine = _engine(model_dir, tokenizer)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
    outs = _generate(engine, tokenizer, rows, params)
    return sum(_correct(tokenizer, samples[0], row) for row, samples in zip(rows, outs, strict=True)) / len(rows)


def sample_pairs(model_dir: str | os.PathLike, rows: list[dict[str, Any]], samples: int) -> list[dict[str, Any]]:
    """One preference row per prompt whose ``samples`` samples hold a wrong answer: the right answer
    chosen, the first wrong sample rejected (as the text the model wrote)."""
    tokenizer = load_tokenizer(model_dir)
    engine = _engine(model_dir, tokenizer)
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=MAX_ANSWER_TOKENS, seed=BUILTIN_SEED)
    pairs = []
    for row, outs in zip(rows, _generate(engine, tokenizer, rows, params), strict=True):
        wrong = [t for t in outs if not _correct(tokenizer, t, row)]
        if wrong:
            rejected = tokenizer.decode(wrong[0].response_ids, skip_special_tokens=True)
            pairs.append({"prompt": list(row["prompt"]), "chosen": str(row["reward_model"]["ground_truth"]),
                          "rejected": rejected})
    return pairs


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)  # appears whole: concurrent runs may build the same file


def builtin_pairs(cache_dir: str | os.PathLike, model_dir: str, *, prompts: int, val_prompts: int,
                  samples: int) -> BuiltinPairs:
    """The built-in train and validation pair files for the model in ``model_dir`` (cached)."""
    train_rows = make_arithmetic_rows(prompts, BUILTIN_SEED, "train")
    val_rows = make_arithmetic_rows(val_prompts, BUILTIN_SEED, "test")
    key = hashlib.sha256(json.dumps([PAIRS_VERSION, Path(model_dir).name, prompts, val_prompts, samples])
                         .encode()).hexdigest()[:16]
    folder = Path(cache_dir).expanduser() / "data" / f"dpo-pairs-{key}"
    train_file, val_file = folder / "train.jsonl", folder / "test.jsonl"
    if not (train_file.is_file() and val_file.is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        log.info("dpo: sampling the built-in model on %d + %d prompts for preference pairs (once; cached in %s)",
                 prompts, val_prompts, folder)
        for rows, path in ((train_rows, train_file), (val_rows, val_file)):
            pairs = sample_pairs(model_dir, rows, samples)
            if not pairs:
                raise ValueError(f"dpo: the built-in model answered all {len(rows)} prompts right in every sample; "
                                 f"no wrong answer to reject (raise dpo.builtin_samples)")
            _write_jsonl(pairs, path)
    return BuiltinPairs(train_file, val_file, val_rows)


__all__ = ["BuiltinPairs", "builtin_pairs", "greedy_accuracy", "sample_pairs"]
