"""Weight-sync verification: does every replica hold, after a sync, the bytes the trainer sent?

Silent corruption after a sync (a wrong copy into the model, a bad cast, a torn transfer) leaves a
run training against a policy it does not sample from, and nothing else notices. So after each
sync every replica reports a digest of what its engine holds, read from its parameters after the
copy (not from the received buffer: a wrong copy into the model is what this catches), and the
controller compares it with the digest of what it sent, cast to the dtype the replica holds (the
engine casts on copy; the same cast on the sender side gives the same bytes).

The checksum is one read of a tensor's bytes on its own device (no copy to the host): the sum of
its 64-bit words modulo 2**64, plus its trailing bytes when the size is no multiple of 8; a
fraction of the copy it checks (bench/weight_sync_verify.py). Any change confined to one word (a
flipped bit, a corrupted byte, a zeroed element) changes it; a permutation of whole words does
not, which a copy by name and shape cannot cause.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

_WRAP = 1 << 64  # checksums are sums modulo 2**64, the same on every device

# name -> (dtype as str, checksum): what a replica holds, or what the sender sent in that dtype.
Digest = dict[str, tuple[str, int]]


def tensor_checksum(tensor: torch.Tensor) -> int:
    """A 64-bit fold of ``tensor``'s bytes (module docstring); equal bytes give equal sums."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = flat.numel() // 8 * 8
    if flat.device.type == "cpu":
        # numpy's unsigned sum wraps modulo 2**64 by definition, reads unaligned words (an engine's
        # parameter may be a view at any offset of a fused buffer) and runs twice as fast as torch's.
        data = flat.numpy()
        total = int(data[:whole].view(np.uint64).sum(dtype=np.uint64)) + int(data[whole:].sum(dtype=np.uint64))
    else:  # on the tensor's device, no copy to the host; torch's int64 sum wraps the same way
        words = flat[:whole] if flat.storage_offset() % 8 == 0 else flat[:whole].clone()
        total = int(words.view(torch.int64).sum()) + int(flat[whole:].sum(dtype=torch.int64))
    return total % _WRAP


def held_digest(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> Digest:
    """The digest of ``params`` (a replica's state dict after the copy) for the synced ``names``."""
    return {name: (str(params[name].dtype), tensor_checksum(params[name])) for name in names}


def sent_checksum(tensor: torch.Tensor, dtype: str) -> int:
    """The checksum of a sent tensor as a replica holding it in ``dtype`` (``str(torch.dtype)``)
    would compute it: the engine's cast, applied here."""
    return tensor_checksum(tensor.to(getattr(torch, dtype.removeprefix("torch."))))


class WeightSyncMismatch(RuntimeError):
    """A replica holds other weights than the trainer sent; the message names replica and tensors."""


@dataclass
class SentDigests:
    """The sender's checksums, each computed once per dtype a replica reports (replicas usually
    share one dtype, so the cast and fold run once per sync, not once per replica)."""

    weights: Mapping[str, torch.Tensor]

    def __post_init__(self) -> None:
        self._cache: dict[tuple[str, str], int] = {}

    def checksum(self, name: str, dtype: str) -> int:
        key = (name, dtype)
        if key not in self._cache:
            self._cache[key] = sent_checksum(self.weights[name], dtype)
        return self._cache[key]

    def check(self, replica: str, held: Digest) -> None:
        """Raise ``WeightSyncMismatch`` naming ``replica`` and every tensor whose held bytes differ
        from the sent ones (or that the replica does not report)."""
        expected = {name: (dtype, self.checksum(name, dtype))
                    for name, (dtype, _) in held.items() if name in self.weights}
        expected.update((name, ("?", -1)) for name in self.weights if name not in held)
        compare_digests(replica, expected, held)


def compare_digests(replica: str, expected: Digest, held: Digest) -> None:
    """Raise ``WeightSyncMismatch`` naming ``replica`` and each tensor of ``expected`` (what was
    sent) that ``held`` (what the replica's engine holds) lacks or holds other bytes of."""
    missing = sorted(name for name in expected if name not in held)
    wrong = sorted(name for name in expected if name in held and held[name] != expected[name])
    if missing or wrong:
        bad = wrong + missing
        shown = ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise WeightSyncMismatch(
            f"weight sync verification failed: {replica} holds other weights than the trainer sent for "
            f"{len(wrong)} tensor(s){f' and reports no digest for {len(missing)}' if missing else ''}: {shown} "
            f"(rollout.verify_weight_sync: the transfer or the copy into the engine corrupted them)")
