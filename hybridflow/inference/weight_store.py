"""The native engine's weights: updates between two steps, and the storage ``sleep(level=2)`` frees.

``WeightStore.update`` holds the engine's model lock for a whole update, so no step sees half-updated
weights, and bumps two versions: an internal one, always increasing, that names which keys and
values are stale (partial rollout, see ``native``), and the policy version tokens record
(``Trajectory.token_versions``), which the trainer may set.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from hybridflow.inference.compact import CompactCausalLM
from hybridflow.transfer.weights import check_bucket, copy_bucket

ApplyBucket = Callable[[list[tuple[str, torch.Tensor]]], None]


def prepare_weights(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move ``model`` to ``device`` and cast its parameters to ``dtype`` (buffers such as RoPE
    frequencies keep their precision), with no gradients."""
    model.to(device=device)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
        data = parameter.data.to(dtype=dtype)
        # sleep(level=2) frees weights by resizing their storage in place, which memory-mapped
        # checkpoint tensors (from_pretrained on a CPU) do not allow: the engine copies those.
        parameter.data = data if data.untyped_storage().resizable() else data.clone()


class WeightStore:
    """The weights ``compact`` serves (views of ``model``'s parameters), their versions, and their
    storage while dropped. ``lock`` is the engine's model lock, held by every step."""

    def __init__(self, model: torch.nn.Module, compact: CompactCausalLM, lock: threading.Lock) -> None:
        self.model, self._compact, self._lock = model, compact, lock
        # Bumped by every weight update: keys and values computed under another version are stale.
        # Internal and always increasing, unlike the policy version a caller may set (and repeat).
        self.version = 0
        self.policy_version = 0  # what Trajectory.token_versions records (update_weights' version)
        # Set by sleep(level=2): the weights' storage is freed until a full weight update.
        self._dropped: list[tuple[torch.UntypedStorage, int]] | None = None

    @property
    def dropped(self) -> bool:
        """Whether ``sleep(level=2)`` freed the weights and no full update has brought them back."""
        return self._dropped is not None

    @property
    def nbytes(self) -> int:
        """Bytes of weight storage held: parameters (fused) and any packed copy; 0 while dropped."""
        packed = sum(t.numel() * t.element_size() for t in self._compact.packed_tensors())
        return sum(nbytes for _, nbytes in self._storages()) + packed

    @contextlib.contextmanager
    def update(self, version: int | None, on_replace: Callable[[], None]) -> Iterator[ApplyBucket]:
        """Hold the lock for a whole update; yield ``apply(bucket)``, which checks one bucket of
        ``(name, tensor)`` pairs against the model and copies it in. ``on_replace()`` runs under the
        lock before the first bucket: whatever the old weights computed must go."""
        targets = self.model.state_dict(keep_vars=True)
        covered: set[int] = set()  # ids of the parameters written, for a restore after sleep(level=2)

        def apply(bucket: list[tuple[str, torch.Tensor]]) -> None:
            check_bucket(bucket, targets)
            copy_bucket(bucket, targets)
            covered.update(id(targets[name]) for name, _ in bucket)

        with self._lock, torch.no_grad():
            self.version += 1
            self.policy_version = self.policy_version + 1 if version is None else int(version)
            on_replace()
            restoring = self._dropped is not None
            if restoring:
                self._restore()
            try:
                yield apply
                if restoring:
                    self._check_restored(covered)
            except BaseException:
                if restoring:
                    self.drop()
                raise
            finally:
                # The fused tensors changed through the HF parameters (their views); a packed copy
                # of them must follow before the next step (also after a failed update, which
                # may have applied some buckets).
                if self._dropped is None:
                    self._compact.repack()

    def drop(self) -> None:
        """Free every weight's storage in place (the caller holds the lock): views keep their shape,
        offset and stride, so the HF model and the compact forward point at the same tensors once
        it is re-allocated."""
        self._compact.release_packed()
        storages = self._storages()
        for storage, _ in storages:
            if not storage.resizable():
                raise RuntimeError(
                    "NativeEngine.sleep(level=2): a weight lives in storage that cannot be freed in place "
                    "(memory-mapped or borrowed from another library); use sleep(level=1)"
                )
        for storage, _ in storages:
            storage.resize_(0)
        self._dropped = storages

    def _storages(self) -> list[tuple[torch.UntypedStorage, int]]:
        """Each distinct storage behind the parameters (fused tensors included), with its bytes now.
        The packed copy is opaque to torch (no storage to resize): it is dropped and rebuilt whole."""
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for parameter in self.model.parameters():
            storage = parameter.data.untyped_storage()
            seen.setdefault(storage._cdata, (storage, storage.nbytes()))
        return list(seen.values())

    def _restore(self) -> None:
        assert self._dropped is not None
        for storage, nbytes in self._dropped:
            storage.resize_(nbytes)
        # Zeros rather than whatever the allocator hands back, so a parameter that a failed update
        # missed can never read as plausible weights.
        for parameter in self.model.parameters():
            parameter.data.zero_()
        self._dropped = None

    def _check_restored(self, covered: set[int]) -> None:
        """After ``sleep(level=2)`` a weight update must bring back every parameter."""
        names = {id(parameter): name for name, parameter in self.model.named_parameters()}
        missing = [name for key, name in names.items() if key not in covered]
        if missing:
            shown = ", ".join(repr(n) for n in sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
            raise RuntimeError(
                f"NativeEngine: the weights were dropped by sleep(level=2) and this update left {len(missing)} "
                f"parameters unset ({shown}); send every parameter (model.state_dict()) with update_weights"
            )
