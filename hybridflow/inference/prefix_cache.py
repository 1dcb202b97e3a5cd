"""Keys and values of token prefixes kept across requests, in hashed fixed-size blocks (LRU).

Why: an agent's turn k+1 sends turn k's prompt + response + a tool output as its prompt, and many
requests open with one system prompt. Without a cache each of them prefills its whole history
again; with it, a request prefills only the tokens past its longest cached prefix.

A prefix is cut into blocks of ``block_size`` tokens. Block ``i`` is named by a chained digest,
``digest_i = blake2b(digest_{i-1} || tokens of block i)``, so one name stands for the whole prefix
up to the end of that block: two prompts share block ``i`` exactly when they agree on every token
before its end, whatever the request. Only full blocks are kept; the tail of a prefix shorter
than a block is always prefilled. A 128-bit digest makes a false match (which would serve another
prefix's keys) vanishingly unlikely, unlike Python's 64-bit ``hash``.

Each block holds its own tensors: keys ``(layers, KV, D, block)`` and values ``(layers, KV,
block, D)``, the slot cache's layout (``kv_cache``), so a hit is one concatenation and one copy per
side into a prompt row. Eviction drops the least recently used blocks until the cache fits its
byte limit. A lookup or insertion touches a chain deepest block first, so a chain's ancestors are
always more recent than its descendants and eviction eats prefixes from their tails: an evicted
middle block would strand every block after it.

The cache knows nothing of weights: the engine clears it when the weights change, since keys and
values computed with the old weights are stale.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Tokens per block: small enough that a turn's boundary wastes little (at most 15 tokens are
# prefilled again), large enough that a block's two tensors are not dominated by per-tensor cost.
DEFAULT_BLOCK_SIZE = 16
_DIGEST_BYTES = 16


@dataclass(frozen=True)
class CachedBlock:
    """The keys ``(layers, KV, D, block)`` and values ``(layers, KV, block, D)`` of one block."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()


def block_digests(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained digest of each full block of ``tokens``, in order."""
    digests: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("q", tokens[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=_DIGEST_BYTES).digest()
        digests.append(parent)
    return digests


class PrefixCache:
    """Blocks of cached prefixes by chained digest, least recently used first (module docstring)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"PrefixCache: block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def match(self, tokens: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix of ``tokens`` (whole blocks), touched."""
        return self.match_digests(block_digests(tokens, self.block_size))

    def match_digests(self, digests: Sequence[bytes]) -> list[CachedBlock]:
        """``match`` for a prefix given by its blocks' digests (``block_digests``)."""
        found = list(digests[: self.cached_count(digests)])
        self._touch(found)
        return [self._blocks[d] for d in found]

    def cached_count(self, digests: Sequence[bytes]) -> int:
        """How many leading blocks of ``digests`` are cached (no recency change)."""
        for index, digest in enumerate(digests):
            if digest not in self._blocks:
                return index
        return len(digests)

    def missing(self, tokens: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """All full blocks' digests of ``tokens``, and the indices of those not cached yet."""
        digests = block_digests(tokens, self.block_size)
        return digests, [i for i, d in enumerate(digests) if d not in self._blocks]

    def insert(self, digests: Sequence[bytes], blocks: dict[int, CachedBlock]) -> None:
        """Add ``blocks`` (index in ``digests`` -> block) and touch the whole chain ``digests``."""
        for index, block in blocks.items():
            digest = digests[index]
            if digest in self._blocks:
                continue
            self._blocks[digest] = block
            self._nbytes += block.nbytes
        self._touch([d for d in digests if d in self._blocks])

    def trim(self, max_bytes: int) -> int:
        """Evict least recently used blocks until at most ``max_bytes`` are held; returns how many."""
        evicted = 0
        while self._blocks and self._nbytes > max_bytes:
            _, block = self._blocks.popitem(last=False)
            self._nbytes -= block.nbytes
            evicted += 1
        return evicted

    def clear(self) -> None:
        self._blocks.clear()
        self._nbytes = 0

    def _touch(self, chain: Sequence[bytes]) -> None:
        # Deepest first, so that ancestors end up more recent than their descendants.
        for digest in reversed(chain):
            self._blocks.move_to_end(digest)
