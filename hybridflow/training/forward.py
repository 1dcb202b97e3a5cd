"""The training engine's forward passes: per-token logprobs (entropy, Σπ²) of a causal LM, or a
value model's values, over padded rows or one packed row.

Only the rows that predict a response token reach the LM head, and where the head is a plain
linear layer (one rank) the logits are never materialised: ``hybridflow.training.lm_head``
computes logprobs and entropy from the hidden states in row chunks. A padded micro-batch runs at
its own width (``trim_padding``), not the whole step's; a packed one is unpacked to (B, R) before
anyone sees it, so every loss works unchanged. With Ulysses sequence parallelism each rank runs
its chunk of the pack and the group's tokens are gathered.
"""

from __future__ import annotations

from typing import Literal

import torch

from hybridflow.algorithms.entropy import entropy_from_logits_chunked, logprobs_from_logits, sum_pi_squared_from_logits
from hybridflow.models.scoring import last_token_scores, per_token_scores
from hybridflow.models.vision import mrope_position_ids
from hybridflow.training.lm_head import TokenStats, lm_head_token_stats
from hybridflow.training.packing import (
    PackedBatch,
    bucketed_length,
    pack_batch,
    pad_pack_to_bucket,
    pad_responses,
    trim_padding,
    unpack_responses,
)
from hybridflow.training.sequence_parallel import shard_pack
from hybridflow.types import TrainBatch

# What a forward computes: a causal LM's logprobs or a value model's values per response token, or a
# sequence classifier's (a reward model's) score per row.
Output = Literal["logprobs", "values", "scores"]


class ModelForward:
    """A (possibly sharded) model's forwards, as its ``TrainEngine`` set them up: autocast on one
    rank in mixed precision, the fused LM head where it applies, the Ulysses group if any.

    ``bucket_shapes``: packed forwards run at ``packing.bucketed_length`` tokens and the fused
    head at bucketed rows, so a run meets a bounded set of matmul shapes (why: ``packing``'s
    comment on shape buckets); the padding's results are dropped, the real rows' kept."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, autocast_dtype: torch.dtype | None,
                 fused_lm_head: bool, sp_group, bucket_shapes: bool = False) -> None:
        self.model, self.device = model, device
        self.autocast_dtype, self.fused_lm_head, self.sp_group = autocast_dtype, fused_lm_head, sp_group
        self.bucket_shapes = bucket_shapes

    def _model_pack(self, packed: PackedBatch) -> PackedBatch:
        """What the model runs of ``packed``: the pack itself, or padded to its bucket."""
        return pad_pack_to_bucket(packed) if self.bucket_shapes else packed

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
        m = rows.shape[0]
        pad = bucketed_length(m) - m if self.bucket_shapes else 0
        if pad:  # zero rows predicting token 0: computed, then dropped; no gradient reaches them
            rows = torch.cat([rows, rows.new_zeros((pad, rows.shape[1]))])
            labels = torch.cat([labels, labels.new_zeros(pad)])
        stats = lm_head_token_stats(
            rows, self.model.get_output_embeddings(), labels, temperature=temperature, with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared, compute_dtype=self.autocast_dtype or rows.dtype,
        )
        return TokenStats(*(None if x is None else x[:m] for x in stats)) if pad else stats

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
        model_pack = self._model_pack(packed)
        # Sequence parallel: this rank runs its chunk of the pack, then the group's tokens are gathered.
        shard = shard_pack(model_pack, self.sp_group) if self.sp_group is not None else None
        part = shard or model_pack
        if self.fused_lm_head:
            inputs = part.model_inputs()
            del inputs["logits_to_keep"]
            rows = self._hidden_states(**inputs)[0, part.logit_positions]  # (M, H)
            stats = self._head(rows, part.labels, temperature, with_entropy, with_sum_pi_squared)
        else:
            # Only response-predicting positions reach the LM head.  # (1, M, V) -> (M, V)
            inputs, m = part.model_inputs(), part.logit_positions.shape[0]
            if self.bucket_shapes:  # the head's rows to their bucket too: position 0's logits, dropped
                keep = inputs["logits_to_keep"]
                inputs["logits_to_keep"] = torch.cat([keep, keep.new_zeros(bucketed_length(m) - m)])
            logits = self._model(**inputs).logits[0, :m].float()
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
            model_pack = self._model_pack(packed)
            shard = shard_pack(model_pack, self.sp_group) if self.sp_group is not None else None
            part = shard or model_pack
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

    def forward_scores(self, batch: TrainBatch, *, use_remove_padding: bool = False) -> torch.Tensor:
        """A sequence classifier's score of each row, by ``hybridflow.models.scoring``'s rule (the head
        on the row's last real token), the rule a reward model serves by.  # (B,)"""
        if self.sp_group is not None:
            raise ValueError("a sequence classifier under sequence parallelism is not built")
        if batch.multi_modal is not None and any(m is not None for m in batch.multi_modal):
            raise ValueError("a sequence classifier on rows with images is not built (a reward model reads text)")
        if use_remove_padding:
            packed = pack_batch(batch)
            inputs = self._model_pack(packed).model_inputs()
            del inputs["logits_to_keep"]  # the classifier's head runs on every position
            ends = packed.cu_seqlens[1:].long() - 1  # each row's last packed token (a bucket's pad comes after)
            return per_token_scores(self.model, inputs, self._model)[0, ends].float()
        batch = trim_padding(batch)
        return last_token_scores(self.model, batch.input_ids, batch.attention_mask, batch.position_ids, self._model)

    def _refuse_padded_sequence_parallel(self) -> None:
        if self.sp_group is not None:
            raise ValueError("sequence parallelism splits packed rows: run with use_remove_padding=True")

    def run(
        self, batch: TrainBatch, output: Output, temperature: float, with_entropy: bool, use_remove_padding: bool,
        with_sum_pi_squared: bool = False,
    ) -> TokenStats:
        """``output`` per response token (and entropy, Σπ² for logprobs), or per row (scores), in the
        ``logprobs`` slot.  # (B, R) or (B,)"""
        if output == "values":
            return TokenStats(self.forward_values(batch, use_remove_padding=use_remove_padding))
        if output == "scores":
            return TokenStats(self.forward_scores(batch, use_remove_padding=use_remove_padding))
        return self.forward_token_stats(batch, temperature, with_entropy, with_sum_pi_squared,
                                        use_remove_padding=use_remove_padding)
