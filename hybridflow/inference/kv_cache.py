"""A preallocated KV cache in fixed slots: one row per decoding sequence, plus rows for prompts.

Layout: keys ``(layers, rows, KV, D, capacity)`` and values ``(layers, rows, KV, capacity, D)``.
Keys are stored transposed because a decode step's q·Kᵀ over many short rows is bound by reading
the cache, and the batched matmul reads a (D, L) key block ~1.8x faster than a transposed (L, D)
one (CPU, 512 rows x 100 positions; the values' (L, D) block is already the fast side of p·V).
Writing one token per row into the transposed layout is a strided scatter, which costs back about
a quarter of that gain.

Rows ``[0, decode_rows)`` hold decoding sequences, packed at the front (the engine moves a live
row into the hole a finished one leaves), so a decode step reads ``[:B]``, a view, and never
gathers. Rows ``[decode_rows, decode_rows + prompt_rows)`` hold prompts being prefilled, or
prefilled prompts whose samples still wait for a decode row; a sample starts by copying its
prompt's keys and values into its decode row, which is how ``n`` samples share one prefill.

Capacity (positions per row) grows on demand to the longest ``prompt + max_tokens`` admitted,
rounded up to ``CAPACITY_ALIGN``; the number of decode rows is then whatever fits the memory
budget (at most ``max_decode_rows``). That is the admission control: a sample is admitted only
into a free decode row, and a request that does not fit the budget even alone is refused.

A position beyond a row's current length may hold a previous occupant's values. Attention never
gives them weight, but a weight of exactly 0 times a non-finite value is still NaN, so rows that
produced non-finite values are zeroed (``zero_rows``) before anyone reuses them.
"""

from __future__ import annotations

import functools

import torch

from hybridflow.inference.compact import KVAccess

CAPACITY_ALIGN = 64  # positions; growing in steps avoids a reallocation per slightly longer request


class SlotKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_decode_rows: int,
        prompt_rows: int,
        memory_budget_bytes: int,
        max_capacity: int,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_decode_rows = max_decode_rows
        self.prompt_rows = prompt_rows
        self.memory_budget_bytes = memory_budget_bytes
        self.max_capacity = max_capacity  # the model's context length
        self.capacity = 0
        self.decode_rows = 0
        self.keys: torch.Tensor | None = None  # (layers, rows, KV, D, capacity)
        self.values: torch.Tensor | None = None  # (layers, rows, KV, capacity, D)
        self._generation = 0

    # ------------------------------------------------------------------ sizing

    @property
    def bytes_per_position(self) -> int:
        """Keys and values of one token in every layer."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def rows_that_fit(self, capacity: int) -> int:
        """Decode rows the budget holds at ``capacity`` positions per row, after the prompt rows."""
        row_bytes = capacity * self.bytes_per_position
        return min(self.max_decode_rows, self.memory_budget_bytes // row_bytes - self.prompt_rows)

    def aligned(self, length: int) -> int:
        return min(self.max_capacity, -(-length // CAPACITY_ALIGN) * CAPACITY_ALIGN)

    def fits_alone(self, length: int) -> bool:
        """Whether one sequence of ``length`` positions fits the budget at all."""
        return length <= self.max_capacity and self.rows_that_fit(self.aligned(max(length, self.capacity))) >= 1

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()

    @property
    def is_allocated(self) -> bool:
        return self.keys is not None

    @property
    def generation(self) -> int:
        """Counts allocations and releases: captured CUDA graphs read the tensors at fixed
        addresses and must be dropped whenever this changes (an address alone could be reused)."""
        return self._generation

    def ensure_capacity(self, length: int, live_rows: int) -> bool:
        """Make every row hold ``length`` positions, keeping rows ``[0, live_rows)`` and the prompt rows.

        Returns False (and changes nothing) when the larger rows would leave fewer decode rows than
        are live: the caller retries once enough sequences have finished.
        """
        if self.keys is not None and length <= self.capacity:
            return True
        capacity = self.aligned(max(length, self.capacity))
        rows = self.rows_that_fit(capacity)
        if rows < max(1, live_rows):
            return False
        self._reallocate(capacity, rows, live_rows)
        return True

    def _reallocate(self, capacity: int, decode_rows: int, live_rows: int) -> None:
        shape = (self.num_layers, decode_rows + self.prompt_rows, self.num_kv_heads)
        keys = torch.zeros((*shape, self.head_dim, capacity), dtype=self.dtype, device=self.device)
        values = torch.zeros((*shape, capacity, self.head_dim), dtype=self.dtype, device=self.device)
        if self.keys is not None and self.values is not None:
            old = self.capacity
            # Live decode rows keep their index; prompt rows keep their slot past the new base.
            keys[:, :live_rows, :, :, :old] = self.keys[:, :live_rows]
            values[:, :live_rows, :, :old] = self.values[:, :live_rows]
            keys[:, decode_rows:, :, :, :old] = self.keys[:, self.decode_rows :]
            values[:, decode_rows:, :, :old] = self.values[:, self.decode_rows :]
        self.keys, self.values = keys, values
        self.capacity, self.decode_rows = capacity, decode_rows
        self._generation += 1

    def release(self) -> None:
        """Free the tensors (``sleep``); ``rebuild`` or the next ``ensure_capacity`` allocates anew."""
        self.keys = self.values = None
        self._generation += 1

    def rebuild(self) -> None:
        """Allocate at the last capacity again (``wake_up``), so the first request pays nothing."""
        if self.keys is None and self.capacity:
            self._reallocate(self.capacity, self.rows_that_fit(self.capacity), 0)

    # ------------------------------------------------------------------ row operations

    def move_rows(self, destinations: list[int], sources: list[int], length: int) -> None:
        """Copy the first ``length`` positions of rows ``sources`` into rows ``destinations``."""
        keys, values = self._tensors()
        dst = torch.tensor(destinations, dtype=torch.long, device=self.device)
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        keys[:, dst, :, :, :length] = keys[:, src, :, :, :length]
        values[:, dst, :, :length] = values[:, src, :, :length]

    def copy_prompts(self, decode_rows: list[int], prompt_slots: list[int], length: int) -> None:
        """Start sequences: copy prompt slots' first ``length`` positions into decode rows."""
        self.move_rows(decode_rows, [self.decode_rows + s for s in prompt_slots], length)

    def prompt_row(self, slot: int) -> int:
        """The cache row of prompt slot ``slot``."""
        return self.decode_rows + slot

    def read_positions(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row ``row``'s keys ``(layers, KV, D, end - start)`` and values
        ``(layers, KV, end - start, D)`` at positions ``[start, end)`` (for the prefix cache)."""
        keys, values = self._tensors()
        contiguous = torch.contiguous_format
        return (keys[:, row, :, :, start:end].clone(memory_format=contiguous),
                values[:, row, :, start:end].clone(memory_format=contiguous))

    def write_positions(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys ``(layers, KV, D, N)`` and values ``(layers, KV, N, D)`` at positions
        ``[0, N)`` of row ``row`` (a prefix-cache hit restored into a prompt slot)."""
        own_keys, own_values = self._tensors()
        length = keys.shape[-1]
        own_keys[:, row, :, :, :length] = keys
        own_values[:, row, :, :length] = values

    def planned_nbytes(self, length: int) -> int:
        """Bytes the cache holds after ``ensure_capacity(length, ...)`` succeeds (the prefix cache
        gets what the budget leaves, so it makes room before the slots grow)."""
        if self.keys is not None and length <= self.capacity:
            return self.nbytes
        capacity = self.aligned(max(length, self.capacity))
        rows = max(0, self.rows_that_fit(capacity)) + self.prompt_rows
        return rows * capacity * self.bytes_per_position

    def zero_rows(self, rows: list[int]) -> None:
        if self.keys is None or self.values is None or not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.keys[:, index] = 0
        self.values[:, index] = 0

    def zero_prompt_slots(self, slots: list[int]) -> None:
        self.zero_rows([self.decode_rows + s for s in slots])

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:
            raise RuntimeError("the KV cache is released (the engine is asleep)")
        return self.keys, self.values

    # ------------------------------------------------------------------ attention access

    def decode_access(self, batch_size: int, positions: torch.Tensor, key_length: int) -> DecodeAccess:
        """Rows ``[0, batch_size)`` each write one token at ``positions`` (B,) and read ``[:key_length]``.

        The returned keys are (B, KV, D, L), already transposed for q·Kᵀ; values (B, KV, L, D).
        """
        keys, values = self._tensors()
        return DecodeAccess(keys, values, positions, batch_size, key_length)

    def prefill_access(
        self,
        prompt_slots: list[int],
        flat_index: torch.Tensor,
        flat_slots: torch.Tensor,
        flat_positions: torch.Tensor,
        key_length: int,
    ) -> KVAccess:
        """Prompt chunks, padded to (B, C): write the real tokens, read each slot's ``[:key_length]``.

        ``flat_index`` (N,) indexes the real tokens in the flattened (B C) chunk batch; they go to
        prompt slots ``flat_slots`` (N,) at ``flat_positions`` (N,). Slots count from the first
        prompt row, so decode row ``r`` is slot ``r - decode_rows`` (negative): that is how the
        engine re-prefills a running row after a weight update (partial rollout).
        """
        keys, values = self._tensors()
        base = self.decode_rows
        rows = torch.tensor([base + s for s in prompt_slots], dtype=torch.long, device=self.device)
        flat_rows = flat_slots + base

        def access(layer: int, new_keys: torch.Tensor, new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            layer_keys, layer_values = keys[layer], values[layer]
            heads = new_keys.shape[2:]  # (KV, D)
            layer_keys[flat_rows, :, :, flat_positions] = new_keys.reshape(-1, *heads)[flat_index]
            layer_values[flat_rows, :, flat_positions] = new_values.reshape(-1, *heads)[flat_index]
            return layer_keys[rows, :, :, :key_length], layer_values[rows, :, :key_length]

        return access


class DecodeAccess:
    """``SlotKVCache.decode_access``'s answer: a ``KVAccess``, and (``direct``) what a fused decode needs to write and
    read the cache itself (``cpu_decode``): the cache's tensors and the rows' positions."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, batch_size: int,
                 key_length: int) -> None:
        self.keys, self.values, self.positions = keys, values, positions  # (layers, rows, ...), (B,)
        self.batch_size, self.key_length = batch_size, key_length

    def row_range(self, start: int, end: int) -> DecodeAccess:
        """The same step's access for rows ``[start, end)`` alone (a fused decode splitting its rows over threads)."""
        return DecodeAccess(self.keys[:, start:end], self.values[:, start:end], self.positions[start:end],
                            end - start, self.key_length)

    @property
    def direct(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys (layers, rows, KV, D, capacity), values (layers, rows, KV, capacity, D), positions (B,))."""
        return self.keys, self.values, self.positions

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """``arange(B)``: made only when the access is called (a fused decode writes the cache itself)."""
        return torch.arange(self.batch_size, device=self.keys.device)

    def __call__(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer_keys, layer_values = self.keys[layer], self.values[layer]
        layer_keys[self.rows, :, :, self.positions] = new_keys[:, 0]  # (B, KV, D)
        layer_values[self.rows, :, self.positions] = new_values[:, 0]
        batch, length = self.batch_size, self.key_length
        return layer_keys[:batch, :, :, :length], layer_values[:batch, :, :length]
