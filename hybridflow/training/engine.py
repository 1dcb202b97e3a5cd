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

It is assembled from parts, each in its own module: the forward passes
(``hybridflow.training.forward``), the optimizer and schedule (``hybridflow.training.optimizer``),
checkpoints (``hybridflow.training.checkpoint``) and micro-batching
(``hybridflow.training.micro_batches``).

Two speed paths, keyword arguments (the actor turns both on by default):

- ``use_remove_padding=True``: each micro-batch runs as one packed, padding-free row
  (``hybridflow.training.packing``); results are unpacked to (b, R) before ``loss_fn`` sees
  them, so every loss works unchanged.
- ``max_token_len`` (``compute_logprobs``) / ``token_budget_micro_batches`` (for
  ``optimizer_step``): micro-batches formed by a token budget instead of a sample count
  (``hybridflow.training.micro_batches``); padded micro-batches count their padded slots.

Either way only the rows that predict a response token reach the LM head, and where the head is
a plain linear layer (one rank) the logits are never materialised: ``hybridflow.training.lm_head``
computes logprobs and entropy from the hidden states in row chunks. The inference pass can return
Σ_v π(v)² per response token from the same logits (``compute_token_stats(with_sum_pi_squared=True)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from hybridflow.training import distributed
from hybridflow.training.checkpoint import EngineCheckpoints, LoadedCheckpoint
from hybridflow.training.compile import LayerCompiler
from hybridflow.training.forward import ModelForward, Output
from hybridflow.training.lm_head import TokenStats, fused_lm_head_supported
from hybridflow.training.micro_batches import check_same_count, in_row_order, logprob_micro_batches
from hybridflow.training.optimizer import OptimSpec, build_optimizer, clip_and_step
from hybridflow.training.cpu_layer_ops import enable_fused_layer_ops
from hybridflow.training.packing import enable_varlen_attention
from hybridflow.training.sequence_parallel import enable_ulysses_attention
from hybridflow.training.sharded_checkpoint import ShardedCheckpoint
from hybridflow.types import TrainBatch

log = logging.getLogger(__name__)

# loss_fn(micro_batch, logprobs or values (b,R), entropy (b,R) | None) -> (scalar loss, metrics)
LossFn = Callable[[TrainBatch, torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, dict[str, float]]"]


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
        # The parameters a trainable-only checkpoint holds, by name (FSDP2 sharding keeps the names).
        trainable_names = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
        if varlen_attention:
            enable_varlen_attention(self.model)
        if device.type == "cpu" and not compile_layers:  # a compiled layer keeps torch's ops (the kernels are opaque)
            enable_fused_layer_ops(self.model)
        self.device = device
        self.data_parallel = data_parallel
        # FSDP2 renames the model's class (FSDPQwen2ForCausalLM): exports keep the real name.
        architecture = type(model).__name__
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
        # A CPU's reduced-precision matmuls run in oneDNN, which keeps a compiled kernel per shape:
        # bucket the shapes there (``training.packing``'s shape buckets); float32 runs in MKL, unbucketed.
        reduced = mixed_precision is not None or any(p.dtype in (torch.bfloat16, torch.float16)
                                                     for p in self.model.parameters())
        self.forward_pass = ModelForward(self.model, device, autocast_dtype=self.autocast_dtype,
                                         fused_lm_head=self.fused_lm_head, sp_group=self.sp_group,
                                         bucket_shapes=reduced and device.type == "cpu")
        self.offload_optimizer = offload_optimizer
        self.metrics_prefix = metrics_prefix
        self.optim_spec = optim
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if optim is not None:
            self.optimizer, self.scheduler = build_optimizer(self.model, optim)
        else:
            self.model.requires_grad_(False)
            self.model.eval()
        self.skipped_steps = 0
        self.checkpoints = EngineCheckpoints(
            self.model, self.optimizer, self.scheduler, device, data_parallel=data_parallel,
            checkpoint_trainable_only=checkpoint_trainable_only, trainable_names=trainable_names,
            architecture=architecture,
        )

    # ----------------------------------------------------------------- forward
    def forward_token_stats(
        self, batch: TrainBatch, temperature: float, with_entropy: bool = False, with_sum_pi_squared: bool = False,
        *, use_remove_padding: bool = False,
    ) -> TokenStats:
        """Logprobs of the response tokens (entropy, Σπ²) of one forward (``ModelForward``).  # (B, R)"""
        return self.forward_pass.forward_token_stats(batch, temperature, with_entropy, with_sum_pi_squared,
                                                     use_remove_padding=use_remove_padding)

    def forward_logprobs(
        self, batch: TrainBatch, temperature: float, with_entropy: bool = False, *, use_remove_padding: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_token_stats`` without Σπ²: (logprobs, entropy | None).  # (B, R)"""
        stats = self.forward_token_stats(batch, temperature, with_entropy, use_remove_padding=use_remove_padding)
        return stats.logprobs, stats.entropy

    def forward_values(self, batch: TrainBatch, *, use_remove_padding: bool = False) -> torch.Tensor:
        """A value model's prediction for each response token (``ModelForward``).  # (B, R)"""
        return self.forward_pass.forward_values(batch, use_remove_padding=use_remove_padding)

    @torch.no_grad()
    def compute_head_outputs(
        self,
        batch: TrainBatch,
        output: Literal["values", "scores"],
        *,
        micro_batch_size: int | None = None,
        use_remove_padding: bool = False,
        max_token_len: int | None = None,
    ) -> torch.Tensor:
        """What a model with a one-label head predicts, in the batch's row order, micro-batched as
        ``compute_logprobs``: ``"values"``, a value model's value of every response token  # (B, R);
        ``"scores"``, a sequence classifier's score of every row (``ModelForward.forward_scores``)  # (B,)"""
        return self._infer(batch, output, temperature=1.0, micro_batch_size=micro_batch_size,
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
        micro_batches, order = logprob_micro_batches(
            batch.to(self.device), micro_batch_size, max_token_len, num_micro_batches, not use_remove_padding,
            self.data_parallel,
        )
        check_same_count(len(micro_batches), f"compute_{output}", self.data_parallel)
        parts = []
        for mb in micro_batches:
            def forward(mb: TrainBatch = mb) -> TokenStats:
                return self.forward_pass.run(mb, output, temperature, with_entropy, use_remove_padding,
                                             with_sum_pi_squared)

            stats = self.compiler.run(forward) if self.compiler is not None else forward()
            parts.append([None if x is None else x.cpu() for x in stats])
        if self.data_parallel:
            distributed.reshard(self.model)  # no backward follows to free the root's gathered weights
        self.model.train(was_training)
        # Field by field: the micro-batches' rows glued, put back in the batch's row order.
        return TokenStats(*(
            None if column[0] is None else in_row_order(torch.cat(column), order) for column in zip(*parts, strict=True)
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
        trains a value model: ``loss_fn`` gets its (b, R) values and no entropy; ``output="scores"``
        a sequence classifier: its (b,) scores.
        """
        if self.optimizer is None or self.scheduler is None or self.optim_spec is None:
            raise RuntimeError("this engine was built without an optimizer (a reference model)")
        check_same_count(len(micro_batches), "optimizer_step", self.data_parallel)
        self.model.train()
        optimizer = self.optimizer

        def accumulate() -> dict[str, float]:
            optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for mb in micro_batches:
                mb = mb.to(self.device)
                stats = self.forward_pass.run(mb, output, temperature, with_entropy, use_remove_padding)
                loss, metrics = loss_fn(mb, stats.logprobs, stats.entropy)
                loss.backward()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
            return sums

        # A compile failing mid-step (a backward compiles at its first call) redoes the whole step eagerly.
        sums = self.compiler.run(accumulate) if self.compiler is not None else accumulate()
        metrics = {k: v / len(micro_batches) for k, v in sums.items()}
        lr = self.scheduler.get_last_lr()[0]  # the rate this step runs at, before the schedule moves on
        grad_norm, stepped = clip_and_step(self.model, self.optimizer, self.scheduler, self.optim_spec.grad_clip,
                                           self.device, self.offload_optimizer)
        metrics[f"{self.metrics_prefix}/grad_norm"] = float(grad_norm)
        metrics[f"{self.metrics_prefix}/lr"] = lr
        if not stepped:
            self.skipped_steps += 1
        return metrics

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

    # -------------------------------------------------------------- checkpoints
    def save_state(self, path: Path, extra: dict[str, Any]) -> None:
        """The model, optimizer and schedule with ``extra`` in one file (``EngineCheckpoints.save_state``)."""
        self.checkpoints.save_state(path, extra)

    def load_state(self, path: Path) -> dict[str, Any]:
        """Put back what ``save_state`` wrote and return its ``extra`` (``EngineCheckpoints.load_state``)."""
        return self.checkpoints.load_state(path)

    def save(self, out_dir: Path, tokenizer=None, *, sharded: bool = False) -> None:
        """A checkpoint in the full or the ``sharded`` format (``EngineCheckpoints.save``); a
        collective when data-parallel, and ``load`` reads both on any number of ranks."""
        self.checkpoints.save(out_dir, tokenizer, sharded=sharded)

    def load(self, ckpt_dir: Path) -> None:
        """Weights and, with an optimizer, its state and schedule, as ``save`` wrote them:
        ``read_checkpoint`` then ``apply_checkpoint``. Sharded: a collective."""
        self.apply_checkpoint(self.read_checkpoint(ckpt_dir))

    def read_checkpoint(self, ckpt_dir: Path) -> LoadedCheckpoint | ShardedCheckpoint:
        """Read ``ckpt_dir`` (either format) and check it against this engine, changing nothing
        (``EngineCheckpoints.read_checkpoint``); a refusal is a ``CheckpointError`` naming the file."""
        return self.checkpoints.read_checkpoint(ckpt_dir)

    def apply_checkpoint(self, loaded: LoadedCheckpoint | ShardedCheckpoint) -> None:
        """Put a checked checkpoint in place. Sharded: a collective (each rank keeps its shard)."""
        self.checkpoints.apply_checkpoint(loaded)
