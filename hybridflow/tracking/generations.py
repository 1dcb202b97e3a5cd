"""Generation dumps: one JSONL file per step of the samples a run generated, for reading them.

``trainer.validation_data_dir`` gets each validation's samples (verl's fields: ``input``,
``output``, ``gts``, ``score``, ``step``, then the reward function's extras such as ``acc`` and
``pred``); ``trainer.rollout_data_dir`` gets each training step's samples (``prompt``,
``response``, ``gts``, ``score``, ``advantage``, ``step``, the extras, the rollout's
per-token ``logprobs`` and each response token's text, ``tokens``, so that a reader (the live run
page, ``hybridflow dashboard``) can colour the response token by token, and ``version_runs``, the
policy version that generated those tokens as ``[version, tokens]`` runs: ``[[3, 12]]`` for a
sample version 3 generated, ``[[2, 5], [3, 7]]`` for one a weight update reached mid-way, -1 for
tokens no policy made; null where the engine does not record versions). The file is
``<dir>/<step>.jsonl``, as in verl.

Every dump is bounded, so a long run cannot fill the disk through it: at most
``max_samples`` rows per file (the first ones, in generation order: whole prompt groups first),
each text (and each other value's JSON: a ground truth can hold a whole test suite) cut to
``max_chars`` characters, and the logprobs to the first ``DUMP_MAX_LOGPROBS`` tokens, rounded to
``DUMP_LOGPROB_DECIMALS``; the token texts to as many of those tokens as fit in ``max_chars``
characters together. A row is therefore at most about 4 × max_chars characters plus 4 KB of
logprobs, their versions' runs (a few numbers: one run per weight update the sample saw) and a
few numbers more, a file max_samples times that. A cut text says so
(``TRUNCATION_MARK``), and ``response_tokens`` keeps the untruncated length.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

DUMP_MAX_LOGPROBS = 512  # tokens: enough to see where a response goes wrong, ~4 KB of JSON
DUMP_LOGPROB_DECIMALS = 4  # 1e-4 nats is below any difference worth reading
TRUNCATION_MARK = "…[+{} chars]"


def clip_text(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, saying how many were dropped."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATION_MARK.format(len(text) - max_chars)


def clip_value(value: Any, max_chars: int) -> Any:
    """A string clipped; a number as it is; anything else as is when its JSON fits in
    ``max_chars``, else its JSON text clipped."""
    if isinstance(value, str):
        return clip_text(value, max_chars)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = json.dumps(value, ensure_ascii=False, default=str)
    return value if len(text) <= max_chars else clip_text(text, max_chars)


def clip_logprobs(logprobs: Sequence[float]) -> list[float]:
    """The first ``DUMP_MAX_LOGPROBS`` logprobs, rounded."""
    return [round(float(x), DUMP_LOGPROB_DECIMALS) for x in logprobs[:DUMP_MAX_LOGPROBS]]


def clip_tokens(texts: Sequence[str], max_chars: int) -> list[str]:
    """The first token texts (at most ``DUMP_MAX_LOGPROBS``, aligned with ``clip_logprobs``) whose
    lengths add up to ``max_chars`` or less: a reader pairs ``tokens[i]`` with ``logprobs[i]``, so
    tokens are dropped whole, never cut."""
    kept: list[str] = []
    total = 0
    for text in texts[:DUMP_MAX_LOGPROBS]:
        total += len(text)
        if total > max_chars:
            break
        kept.append(text)
    return kept


def _extras(info: Mapping[str, Any], taken: Iterable[str], max_chars: int) -> dict[str, Any]:
    """The reward's extras, never overwriting a field of the row."""
    reserved = set(taken)
    return {key: clip_value(value, max_chars) for key, value in info.items() if key not in reserved}


def validation_rows(
    *, step: int, inputs: Sequence[str], outputs: Sequence[str], ground_truths: Sequence[Any],
    scores: Sequence[float], reward_infos: Sequence[Mapping[str, Any]], data_sources: Sequence[str],
    max_samples: int, max_chars: int,
) -> list[dict[str, Any]]:
    """verl's validation dump rows (``input``, ``output``, ``gts``, ``score``, ``step``, extras)."""
    rows = []
    for i in range(min(max_samples, len(inputs))):
        row = {"input": clip_text(inputs[i], max_chars), "output": clip_text(outputs[i], max_chars),
               "gts": clip_value(ground_truths[i], max_chars), "score": scores[i], "step": step,
               "data_source": data_sources[i]}
        rows.append(row | _extras(reward_infos[i], row, max_chars))
    return rows


def version_runs(token_versions: Sequence[int] | None) -> list[list[int]] | None:
    """The first ``DUMP_MAX_LOGPROBS`` token versions as ``[version, tokens]`` runs (the logprobs'
    tokens: a sample spans few versions, so this is a pair or two, not a number per token)."""
    if token_versions is None:
        return None
    runs: list[list[int]] = []
    for version in token_versions[:DUMP_MAX_LOGPROBS]:
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([version, 1])
    return runs


def rollout_rows(
    *, step: int, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[Any],
    scores: Sequence[float], advantages: Sequence[float], logprobs: Sequence[Sequence[float]],
    token_texts: Sequence[Sequence[str]], token_versions: Sequence[Sequence[int] | None],
    reward_infos: Sequence[Mapping[str, Any]], group_ids: Sequence[int], max_samples: int, max_chars: int,
) -> list[dict[str, Any]]:
    """Training rollout rows: what was generated, how it scored and what the update saw."""
    rows = []
    for i in range(min(max_samples, len(prompts))):
        row = {"prompt": clip_text(prompts[i], max_chars), "response": clip_text(responses[i], max_chars),
               "gts": clip_value(ground_truths[i], max_chars), "score": scores[i], "advantage": advantages[i],
               "step": step,
               "group_id": group_ids[i], "response_tokens": len(logprobs[i]),
               "logprobs": clip_logprobs(logprobs[i]), "tokens": clip_tokens(token_texts[i], max_chars),
               "version_runs": version_runs(token_versions[i])}
        rows.append(row | _extras(reward_infos[i], row, max_chars))
    return rows


def write_jsonl(directory: Path, step: int, rows: Sequence[Mapping[str, Any]]) -> Path:
    """``<directory>/<step>.jsonl``, one row per line (replacing an older file of that step, as
    a resumed run re-runs it); values JSON does not know are written as text."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return path


VAL_GENERATIONS_SEED = 42
"""verl's seed for picking the validation samples it logs (``trainer.log_val_generations``)."""


def pick_val_generations(inputs: Sequence[str], count: int) -> list[int]:
    """Which ``count`` of a validation's samples ``trainer.log_val_generations`` logs, as verl picks
    them: sorted by input text, shuffled with a fixed seed, the first ``count``. The same prompts
    come back at every validation, so a reader sees how the answers to them change."""
    import numpy as np

    order = sorted(range(len(inputs)), key=lambda i: inputs[i])
    np.random.RandomState(VAL_GENERATIONS_SEED).shuffle(order)
    return order[:count]

