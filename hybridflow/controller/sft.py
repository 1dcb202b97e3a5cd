"""Supervised fine-tuning on (prompt messages, answer) pairs, and the built-in model's warm start.

RL only improves a policy that sometimes succeeds: a random-init model never earns a reward.
The built-in tiny model therefore gets a short SFT stage made by this code (not a shipped
binary) before RL; ``scripts/make_warm_start.py`` shows how its accuracy grows with steps. The result is cached under ``warm_start.cache_dir`` keyed by every setting
that shapes it, so only the first run on a machine pays for it.

SFT reuses the RL data path: each pair becomes a ``Trajectory`` whose response is the answer
plus EOS, collated into a ``TrainBatch`` and trained with the same engine; the loss is
token-mean negative log-likelihood over the response tokens. A pair's completion may also be
a list of messages (assistant turns with tool replies between them): it is tokenised exactly as
the tool agent builds an episode (``agents.tokens.TurnTemplate``), with loss mask 0 on the
tool replies, so the warm start teaches the token sequences RL will sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from filelock import Timeout as FileLockTimeout

from hybridflow.agents.tokens import TurnTemplate
from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.data import PromptRow, ResumableSampler
from hybridflow.data.dataset import RLDataset, row_multi_modal
from hybridflow.models.loading import hf_progress_bars_off, load_causal_lm, load_tokenizer
from hybridflow.models.tiny import TinyModelSpec, TinyVLSpec, write_tiny_model, write_tiny_vl_model
from hybridflow.training import distributed
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import TrainBatch, Trajectory, collate_trajectories
from hybridflow.utils.faults import maybe_fault
from hybridflow.utils.files import give_default_modes
from hybridflow.utils.threads import adjust_threads

log = logging.getLogger(__name__)

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"  # a vision-language model's image processor
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


Message = dict[str, Any]
# (prompt messages, completion): the answer text, or the turns after the prompt (assistant
# turns, and tool or user messages between them).
SFTPair = tuple[list[Message], str | list[Message]]


def conversation_response(template: TurnTemplate, tokenizer, turns: list[Message]) -> tuple[list[int], list[int]]:
    """(response ids, loss mask) of ``turns`` as the tool agent appends them: each assistant
    turn's content and end-of-turn token (mask 1), the template's rendering of the messages
    between assistant turns (mask 0)."""
    ids: list[int] = []
    mask: list[int] = []
    pending: list[Message] = []  # non-assistant messages since the last assistant turn
    for message in turns:
        if message.get("role") != "assistant":
            pending.append(message)
            continue
        if pending:
            inserted = template.delta(pending)
            ids, mask, pending = ids + inserted, mask + [0] * len(inserted), []
        own = list(tokenizer.encode(str(message["content"]), add_special_tokens=False)) + [template.turn_end_id]
        ids, mask = ids + own, mask + [1] * len(own)
    if pending or not ids:
        raise ValueError("an SFT conversation must end with an assistant turn")
    return ids, mask


def sft_trajectories(pairs: list[SFTPair], tokenizer) -> list[Trajectory]:
    """Each (messages, completion) as a trajectory: templated prompt, then the answer tokens +
    EOS, or the conversation's turns (tool replies masked out)."""
    out = []
    template: TurnTemplate | None = None  # measured once, only for conversations
    for messages, completion in pairs:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        if isinstance(completion, str):
            response_ids = tokenizer.encode(completion, add_special_tokens=False) + [int(tokenizer.eos_token_id)]
            mask = [1] * len(response_ids)
        else:
            template = template or TurnTemplate(tokenizer)
            response_ids, mask = conversation_response(template, tokenizer, completion)
        out.append(Trajectory(prompt_ids, response_ids, mask, [0.0] * len(response_ids), finish_reason="stop"))
    return out


def nll_loss(num_tokens: int, world_size: int = 1, num_micro_batches: int = 1):
    """The SFT loss of a micro-batch: negative log-likelihood summed over its loss-masked response
    tokens, divided by ``num_tokens``, the step's masked tokens over every rank, so gradient
    accumulation over micro-batches and the gradient average over ranks (``dp_size`` undoes FSDP's
    mean) give the token mean of the whole step's batch.

    Metrics: ``sft/loss``, the micro-batch's own token mean (the engine averages it over the
    micro-batches); ``sft/loss_share``, this micro-batch's part of the step's token mean scaled by
    ``num_micro_batches`` so that the engine's average is this rank's part and the sum over
    ranks is the exact token mean of the step."""

    def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        loss = agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens, dp_size=world_size)
        nll = -logprobs.detach()
        share = float(agg_loss(nll, mb.response_mask, "token-mean", global_num_tokens=num_tokens)) * num_micro_batches
        return loss, {"sft/loss": float(agg_loss(nll, mb.response_mask, "token-mean")), "sft/loss_share": share}

    return loss_fn


def rank_rows(indices: Sequence[int], rank: int, world_size: int) -> Sequence[int]:
    """This rank's contiguous share of a step's examples (as a worker group's split_gather cuts a batch)."""
    if len(indices) % world_size:
        raise ValueError(f"a batch of {len(indices)} examples does not split over {world_size} ranks")
    share = len(indices) // world_size
    return indices[rank * share : (rank + 1) * share]


def sft_loop(
    engine: TrainEngine,
    examples: Sequence[Trajectory],
    sampler: ResumableSampler,
    steps: Iterable[int],
    *,
    pad_token_id: int,
    micro_batches: Callable[[TrainBatch], list[TrainBatch]],
    use_remove_padding: bool,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, float]:
    """The one SFT loop, of the built-in warm start and of ``hybridflow sft``: per step, the
    sampler's next batch (this rank's share of it), cut into ``micro_batches``, one optimizer step
    of ``nll_loss``; ``on_step(step, metrics)`` after each. Returns the last step's metrics, with
    ``sft/tokens``, the step's loss tokens over every rank."""
    metrics: dict[str, float] = {}
    for step in steps:
        adjust_threads()  # follow the cores other processes leave free (no-op with trainer.num_threads set)
        rows = rank_rows(sampler.next_batch(), rank, world_size)
        batch = collate_trajectories([examples[i] for i in rows], pad_token_id)
        local_tokens, _ = batch_counts(batch.response_mask)
        num_tokens = int(distributed.all_reduce_sum([local_tokens])[0]) if world_size > 1 else local_tokens
        parts = micro_batches(batch)
        metrics = engine.optimizer_step(parts, nll_loss(num_tokens, world_size, len(parts)), temperature=1.0,
                                        with_entropy=False, use_remove_padding=use_remove_padding)
        metrics["sft/tokens"] = float(num_tokens)
        if on_step is not None:
            on_step(step, metrics)
    return metrics


def image_row_trajectories(rows: Sequence[PromptRow], vision: Any, eos_token_id: int, tokenizer) -> list[Trajectory]:
    """SFT examples of dataset rows with images (a vision-language warm start): each row's prompt
    as the dataset tokenised it (image tokens expanded), its ground truth + EOS as the response,
    and its pixels, so the engine's forward sees what the rollout will."""
    out = []
    for row in rows:
        response_ids = list(tokenizer.encode(row.ground_truth, add_special_tokens=False)) + [eos_token_id]
        out.append(Trajectory(list(row.prompt_ids), response_ids, [1] * len(response_ids), [0.0] * len(response_ids),
                              finish_reason="stop", multi_modal=row_multi_modal(row, vision)))
    return out


def run_sft(
    model_dir: str | os.PathLike,
    pairs: list[SFTPair],
    out_dir: str | os.PathLike,
    spec: SFTSpec,
    device: torch.device,
    on_step: Callable[[int, TrainEngine, dict[str, float]], None] | None = None,
    examples: list[Trajectory] | None = None,
    progress_dir: Path | None = None,
) -> dict[str, float]:
    """Fine-tune the model in ``model_dir`` on ``pairs`` and write the result to ``out_dir``.

    ``progress_dir``: every ``PROGRESS_EVERY`` steps the weights, the optimizer, the schedule and
    the sampler are saved there, and a call that finds them there goes on from them: a warm start
    killed at step 400 of 500 costs 100 steps, not 500, and ends in the same weights, bitwise.

    ``on_step(step, engine, metrics)`` runs after every optimizer step (evaluation, snapshots).
    ``examples``: ready trajectories instead of ``pairs`` (``image_row_trajectories``: rows with
    images, which chat messages alone cannot carry). The image processor's file, if the model has
    one, is copied next to the result, so that it loads as the model did.
    """
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, device=device)
    engine = TrainEngine(
        model,
        OptimSpec(lr=spec.lr, weight_decay=0.0, warmup_steps=spec.warmup_steps, scheduler="cosine",
                  min_lr_ratio=0.1, total_steps=spec.steps, grad_clip=1.0),
        device,
        # The logits path, not the chunked head: the two differ only by float rounding, but the
        # built-in warm start (cached under a key that does not name the engine) amplifies rounding
        # into a different model (held-out greedy 0.17 instead of 0.32 on one CPU), and runs
        # should find the cached model equal to the one a fresh warm start would write.
        fused_lm_head=False,
    )
    if examples is None:
        examples = sft_trajectories(pairs, tokenizer)
    sampler = ResumableSampler(len(examples), spec.batch_size, shuffle=True, seed=spec.seed)
    done = _load_progress(progress_dir, engine, sampler, spec.steps) if progress_dir is not None else 0
    start = time.perf_counter()

    def report(step: int, metrics: dict[str, float]) -> None:
        if on_step is not None:
            on_step(step, engine, metrics)
        if step % 50 == 0 or step == spec.steps:
            log.info("warm start step %d/%d  loss %.3f  %.0f s", step, spec.steps, metrics["sft/loss"],
                     time.perf_counter() - start)
        if progress_dir is not None and step % PROGRESS_EVERY == 0 and step < spec.steps:
            _save_progress(progress_dir, step, engine, sampler)
        maybe_fault("warm_start_step", step)  # tests kill the warm start here and run it again

    # The whole batch as one padded micro-batch: the recipe the cached warm starts were made with.
    metrics = sft_loop(engine, examples, sampler, range(done + 1, spec.steps + 1),
                       pad_token_id=int(tokenizer.pad_token_id), micro_batches=lambda batch: [batch],
                       use_remove_padding=False, on_step=report)
    out = Path(out_dir)
    with hf_progress_bars_off():
        engine.model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if (Path(model_dir) / IMAGE_PROCESSOR_FILE).is_file():
        shutil.copyfile(Path(model_dir) / IMAGE_PROCESSOR_FILE, out / IMAGE_PROCESSOR_FILE)
    give_default_modes(out)  # safetensors writes mode 0600; a shared warm_start.cache_dir must stay readable
    metrics["sft/time_s"] = time.perf_counter() - start
    return metrics


# Warm-start steps between saves of its progress (``run_sft``'s ``progress_dir``): a save of the
# built-in model's weights and Adam moments takes ~10 MB and a fraction of a second, a step ~0.05-0.5 s.
PROGRESS_EVERY = 50
PROGRESS_FILE = "progress.pt"


def _save_progress(folder: Path, step: int, engine: TrainEngine, sampler: ResumableSampler) -> None:
    """Everything a warm start at ``step`` needs to go on as if it had not stopped, replaced whole."""
    folder.mkdir(parents=True, exist_ok=True)
    engine.save_state(folder / PROGRESS_FILE, {"step": step, "sampler": sampler.state_dict()})


def _load_progress(folder: Path, engine: TrainEngine, sampler: ResumableSampler, steps: int) -> int:
    """The steps a killed warm start made, put back from ``folder`` (0: none saved, or unreadable)."""
    path = folder / PROGRESS_FILE
    if not path.is_file():
        return 0
    try:
        extra = engine.load_state(path)
        sampler.load_state_dict(extra["sampler"])
        done = int(extra["step"])
    except Exception as error:  # our own scratch file, cut or damaged: any failure to read it
        # Half-loaded weights would not be a warm start of this recipe: start over, saying so.
        log.warning("built-in model: the warm start's saved progress %s cannot be used (%s); starting it over", path,
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        raise _StartOver from error
    log.info("built-in model: the warm start goes on at step %d of %d, where a killed run left it (%s)", done + 1,
             steps, folder)
    return done


class _StartOver(Exception):
    """A warm start's saved progress could not be used: build from the beginning."""


@dataclass(frozen=True)
class SFTStage:
    """A later stage of a warm start: ``steps`` more SFT steps on other ``pairs`` (same batch
    size; a fresh optimizer and warm-up), e.g. a curriculum that first teaches a skill on its own
    and then the mix of behaviours RL should start from."""

    pairs: list[SFTPair]
    steps: int
    lr: float | None = None  # None: the first stage's


def _cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def prepare_builtin_model(
    cache_dir: str | os.PathLike,
    *,
    pairs: list[SFTPair] | None,
    pairs_key: str,
    spec: SFTSpec | None,
    device: torch.device,
    model_spec: TinyModelSpec = TinyModelSpec(),
    stages: Sequence[SFTStage] = (),
) -> Path:
    """The built-in tiny model as an HF directory, warm-started when ``spec`` is given. Cached.

    The warm start runs ``spec.steps`` steps on ``pairs``, then each of ``stages`` in order.
    ``pairs_key`` must name all of their data. The directory appears atomically (written under
    a temporary name, then renamed), so an interrupted warm start never leaves a half-written
    model that a later run would trust.
    """
    parts: dict[str, Any] = {
        "version": WARM_START_VERSION,
        "model": model_spec.key(),
        "sft": None if spec is None else vars(spec),
        "data": pairs_key if spec is not None else None,
    }
    if spec is not None and stages:  # absent otherwise, so single-stage keys stay as they were
        parts["stages"] = [(stage.steps, stage.lr) for stage in stages]
    final = Path(cache_dir).expanduser() / f"builtin-tiny-{_cache_key(parts)}"
    return _cached_model(final, lambda tmp: _build_builtin_model(tmp, pairs=pairs, spec=spec, device=device,
                                                                 model_spec=model_spec, stages=stages))


def prepare_refined_model(base_dir: Path, *, pairs: list[SFTPair], pairs_key: str, spec: SFTSpec,
                          device: torch.device) -> Path:
    """A cached built-in model (``base_dir``, itself a cache entry) fine-tuned ``spec`` further on ``pairs``:
    cached beside it, keyed by its name, the spec and ``pairs_key`` (which must name the data), so only the
    new steps are paid for (the built-in distillation teacher: the warm start, trained on correct answers)."""
    parts = {"version": WARM_START_VERSION, "base": base_dir.name, "sft": vars(spec), "data": pairs_key}
    final = base_dir.parent / f"{base_dir.name}-refined-{_cache_key(parts)}"

    def build(tmp: Path) -> Path:
        log.info("built-in model: %d more SFT steps on %s (once per machine; cached in %s)", spec.steps, pairs_key,
                 final.parent)
        _run_stage(base_dir, pairs, tmp / "sft", spec, device)
        return tmp / "sft"

    return _cached_model(final, build)


def prepare_builtin_vl_model(
    cache_dir: str | os.PathLike,
    *,
    train_file: Path,
    data_key: str,
    spec: SFTSpec | None,
    device: torch.device,
    max_prompt_length: int,
    model_spec: TinyVLSpec = TinyVLSpec(),
) -> Path:
    """The built-in vision-language model for a visual task: a tiny random Qwen2-VL
    (``TinyVLSpec``), warm-started when ``spec`` is given by SFT on the image rows of
    ``train_file`` (each row's ground truth as the answer; ``image_row_trajectories``). A random
    model never names the colour, so RL needs this start as the text task needs its own. Cached
    under ``cache_dir`` like ``prepare_builtin_model``; ``data_key`` must name the rows."""
    parts: dict[str, Any] = {
        "version": WARM_START_VERSION,
        "model": json.dumps(dataclasses.asdict(model_spec), sort_keys=True),
        "sft": None if spec is None else vars(spec),
        "data": None if spec is None else [data_key, max_prompt_length],
    }
    final = Path(cache_dir).expanduser() / f"builtin-tiny-vl-{_cache_key(parts)}"

    def build(tmp: Path) -> Path:
        init_dir = write_tiny_vl_model(tmp / "init", model_spec, seed=0)
        if spec is None:
            return init_dir
        from hybridflow.models.vision import load_vision_processor

        tokenizer = load_tokenizer(init_dir)
        vision = load_vision_processor(init_dir, tokenizer)
        rows = list(RLDataset.from_files([str(train_file)], tokenizer, max_prompt_length=max_prompt_length,
                                         vision=vision))
        log.info("built-in vision-language model: warm start (%d SFT steps on %d image rows, once per machine; "
                 "cached in %s)", spec.steps, len(rows), final)
        _run_stage(init_dir, [], tmp / "sft", spec, device,
                   examples=image_row_trajectories(rows, vision, int(tokenizer.eos_token_id), tokenizer))
        return tmp / "sft"

    return _cached_model(final, build)


def _cached_model(final: Path, build: Callable[[Path], Path]) -> Path:
    """``final`` if it holds a model, else ``build(tmp)`` (which writes a model directory under
    the scratch folder ``tmp`` and returns it) renamed to ``final``: the directory appears
    atomically, so an interrupted warm start never leaves a half-written model that a later run
    would trust. One build per cache entry at a time: runs started together (a sweep, parallel
    tests) wait for the first to finish and reuse its model instead of each training its own."""
    if (final / "config.json").is_file():
        log.info("built-in model: using cached %s", final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.parent / f".{final.name}.lock", final):
        if (final / "config.json").is_file():
            log.info("built-in model: using %s, which another run just built", final)
            return final
        # One build at a time holds the lock, so the scratch folder needs no pid: a build killed
        # mid-way leaves it for the next one to go on from (``run_sft``'s progress).
        tmp = final.parent / f".tmp-{final.name}"
        for old in final.parent.glob(f".tmp-{final.name}-*"):  # scratch of killed builds named by pid
            log.info("built-in model: removing %s, left by a killed warm start", old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            result = build(tmp)
        except _StartOver:
            shutil.rmtree(tmp, ignore_errors=True)
            result = build(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a directory without config.json is not a model
        os.replace(result, final)
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: Path) -> Iterator[None]:
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except FileLockTimeout:
        log.info("built-in model: another run is building %s; waiting for it", what)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _build_builtin_model(
    tmp: Path,
    *,
    pairs: list[SFTPair] | None,
    spec: SFTSpec | None,
    device: torch.device,
    model_spec: TinyModelSpec,
    stages: Sequence[SFTStage],
) -> Path:
    """Write the built-in model (warm-started when ``spec`` is given) under ``tmp``; its folder."""
    init_dir = tmp / "init"
    write_tiny_model(init_dir, model_spec, seed=0)  # the same bytes every time (seed 0)
    if spec is None:
        return init_dir
    if not pairs or not all(stage.pairs for stage in stages):
        raise ValueError("warm start needs (prompt, answer) pairs")
    total = spec.steps + sum(stage.steps for stage in stages)
    log.info("built-in model: warm start (%d SFT steps, once per machine; cached in %s)", total, tmp.parent)
    result = tmp / "sft"
    _run_stage(init_dir, pairs, result, spec, device)
    for index, stage in enumerate(stages, start=1):
        previous, result = result, tmp / f"sft-{index}"
        # Its own shuffle: the stage's seed differs from the first stage's.
        stage_spec = replace(spec, steps=stage.steps, seed=spec.seed + index, lr=stage.lr or spec.lr)
        _run_stage(previous, stage.pairs, result, stage_spec, device)
    return result


def _run_stage(model_dir: Path, pairs: list[SFTPair], out: Path, spec: SFTSpec, device: torch.device,
               examples: list[Trajectory] | None = None) -> None:
    """One warm-start stage into ``out``, unless a killed build finished it already: the stage is
    written beside ``out`` and renamed into place, its progress kept until then (``run_sft``)."""
    if (out / "config.json").is_file():
        log.info("built-in model: warm-start stage %s was finished by a killed run; going on from it", out.name)
        return
    partial = out.with_name(f"{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    progress = out.with_name(f"{out.name}.progress")
    run_sft(model_dir, pairs, partial, spec, device, examples=examples, progress_dir=progress)
    os.replace(partial, out)
    shutil.rmtree(progress, ignore_errors=True)
