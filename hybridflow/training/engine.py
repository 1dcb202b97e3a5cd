"""The training engine: a model, its optimizer and schedule, and the two things a trainer does
with them — forward passes that return per-token logprobs (a causal LM) or values (a value
model: ``output="values"``), and optimizer steps over gradient-accumulated micro-batches with a
caller-supplied loss.

The engine knows nothing about RL: the actor passes a ``loss_fn`` (policy loss, SFT loss, ...),
the critic its value loss.
Single-process by default; with ``data_parallel=True`` (one engine per rank of a process group)
the model is sharded with FSDP2 (``hybridflow.training.distributed``) behind the same surface:
gradients are averaged over ranks, the clipping norm is global, micro-batch counts are agreed
over ranks, and weights are gathered to full tensors on rank 0; checkpoints are too (full
format) or each rank writes its own shards (``save(sharded=True)``).

Two speed paths, keyword arguments (the actor turns both on by default):

- ``use_remove_padding=True``: each micro-batch runs as one packed, padding-free row
  (``hybridflow.training.packing``); results are unpacked to (b, R) before ``loss_fn`` sees
  them, so every loss works unchanged.
- ``max_token_len`` (``compute_logprobs``) / ``token_budget_micro_batches`` (for
  ``optimizer_step``): micro-batches formed by a token budget instead of a sample count
  (``hybridflow.data.batching``); padded micro-batches count their padded slots.

Either way only the rows that predict a response token reach the LM head, and where the head is
a plain linear layer (one rank) the logits are never materialised: ``hybridflow.training.lm_head``
computes logprobs and entropy from the hidden states in row chunks. A padded micro-batch runs at
its own width (``trim_padding``), not the whole step's. The inference pass can return Σ_v π(v)²
per response token from the same logits (``compute_token_stats(with_sum_pi_squared=True)``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from hybridflow.algorithms.entropy import entropy_from_logits_chunked, logprobs_from_logits, sum_pi_squared_from_logits
from hybridflow.data.batching import padded_budget_partitions, token_budget_partitions
from hybridflow.models.vision import mrope_position_ids
from hybridflow.training import distributed, sharded_checkpoint
from hybridflow.training.compile import LayerCompiler
from hybridflow.training.lm_head import TokenStats, fused_lm_head_supported, lm_head_token_stats
from hybridflow.training.packing import (
    enable_varlen_attention,
    pack_batch,
    pad_responses,
    sequence_lengths,
    trim_padding,
    unpack_responses,
)
from hybridflow.training.sequence_parallel import enable_ulysses_attention, shard_pack
from hybridflow.training.sharded_checkpoint import ShardedCheckpoint
from hybridflow.types import TrainBatch
from hybridflow.utils.errors import CheckpointError, one_line

log = logging.getLogger(__name__)

# What a forward computes per response token: a causal LM's logprobs, or a value model's values.
Output = Literal["logprobs", "values"]
# loss_fn(micro_batch, logprobs or values (b,R), entropy (b,R) | None) -> (scalar loss, metrics)
LossFn = Callable[[TrainBatch, torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass
class OptimSpec:
    lr: float
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    scheduler: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    total_steps: int = 1
    grad_clip: float = 1.0


def _lr_lambda(spec: OptimSpec) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if spec.warmup_steps > 0 and step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        if spec.scheduler == "constant":
            return 1.0
        if spec.scheduler == "cosine":
            span = max(1, spec.total_steps - spec.warmup_steps)
            progress = min(1.0, (step - spec.warmup_steps) / span)
            cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
            return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine
        raise ValueError(f"unknown lr scheduler {spec.scheduler!r}; expected constant or cosine")

    return factor


def _budget_partitions(
    batch: TrainBatch, max_token_len: int, num_micro_batches: int | None, padded: bool
) -> list[list[int]]:
    if not padded:
        return token_budget_partitions(sequence_lengths(batch), max_token_len, num_micro_batches=num_micro_batches)
    valid = batch.attention_mask
    prompts = valid[:, : batch.prompt_length].sum(dim=1).tolist()
    responses = valid[:, batch.prompt_length :].sum(dim=1).tolist()
    return padded_budget_partitions(prompts, responses, max_token_len, num_micro_batches=num_micro_batches)


def token_budget_micro_batches(
    batch: TrainBatch, max_token_len: int, *, num_micro_batches: int | None = None, padded: bool = False
) -> tuple[list[TrainBatch], list[list[int]]]:
    """Micro-batches of at most ``max_token_len`` tokens each, heaviest first.

    Packed (``padded=False``) a micro-batch costs its valid tokens, and samples are balanced
    over micro-batches (KK); padded it costs rows x its own width, and samples of similar
    length are grouped (``hybridflow.data.batching.padded_budget_partitions``).
    ``num_micro_batches``: the count agreed over data-parallel ranks
    (``hybridflow.data.batching.agree_num_micro_batches`` over every rank's
    ``num_token_budget_micro_batches``); None uses this batch's own minimum.
    Returns the micro-batches and the row indices of ``batch`` each one holds.
    """
    partitions = _budget_partitions(batch, max_token_len, num_micro_batches, padded)
    return [batch.select(part) for part in partitions], partitions


def num_token_budget_micro_batches(batch: TrainBatch, max_token_len: int, *, padded: bool = False) -> int:
    """How many token-budget micro-batches this rank needs on its own (before agreement)."""
    return len(_budget_partitions(batch, max_token_len, None, padded))


class TrainEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimSpec | None,
        device: torch.device,
        *,
        varlen_attention: bool = True,
        data_parallel: bool = False,
        mixed_precision: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        fsdp_size: int | None = None,
        offload_params: bool = False,
        offload_optimizer: bool = False,
        fused_lm_head: bool = True,
        metrics_prefix: str = "actor",
        sequence_parallel_size: int = 1,
        checkpoint_trainable_only: bool = False,
        compile_layers: bool = False,
    ) -> None:
        """``varlen_attention``: swap a model's ``sdpa`` for the per-sequence kernel of
        ``hybridflow.training.packing`` so packed forwards cost Σ Lᵢ² instead of N² attention.
        Unpacked forwards are handed to sdpa unchanged (bit-identical); False keeps the model's
        own implementation (packing then uses transformers' block-diagonal mask).

        ``data_parallel``: this engine is one rank of the initialised default process group
        (more than one rank): shard the model with FSDP2 per decoder layer + root.
        ``mixed_precision`` (bf16): compute in this dtype over fp32 master weights, optimizer
        and gradient reduction. Sharded, FSDP2 casts the gathered parameters; on one rank the
        forward runs under ``torch.autocast``. Logprobs and losses are computed in fp32 either way.
        A model whose trained weights are bf16 (pure bf16, ``fsdp_config.model_dtype``) passes None:
        it computes, and its optimizer steps, in bf16.
        ``reduce_dtype``, ``fsdp_size`` and ``offload_params``: see ``distributed.shard_model``
        (sharded only; one unsharded rank reduces no gradients).
        ``offload_optimizer``: keep the optimizer state on the CPU between optimizer steps, so
        a colocated rollout gets that memory back (moved to the device for the step only).
        ``fused_lm_head``: compute logprobs and entropy from the hidden states in row chunks
        (``hybridflow.training.lm_head``) where the model's head is a plain linear layer and the
        model is not sharded (FSDP2 gathers the head's weight in the root module's forward).
        ``metrics_prefix``: the role an optimizer step reports as (``<prefix>/grad_norm``, ``/lr``).
        ``sequence_parallel_size`` (sp > 1, sharded only): Ulysses sequence parallelism
        (``hybridflow.training.sequence_parallel``): each block of sp consecutive ranks runs the
        same micro-batches, each rank 1/sp of every pack's tokens; packed forwards only.

        ``checkpoint_trainable_only``: checkpoints hold only the parameters that require grad (a
        LoRA actor's adapters, ``hybridflow.models.lora``), not the frozen weights that the model
        is rebuilt from anyway; the full format writes them to ``model/trainable.safetensors``.

        ``compile_layers``: torch.compile each decoder layer (``actor.use_torch_compile``;
        ``hybridflow.training.compile``), falling back to eager with a warning if compiling fails."""
        self.model = model.to(device)
        self.checkpoint_trainable_only = checkpoint_trainable_only
        # The parameters a trainable-only checkpoint holds, by name (FSDP2 sharding keeps the names).
        self.trainable_names = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
        if varlen_attention:
            enable_varlen_attention(self.model)
        self.device = device
        self.data_parallel = data_parallel
        # FSDP2 renames the model's class (FSDPQwen2ForCausalLM): exports keep the real name.
        self.architecture = type(model).__name__
        if data_parallel:
            # One rank is allowed: FSDP2 over a one-rank group is how a single GPU exercises the sharded
            # path (NCCL, DTensor parameters, CPU offload of parameters), as the GPU kit does.
            if not distributed.is_initialized():
                raise RuntimeError("data_parallel=True needs an initialised process group")
            if optim is None:
                self.model.requires_grad_(False)
            distributed.shard_model(
                self.model, mixed_precision=mixed_precision, reduce_dtype=reduce_dtype, fsdp_size=fsdp_size,
                offload_params=offload_params,
            )
        elif offload_params:
            raise ValueError("offload_params applies to the sharded (data_parallel) engine only")
        self.sp_group = None
        if sequence_parallel_size > 1:
            if not data_parallel:
                raise ValueError("sequence_parallel_size > 1 needs the sharded (data_parallel) engine")
            enable_ulysses_attention(self.model, sequence_parallel_size)
            self.sp_group = distributed.sequence_parallel_group(sequence_parallel_size)
        self.sequence_parallel_size = sequence_parallel_size
        # After sharding and the attention swaps, so FSDP2's hooks and the swapped kernels are what compiles.
        self.compiler = LayerCompiler(self.model) if compile_layers else None
        # One rank: autocast does what FSDP2's mixed-precision policy does for sharded ranks.
        self.autocast_dtype = mixed_precision if not data_parallel else None
        self.fused_lm_head = fused_lm_head and not data_parallel and fused_lm_head_supported(self.model)
        # Master weights are the trained ones: a frozen part (LoRA's base) may be stored in bf16.
        if self.autocast_dtype is not None and any(
                p.dtype != torch.float32 for p in self.model.parameters() if p.requires_grad):
            raise ValueError("mixed_precision needs fp32 master weights; load the trained weights in float32")
        self.offload_optimizer = offload_optimizer
        self.metrics_prefix = metrics_prefix
        self.optim_spec = optim
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if optim is not None:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad],
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                betas=tuple(optim.betas),
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(optim))
        else:
            self.model.requires_grad_(False)
            self.model.eval()
        self.skipped_steps = 0

    # ----------------------------------------------------------------- forward
    def _model(self, **inputs: torch.Tensor):
        """The model's forward, under autocast when one rank computes in mixed precision."""
        if self.autocast_dtype is None:
            return self.model(**inputs)
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            return self.model(**inputs)

    def _hidden_states(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The last hidden states of the model without its head (autocast as in ``_model``)."""
        base = self.model.base_model
        if self.autocast_dtype is None:
            return base(**inputs).last_hidden_state
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            return base(**inputs).last_hidden_state

    def _head(
        self, rows: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool,
        with_sum_pi_squared: bool,
    ) -> TokenStats:
        """Logprobs (entropy, Σπ²) of ``labels`` predicted by hidden ``rows``.  # (M, H) -> (M,)"""
        return lm_head_token_stats(
            rows, self.model.get_output_embeddings(), labels, temperature=temperature, with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared, compute_dtype=self.autocast_dtype or rows.dtype,
        )

    @staticmethod
    def _logits_stats(
        logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, with_sum_pi_squared: bool
    ) -> TokenStats:
        """The same from logits (the model's own head).  # (..., V) -> (...)"""
        return TokenStats(
            logprobs_from_logits(logits, labels),
            entropy_from_logits_chunked(logits) if with_entropy else None,
            sum_pi_squared_from_logits(logits) if with_sum_pi_squared else None,
        )

    def _padded_inputs(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The model's inputs for padded rows. With images (a vision-language batch) also every
        row's patches and grids in row order, the token types that mark image tokens, and M-RoPE
        position ids (3, B, L) in place of the plain ones."""
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                  "position_ids": batch.position_ids}
        images = [m for m in batch.multi_modal or () if m is not None]
        if not images:
            return inputs
        image_token_id = self.model.config.image_token_id
        if bool((batch.responses == image_token_id).any()):
            # The forward would take it for a slot of image features and fail on the count.
            raise ValueError(f"a response holds the image placeholder token {image_token_id}: a rollout engine for "
                             "vision-language models must never sample it (hf_vision filters it out)")
        grid = torch.cat([m.image_grid_thw for m in images]).to(self.device)
        inputs.update(
            pixel_values=torch.cat([m.pixel_values for m in images]).to(self.device),
            image_grid_thw=grid,
            mm_token_type_ids=(batch.input_ids == image_token_id).to(torch.int32),
            position_ids=mrope_position_ids(self.model, batch.input_ids, batch.attention_mask, grid),
        )
        return inputs

    def _response_logits(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """Logits predicting each response token: positions P-1 .. P+R-2.  # (B, R, V)"""
        r = batch.response_length
        out = self._model(
            **self._padded_inputs(batch),
            use_cache=False,
            # Only the last R+1 positions need the LM head: a long prompt never pays for it.
            logits_to_keep=r + 1,
        )
        logits = out.logits[:, :-1, :].float()
        if temperature != 1.0:
            logits = logits / temperature
        return logits

    def _forward_padded(
        self, batch: TrainBatch, temperature: float, with_entropy: bool, with_sum_pi_squared: bool
    ) -> TokenStats:
        """``forward_token_stats`` on padded rows, at the micro-batch's own width.  # (B, R)"""
        full_r = batch.response_length
        batch = trim_padding(batch)
        p = batch.prompt_length
        if self.fused_lm_head and p > 0:
            hidden = self._hidden_states(**self._padded_inputs(batch), use_cache=False)
            valid = batch.attention_mask[:, p:].bool()  # (B, R') response tokens
            # The hidden state at position P+t-1 predicts response token t; padding never reaches the head.
            rows = self._head(hidden[:, p - 1 : -1][valid], batch.responses[valid], temperature, with_entropy,
                              with_sum_pi_squared)
            zeros = torch.zeros(valid.shape, dtype=rows.logprobs.dtype, device=rows.logprobs.device)
            stats = TokenStats(*(None if x is None else zeros.masked_scatter(valid, x) for x in rows))
        else:
            stats = self._logits_stats(self._response_logits(batch, temperature), batch.responses, with_entropy,
                                       with_sum_pi_squared)
        return TokenStats(*(None if x is None else pad_responses(x, full_r) for x in stats))

    def _forward_packed(
        self, batch: TrainBatch, temperature: float, with_entropy: bool, with_sum_pi_squared: bool
    ) -> TokenStats:
        """``forward_token_stats`` on one padding-free row; results unpacked to (B, R), 0 on padding."""
        packed = pack_batch(batch)
        # Sequence parallel: this rank runs its chunk of the pack, then the group's tokens are gathered.
        shard = shard_pack(packed, self.sp_group) if self.sp_group is not None else None
        part = shard or packed
        if self.fused_lm_head:
            inputs = part.model_inputs()
            del inputs["logits_to_keep"]
            rows = self._hidden_states(**inputs)[0, part.logit_positions]  # (M, H)
            stats = self._head(rows, part.labels, temperature, with_entropy, with_sum_pi_squared)
        else:
            # Only response-predicting positions reach the LM head.  # (1, M, V) -> (M, V)
            logits = self._model(**part.model_inputs()).logits[0].float()
            if temperature != 1.0:
                logits = logits / temperature
            stats = self._logits_stats(logits, part.labels, with_entropy, with_sum_pi_squared)
        if shard is not None:
            stats = TokenStats(*(None if x is None else shard.gather(x) for x in stats))
        return TokenStats(*(None if x is None else unpack_responses(x, packed) for x in stats))

    def forward_token_stats(
        self, batch: TrainBatch, temperature: float, with_entropy: bool = False, with_sum_pi_squared: bool = False,
        *, use_remove_padding: bool = False,
    ) -> TokenStats:
        """Logprobs of the response tokens under logits/temperature (the rollout's quantity), and
        optionally their entropy and Σ_v π(v)² from the same logits.  # (B, R) each

        ``use_remove_padding``: run the batch packed. Positions past a sample's response hold 0
        or, padded, whatever the model predicts there; response_mask masks them out either way.
        """
        if use_remove_padding:
            return self._forward_packed(batch, temperature, with_entropy, with_sum_pi_squared)
        self._refuse_padded_sequence_parallel()
        return self._forward_padded(batch, temperature, with_entropy, with_sum_pi_squared)

    def forward_logprobs(
        self, batch: TrainBatch, temperature: float, with_entropy: bool = False, *, use_remove_padding: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_token_stats`` without Σπ²: (logprobs, entropy | None).  # (B, R)"""
        stats = self.forward_token_stats(batch, temperature, with_entropy, use_remove_padding=use_remove_padding)
        return stats.logprobs, stats.entropy

    def forward_values(self, batch: TrainBatch, *, use_remove_padding: bool = False) -> torch.Tensor:
        """A value model's (``load_value_model``) prediction for each response token.  # (B, R)

        Aligned as logprobs are, and as verl's critic: the value of response token t is the head
        on the hidden state at position P+t-1, the state in which token t is chosen. The whole
        model's forward runs (not the backbone alone) so that FSDP2 gathers the head with the
        root module. Values are fp32; positions past a response hold 0 (packed) or whatever the
        model predicts there (padded); response_mask masks them out either way.
        """
        if use_remove_padding:
            packed = pack_batch(batch)
            shard = shard_pack(packed, self.sp_group) if self.sp_group is not None else None
            part = shard or packed
            inputs = part.model_inputs()
            del inputs["logits_to_keep"]  # a token-classification forward returns every position
            values = self._model(**inputs).logits[0, part.logit_positions, 0].float()  # (M,)
            return unpack_responses(values if shard is None else shard.gather(values), packed)
        self._refuse_padded_sequence_parallel()
        if batch.multi_modal is not None and any(m is not None for m in batch.multi_modal):
            raise ValueError("a value model on rows with images is not built (the critic reads text only)")
        full_r = batch.response_length
        batch = trim_padding(batch)
        p = batch.prompt_length
        if p < 1:
            raise ValueError("forward_values needs at least one prompt token: the first value is read at position P-1")
        out = self._model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids, use_cache=False)
        return pad_responses(out.logits[:, p - 1 : -1, 0].float(), full_r)

    def _refuse_padded_sequence_parallel(self) -> None:
        if self.sp_group is not None:
            raise ValueError("sequence parallelism splits packed rows: run with use_remove_padding=True")

    def _forward(
        self, batch: TrainBatch, output: Output, temperature: float, with_entropy: bool, use_remove_padding: bool,
        with_sum_pi_squared: bool = False,
    ) -> TokenStats:
        """``output`` per response token (and entropy, Σπ² for logprobs) in the ``logprobs`` slot.  # (B, R)"""
        if output == "values":
            return TokenStats(self.forward_values(batch, use_remove_padding=use_remove_padding))
        return self.forward_token_stats(batch, temperature, with_entropy, with_sum_pi_squared,
                                        use_remove_padding=use_remove_padding)

    @torch.no_grad()
    def compute_values(
        self,
        batch: TrainBatch,
        *,
        micro_batch_size: int | None = None,
        use_remove_padding: bool = False,
        max_token_len: int | None = None,
    ) -> torch.Tensor:
        """A value model's values of every response token, in the batch's row order, micro-batched
        as ``compute_logprobs``.  # (B, R)"""
        return self._infer(batch, "values", temperature=1.0, micro_batch_size=micro_batch_size,
                           with_entropy=False, with_sum_pi_squared=False, use_remove_padding=use_remove_padding,
                           max_token_len=max_token_len, num_micro_batches=None).logprobs

    @torch.no_grad()
    def compute_logprobs(
        self,
        batch: TrainBatch,
        *,
        temperature: float,
        micro_batch_size: int | None = None,
        with_entropy: bool = False,
        use_remove_padding: bool = False,
        max_token_len: int | None = None,
        num_micro_batches: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropy) of every response token, in the batch's row order.  # (B, R)

        Micro-batches hold ``micro_batch_size`` rows, or, with ``max_token_len``, at most that
        many tokens (valid ones packed, padded slots padded; ``micro_batch_size`` is then ignored;
        ``num_micro_batches`` forces the count agreed over ranks). ``use_remove_padding`` runs
        each micro-batch packed.
        """
        stats = self.compute_token_stats(batch, temperature=temperature, micro_batch_size=micro_batch_size,
                                         with_entropy=with_entropy, use_remove_padding=use_remove_padding,
                                         max_token_len=max_token_len, num_micro_batches=num_micro_batches)
        return stats.logprobs, stats.entropy

    @torch.no_grad()
    def compute_token_stats(
        self,
        batch: TrainBatch,
        *,
        temperature: float,
        micro_batch_size: int | None = None,
        with_entropy: bool = False,
        with_sum_pi_squared: bool = False,
        use_remove_padding: bool = False,
        max_token_len: int | None = None,
        num_micro_batches: int | None = None,
    ) -> TokenStats:
        """``compute_logprobs``, and with ``with_sum_pi_squared`` Σ_v π(v)² of every response
        token from the same forward (verl's ``calculate_sum_pi_squared``).  # (B, R) each"""
        return self._infer(batch, "logprobs", temperature=temperature, micro_batch_size=micro_batch_size,
                           with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared,
                           use_remove_padding=use_remove_padding, max_token_len=max_token_len,
                           num_micro_batches=num_micro_batches)

    def _infer(
        self,
        batch: TrainBatch,
        output: Output,
        *,
        temperature: float,
        micro_batch_size: int | None,
        with_entropy: bool,
        with_sum_pi_squared: bool,
        use_remove_padding: bool,
        max_token_len: int | None,
        num_micro_batches: int | None,
    ) -> TokenStats:
        """``output`` (and entropy, Σπ²) of every response token over micro-batches, in row order."""
        was_training = self.model.training
        self.model.eval()
        padded = not use_remove_padding
        if self.data_parallel and max_token_len is not None and num_micro_batches is None:
            local_count = num_token_budget_micro_batches(batch, max_token_len, padded=padded)
            num_micro_batches = self.agree_num_micro_batches(local_count)
        micro_batches, order = _logprob_micro_batches(
            batch.to(self.device), micro_batch_size, max_token_len, num_micro_batches, padded
        )
        self._check_same_count(len(micro_batches), f"compute_{output}")
        parts = []
        for mb in micro_batches:
            def forward(mb: TrainBatch = mb) -> TokenStats:
                return self._forward(mb, output, temperature, with_entropy, use_remove_padding, with_sum_pi_squared)

            stats = self.compiler.run(forward) if self.compiler is not None else forward()
            parts.append([None if x is None else x.cpu() for x in stats])
        if self.data_parallel:
            distributed.reshard(self.model)  # no backward follows to free the root's gathered weights
        self.model.train(was_training)
        # Field by field: the micro-batches' rows glued, put back in the batch's row order.
        return TokenStats(*(
            None if column[0] is None else _in_row_order(torch.cat(column), order) for column in zip(*parts, strict=True)
        ))

    # ------------------------------------------------------------------- train
    def optimizer_step(
        self,
        micro_batches: list[TrainBatch],
        loss_fn: LossFn,
        *,
        temperature: float,
        with_entropy: bool,
        use_remove_padding: bool = False,
        output: Output = "logprobs",
    ) -> dict[str, float]:
        """One optimizer step over gradient-accumulated micro-batches.

        ``loss_fn`` must already normalise by the whole mini-batch (global token/sequence
        counts), so the micro-batch losses are summed, not averaged, here. Micro-batches may
        have any sizes (``token_budget_micro_batches``); ``use_remove_padding`` runs each one
        packed and still hands ``loss_fn`` (b, R) logprobs and entropy. ``output="values"``
        trains a value model: ``loss_fn`` gets its (b, R) values and no entropy.
        """
        if self.optimizer is None or self.scheduler is None or self.optim_spec is None:
            raise RuntimeError("this engine was built without an optimizer (a reference model)")
        self._check_same_count(len(micro_batches), "optimizer_step")
        self.model.train()
        optimizer = self.optimizer

        def accumulate() -> dict[str, float]:
            optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for mb in micro_batches:
                mb = mb.to(self.device)
                stats = self._forward(mb, output, temperature, with_entropy, use_remove_padding)
                loss, metrics = loss_fn(mb, stats.logprobs, stats.entropy)
                loss.backward()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
            return sums

        # A compile failing mid-step (a backward compiles at its first call) redoes the whole step eagerly.
        sums = self.compiler.run(accumulate) if self.compiler is not None else accumulate()
        metrics = {k: v / len(micro_batches) for k, v in sums.items()}
        clip = self.optim_spec.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        # Sharded gradients (DTensors) give the norm over every rank's shard: the global norm.
        grad_norm = distributed.full_tensor(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
        metrics[f"{self.metrics_prefix}/grad_norm"] = float(grad_norm)
        metrics[f"{self.metrics_prefix}/lr"] = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self._move_optimizer_state(self.device)
            self.optimizer.step()
            self.scheduler.step()
            if self.offload_optimizer:
                self._move_optimizer_state(torch.device("cpu"))
        else:
            # A non-finite gradient would poison the weights and Adam's moments: skip the step.
            # The LR schedule holds too, so a skipped step costs nothing but its data.
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _move_optimizer_state(self, device: torch.device) -> None:
        """Adam's moments to ``device`` (no-op where they already are)."""
        assert self.optimizer is not None
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device and key != "step":
                    state[key] = value.to(device, non_blocking=True)

    # ------------------------------------------------------- data parallelism
    def agree_num_micro_batches(self, local_count: int) -> int:
        """The micro-batch count every rank runs: the largest any rank needs. FSDP2 runs
        collectives in each forward and backward, so ranks must run the same number."""
        return distributed.all_reduce_max(local_count) if self.data_parallel else local_count

    def _check_same_count(self, count: int, where: str) -> None:
        """Refuse, on every rank at once, a call where ranks would run different numbers of
        forwards (each rank would wait forever in the other's missing all-gather)."""
        if not self.data_parallel:
            return
        low, high = -distributed.all_reduce_max(-count), distributed.all_reduce_max(count)
        if low != high:
            raise RuntimeError(
                f"{where}: ranks have between {low} and {high} micro-batches; every rank must run the same "
                f"number (agree on it with agree_num_micro_batches)"
            )

    # ------------------------------------------------------------- weights/IO
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and buffers by HF name, all at once (the object-store sync: one object).

        Sharded: a collective that gathers full tensors to rank 0 (CPU); other ranks get []."""
        if self.data_parallel:
            return list(distributed.gather_model_state(self.model).items())
        return list(self.model.state_dict().items())

    def named_weight_shards(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and buffers by HF name as this rank holds them, nothing gathered or copied:
        the model's own tensors on one rank, DTensors when sharded (their shape, dtype and numel
        are the full tensor's). Every rank lists the same names, shapes and order, so buckets
        planned from them agree across ranks; ``distributed.gather_weight`` gathers one (a
        collective), ``distributed.lead_bucket_gathers`` streams them bucket by bucket."""
        return list(self.model.state_dict().items())

    def save_state(self, path: Path, extra: dict[str, Any]) -> None:
        """The model, optimizer and schedule with ``extra`` (plain values and tensors) in one file,
        replaced whole (a kill mid-write leaves the previous file). For a run's own scratch progress
        (the warm start's), not a checkpoint: no manifest, one rank, read back by ``load_state``."""
        assert self.optimizer is not None and self.scheduler is not None
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "extra": extra}
        partial = path.with_name(f".{path.name}.tmp")
        torch.save(state, partial)
        os.replace(partial, path)

    def load_state(self, path: Path) -> dict[str, Any]:
        """Put back what ``save_state`` wrote (tensors only: ``weights_only``, nothing unpickled runs)
        and return its ``extra``; any failure to read it raises."""
        assert self.optimizer is not None and self.scheduler is not None
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["extra"]

    def save(self, out_dir: Path, tokenizer=None, *, sharded: bool = False) -> None:
        """Full format: HF safetensors of the full model under ``model/`` and ``optim.pt`` with the
        optimizer (single-process layout) and schedule; several ranks gather to rank 0, which
        writes. ``sharded``: every rank writes its own shards of the model and the optimizer,
        nothing gathered (``hybridflow.training.sharded_checkpoint``). Either way a collective
        when data-parallel, and ``load`` reads both on any number of ranks."""
        if sharded:
            self._save_sharded(out_dir, tokenizer)
            return
        if self.checkpoint_trainable_only:
            self._save_trainable(out_dir, tokenizer)
            return
        if self.data_parallel:
            self._save_gathered(out_dir, tokenizer)
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir / "model", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir / "model")
        if self.optimizer is not None and self.scheduler is not None:
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                out_dir / OPTIM_FILE,
            )

    def _save_sharded(self, out_dir: Path, tokenizer) -> None:
        rank = distributed.rank() if self.data_parallel else 0
        if rank == 0:
            self._save_model_files(out_dir / "model", tokenizer)
            if self.optimizer is not None and self.scheduler is not None:
                (out_dir / sharded_checkpoint.OPTIM_JSON).write_text(
                    sharded_checkpoint.optim_json(self.model, self.optimizer, self.scheduler)
                )
        entries = self._model_entries()
        if self.optimizer is not None:
            entries |= sharded_checkpoint.optimizer_entries(self.model, self.optimizer)
        sharded_checkpoint.save_dcp(entries, out_dir / sharded_checkpoint.DCP_DIR, no_dist=not self.data_parallel)
        sharded_checkpoint.save_rng(out_dir / sharded_checkpoint.RNG_DIR, rank, self.device)
        # Nobody reads the checkpoint (or renames its folder) before every rank has written.
        distributed.barrier()

    def _model_entries(self) -> dict[str, torch.Tensor]:
        """The model tensors a checkpoint holds (``sharded_checkpoint.model_entries``), only the
        trainable ones with ``checkpoint_trainable_only``."""
        entries = sharded_checkpoint.model_entries(self.model)
        if not self.checkpoint_trainable_only:
            return entries
        prefix = sharded_checkpoint.MODEL_PREFIX
        return {k: v for k, v in entries.items() if k.removeprefix(prefix) in self.trainable_names}

    def _save_trainable(self, out_dir: Path, tokenizer) -> None:
        """Full format, trainable parameters only: each gathered alone (a collective when sharded,
        small next to the model) and written by rank 0 with the optimizer state."""
        from safetensors.torch import save_file

        trainable = {name: distributed.gather_weight(value).detach().cpu().contiguous()
                     for name, value in self.model.state_dict().items() if name in self.trainable_names}
        optim_state = None
        if self.optimizer is not None and self.scheduler is not None:
            optim_state = (distributed.gather_optimizer_state(self.model, self.optimizer) if self.data_parallel
                           else self.optimizer.state_dict())
        if not self.data_parallel or distributed.is_rank_zero():
            out_dir.mkdir(parents=True, exist_ok=True)
            self._save_model_files(out_dir / "model", tokenizer)
            save_file(trainable, out_dir / "model" / TRAINABLE_FILE, metadata={"format": "pt"})
            if optim_state is not None:
                assert self.scheduler is not None
                torch.save({"optimizer": optim_state, "scheduler": self.scheduler.state_dict()}, out_dir / OPTIM_FILE)
        distributed.barrier()

    def _save_model_files(self, model_dir: Path, tokenizer) -> None:
        """The HF files of the model without its weights: config (the real class), generation
        config, tokenizer. An export adds the weights from the shards."""
        model_dir.mkdir(parents=True, exist_ok=True)
        self.model.config.save_pretrained(model_dir)
        _restore_architecture(model_dir, self.architecture)
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(model_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(model_dir)

    def _save_gathered(self, out_dir: Path, tokenizer) -> None:
        weights = distributed.gather_model_state(self.model)
        optim_state = (
            distributed.gather_optimizer_state(self.model, self.optimizer) if self.optimizer is not None else {}
        )
        if distributed.is_rank_zero():
            out_dir.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out_dir / "model", state_dict=weights, safe_serialization=True)
            _restore_architecture(out_dir / "model", self.architecture)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir / "model")
            if self.optimizer is not None and self.scheduler is not None:
                torch.save({"optimizer": optim_state, "scheduler": self.scheduler.state_dict()}, out_dir / OPTIM_FILE)
        # Nobody reads the checkpoint (or renames its folder) before rank 0 has finished writing.
        distributed.barrier()

    def load(self, ckpt_dir: Path) -> None:
        """Weights and, with an optimizer, its state and schedule, as ``save`` wrote them:
        ``read_checkpoint`` then ``apply_checkpoint``. Sharded: a collective."""
        self.apply_checkpoint(self.read_checkpoint(ckpt_dir))

    def read_checkpoint(self, ckpt_dir: Path) -> LoadedCheckpoint | ShardedCheckpoint:
        """Read ``ckpt_dir`` (either format) and check it against this engine, changing nothing:
        the name and shape of every weight and optimizer moment, and the schedule. Only the files
        ``save`` writes are read: the weight files that the safetensors index names (or
        ``model.safetensors``), never a glob; of a sharded checkpoint, its metadata and
        ``optim.json`` (the shards are read when applied). A refusal is a ``CheckpointError``
        naming the file. Sharded: no collective runs here, so every rank refuses alike."""
        if sharded_checkpoint.is_sharded_checkpoint(ckpt_dir):
            return self._read_sharded(ckpt_dir)
        trainable_file = ckpt_dir / "model" / TRAINABLE_FILE
        if self.checkpoint_trainable_only != trainable_file.is_file():
            saved, wanted = ("only trainable parameters", "the whole model") if trainable_file.is_file() else (
                "the whole model", "only trainable parameters")
            raise CheckpointError(f"{ckpt_dir / 'model'} holds {saved} but this engine loads {wanted}: a LoRA "
                                  f"checkpoint resumes with the actor.lora it was saved with")
        if self.checkpoint_trainable_only:
            weights = _read_weight_file(trainable_file, {})
        else:
            weights = _read_weights(ckpt_dir / "model")
        self._check_weights({k: tuple(v.shape) for k, v in weights.items()}, ckpt_dir / "model")
        optim_state = None
        if self.optimizer is not None and self.scheduler is not None:
            optim_state = _read_optimizer_file(ckpt_dir / OPTIM_FILE)
            self._check_optimizer_state(optim_state, ckpt_dir / OPTIM_FILE)
        return LoadedCheckpoint(ckpt_dir, weights, optim_state)

    def _read_sharded(self, ckpt_dir: Path) -> ShardedCheckpoint:
        dcp_dir = ckpt_dir / sharded_checkpoint.DCP_DIR
        metadata = sharded_checkpoint.read_metadata(dcp_dir)
        shapes = sharded_checkpoint.tensor_shapes(metadata, sharded_checkpoint.MODEL_PREFIX)
        self._check_weights({k: shape for k, (shape, _) in shapes.items()}, dcp_dir / sharded_checkpoint.METADATA_FILE)
        optim = None
        if self.optimizer is not None and self.scheduler is not None:
            optim = sharded_checkpoint.read_optim_json(ckpt_dir / sharded_checkpoint.OPTIM_JSON)
            sharded_checkpoint.check_optimizer(self.model, self.optimizer, metadata, optim, ckpt_dir)
        return ShardedCheckpoint(ckpt_dir, metadata, optim)

    def apply_checkpoint(self, loaded: LoadedCheckpoint | ShardedCheckpoint) -> None:
        """Put a checked checkpoint in place. Sharded: a collective (each rank keeps its shard)."""
        try:
            if isinstance(loaded, ShardedCheckpoint):
                self._apply_sharded(loaded)
            else:
                self._apply_full(loaded)
        except Exception as exc:
            raise CheckpointError(f"{loaded.path}: loading failed after its files were checked: {one_line(exc)}") from exc

    def _apply_full(self, loaded: LoadedCheckpoint) -> None:
        if self.data_parallel:
            distributed.load_model_state(self.model, loaded.weights)
        else:
            self.model.load_state_dict(loaded.weights, strict=False)
        if loaded.optim_state is not None:
            assert self.optimizer is not None and self.scheduler is not None
            if self.data_parallel:
                distributed.load_optimizer_state(self.model, self.optimizer, loaded.optim_state["optimizer"])
            else:
                self.optimizer.load_state_dict(loaded.optim_state["optimizer"])
            self._load_schedule(loaded.optim_state["scheduler"])

    def _apply_sharded(self, loaded: ShardedCheckpoint) -> None:
        """Every rank reads its part of every tensor into fresh buffers (one collective), so the
        engine changes only once the whole checkpoint has been read: a load holds one extra shard
        (this rank's model and optimizer) while it runs, never the whole model."""
        model_buffers = {k: torch.empty_like(v) for k, v in self._model_entries().items()}
        optim_buffers = {}
        if loaded.optim is not None:
            assert self.optimizer is not None
            optim_buffers = sharded_checkpoint.optimizer_buffers(self.model, self.optimizer, loaded.metadata)
        sharded_checkpoint.load_dcp(model_buffers | optim_buffers, loaded.path / sharded_checkpoint.DCP_DIR,
                                    no_dist=not self.data_parallel)
        with torch.no_grad():
            for key, value in self._model_entries().items():
                value.copy_(model_buffers[key])
        if loaded.optim is not None:
            assert self.optimizer is not None
            self.optimizer.load_state_dict(sharded_checkpoint.optimizer_state(self.optimizer, optim_buffers, loaded.optim))
            self._load_schedule(loaded.optim["scheduler"])
        rank = distributed.rank() if self.data_parallel else 0
        if not sharded_checkpoint.load_rng(loaded.path / sharded_checkpoint.RNG_DIR, rank, self.device):
            log.info("%s holds no RNG state for rank %d (saved on fewer ranks): it keeps its own", loaded.path, rank)

    def _load_schedule(self, saved: dict) -> None:
        assert self.scheduler is not None
        # Only the schedule's own keys: load_state_dict sets whatever it is given as attributes.
        own = self.scheduler.state_dict()
        self.scheduler.load_state_dict({k: saved[k] for k in own if k in saved})

    def _check_weights(self, shapes: dict[str, tuple[int, ...]], model_dir: Path) -> None:
        """Same names and shapes as the model (DTensor shapes are the full ones when sharded)."""
        expected = {name: tuple(t.shape) for name, t in self.model.state_dict().items()
                    if not self.checkpoint_trainable_only or name in self.trainable_names}
        # Tied embeddings are saved once; anything else missing is a real problem.
        missing = [k for k in expected if k not in shapes and not k.endswith("lm_head.weight")]
        unexpected = [k for k in shapes if k not in expected]
        wrong = [f"{k} {shape} (the model has {expected[k]})" for k, shape in shapes.items()
                 if k in expected and shape != expected[k]]
        if missing or unexpected or wrong:
            problems = [f"{label} {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
                        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
            raise CheckpointError(f"the weights in {model_dir} do not match the model: {'; '.join(problems)}")

    def _check_optimizer_state(self, state: object, path: Path) -> None:
        """The single-process ``optimizer.state_dict()`` layout for this optimizer's parameters."""
        assert self.optimizer is not None and self.scheduler is not None

        def refuse(why: str) -> CheckpointError:
            return CheckpointError(f"{path} does not match this model's optimizer: {why}")

        if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict) or not isinstance(state.get("scheduler"), dict):
            raise refuse("expected a dict with 'optimizer' and 'scheduler' state")
        groups, moments = state["optimizer"].get("param_groups"), state["optimizer"].get("state")
        if not isinstance(groups, list) or not isinstance(moments, dict) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
        ):
            raise refuse("expected 'param_groups' (each with 'params') and 'state'")
        shapes = [[tuple(p.shape) for p in g["params"]] for g in self.optimizer.param_groups]
        if [len(g["params"]) for g in groups] != [len(s) for s in shapes]:
            raise refuse(f"parameters per group {[len(g['params']) for g in groups]}, the model has {[len(s) for s in shapes]}")
        shape_of = {pid: shape for g, group_shapes in zip(groups, shapes, strict=True)
                    for pid, shape in zip(g["params"], group_shapes, strict=True)}
        for pid, entry in moments.items():
            if pid not in shape_of or not isinstance(entry, dict):
                raise refuse(f"state for unknown parameter {pid!r}")
            for key, value in entry.items():
                # Adam's moments have the parameter's shape; its step count is a scalar.
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape_of[pid]:
                    raise refuse(f"{key} of parameter {pid} has shape {tuple(value.shape)}, the parameter {shape_of[pid]}")
        missing = [k for k in ("last_epoch", "base_lrs") if k not in state["scheduler"]]
        if missing or not isinstance(state["scheduler"].get("last_epoch"), int):
            raise refuse(f"the schedule state lacks an integer last_epoch and base_lrs (missing {missing})")


OPTIM_FILE = "optim.pt"
TRAINABLE_FILE = "trainable.safetensors"  # a trainable-only checkpoint's weights (full format)
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass
class LoadedCheckpoint:
    """A checkpoint read and checked by ``TrainEngine.read_checkpoint``, not yet applied."""

    path: Path
    weights: dict[str, torch.Tensor]
    optim_state: dict | None  # {"optimizer": ..., "scheduler": ...}; None without an optimizer


def _weight_files(model_dir: Path) -> list[Path]:
    """The files ``save_pretrained`` wrote: the shards its index names, or its one file."""
    index = model_dir / SAFETENSORS_INDEX
    if not index.is_file():
        return [model_dir / "model.safetensors"]
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        # A shard is a plain file name next to the index, never a path elsewhere.
        if not names or not all(isinstance(n, str) and n == Path(n).name and n not in (".", "..") for n in names):
            raise ValueError("weight_map must name files in its own folder")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{index} is corrupt: {one_line(exc)}") from exc
    return [model_dir / n for n in names]


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        weights.update(_read_weight_file(path, weights))
    return weights


def _read_weight_file(path: Path, earlier: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors, refused if it repeats a name of ``earlier`` shards."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        tensors = load_file(path)
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise CheckpointError(f"{path} is not a readable safetensors file: {one_line(exc)}") from exc
    repeated = sorted(set(tensors) & set(earlier))
    if repeated:
        raise CheckpointError(f"{path} repeats weights of another shard: {', '.join(repeated[:3])}")
    return tensors


def _read_optimizer_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint holds no optimizer state")
    try:
        # weights_only: tensors and plain containers only; a pickle that would build other
        # objects (and so could run code) is refused before anything in it executes.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: refused to load optimizer state: {one_line(exc)}") from exc


def _restore_architecture(model_dir: Path, architecture: str) -> None:
    """config.json names the class a loader should build: the model's own, not FSDP's wrapper."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [architecture]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _logprob_micro_batches(
    batch: TrainBatch, micro_batch_size: int | None, max_token_len: int | None, num_micro_batches: int | None,
    padded: bool,
) -> tuple[list[TrainBatch], torch.Tensor | None]:
    """Micro-batches for a logprob pass and, when they reorder rows, the row ids in their order."""
    if max_token_len is not None:
        micro_batches, partitions = token_budget_micro_batches(
            batch, max_token_len, num_micro_batches=num_micro_batches, padded=padded
        )
        return micro_batches, torch.tensor([i for part in partitions for i in part], dtype=torch.long)
    if micro_batch_size is None:
        raise ValueError("compute_logprobs needs micro_batch_size or max_token_len")
    return batch.split(micro_batch_size), None


def _in_row_order(values: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Rows computed in micro-batch order ``order`` (row ids) put back in the batch's order."""
    if order is None:
        return values
    restored = torch.empty_like(values)
    restored[order] = values
    return restored
