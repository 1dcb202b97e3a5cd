"""A user's sampler class deciding the order of training prompts (``data.sampler.class_path`` and
``data.sampler.class_name``, verl's keys and protocol).

The class is verl's ``AbstractSampler`` without verl's base class::

    class MySampler:                     # a torch.utils.data.Sampler[int], or any iterable
        def __init__(self, data_source, data_config): ...
        def __iter__(self): ...          # one epoch: dataset indices, in the order to train on them
        def __len__(self): ...           # indices per epoch
        def update(self, batch): ...     # optional (verl's AbstractCurriculumSampler): after each step
        def state_dict(self): ...        # optional, JSON-able; with load_state_dict(state)

- ``data_source`` is the training dataset (``RLDataset``: ``len()`` rows, ``[i]`` a ``PromptRow``
  with ``messages``, ``data_source``, ``ground_truth``, ``extra_info``).
- ``data_config`` is the run's ``data`` section as an OmegaConf ``DictConfig`` (verl's type: read
  as ``data_config.seed`` or ``data_config.get("seed")``), hybridflow's key names (docs/config.md).
- ``update(batch=...)`` gets a ``SamplerFeedback`` (the step's trained samples: dataset indices,
  rewards, group ids; one entry per sample), not verl's ``DataProto``. It is called once per step
  after the update, from the trainer's thread, never at the same time as a draw.

Each epoch is one ``iter()`` of the class; a step takes the next ``batch_size`` indices
(``data.train_batch_size``, or ``data.gen_batch_size`` with dynamic sampling) and an epoch is
``len(sampler) // batch_size`` steps (verl's dataloader drops the short last batch too). When the
iterator ends before that, the short batch is dropped and the next epoch begins.

The order follows updates as soon as the loop draws: the synchronous loop draws step k+1 after
step k's update (verl forces its dataloader to 0 workers for the same reason; hybridflow never
prefetches), one_step_off draws step k+1 before step k's update, fully_async up to
``async_training.staleness_threshold`` + 1 steps ahead.

Resume. A checkpoint holds the epoch, the batches taken from it, and, for a class with
``state_dict``, its state when the epoch's ``iter()`` began and its state now. Loading puts back
the first, calls ``iter()``, skips the batches taken, then puts back the second. A class without
``state_dict`` is constructed again and replayed: ``iter()`` run out once per finished epoch, then
the current epoch's taken batches skipped. That is exact when the order depends only on the
construction (a seeded generator); a curriculum whose order depends on ``update`` needs
``state_dict`` to resume exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import numbers
import sys
import threading
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

from hybridflow.data.sampler import EpochCursor, SamplerFeedback, cursor_property

log = logging.getLogger(__name__)

PKG_PREFIX = "pkg://"
FILE_PREFIX = "file://"

# verl's two multi-turn examples name the RandomCurriculumSampler of verl's own test suite: a
# shuffling sampler whose update does nothing. verl's tests cannot be imported without verl, and
# a seeded shuffle is what it does, so that exact class is data.shuffle=true here.
VERL_TEST_RANDOM_SAMPLER = ("pkg://tests.utils.dataset.test_create_rl_sampler_on_cpu", "RandomCurriculumSampler")


_noted: list[bool] = []  # the verl test sampler's note was logged


class SamplerError(ValueError):
    """The sampler class cannot be loaded, built or used; the message names the config key, ``key``."""

    def __init__(self, message: str, key: str = "data.sampler.class_name") -> None:
        super().__init__(message)
        self.key = key


def is_verl_test_random_sampler(class_path: str | None, class_name: str | None) -> bool:
    return (class_path, class_name) == VERL_TEST_RANDOM_SAMPLER


def load_sampler_class(class_path: str, class_name: str | None) -> type:
    """The class at ``class_path`` (``pkg://package.module``, ``file://path.py``, ``path.py`` or
    ``module:Class``) named ``class_name`` (may be empty with ``module:Class``)."""
    module_ref, name = class_path, class_name
    if ":" in class_path and not class_path.startswith((PKG_PREFIX, FILE_PREFIX)) and not class_path.endswith(".py"):
        module_ref, _, name_in_path = class_path.partition(":")
        if name and name != name_in_path:
            raise SamplerError(f"data.sampler.class_path={class_path!r} names class {name_in_path!r} but "
                               f"data.sampler.class_name={class_name!r}; give one")
        module_ref, name = PKG_PREFIX + module_ref, name_in_path
    if not name:
        raise SamplerError(f"data.sampler.class_name is not set: which class of {class_path!r} samples the prompts")
    module = _import_module(module_ref)
    cls = getattr(module, name, None)
    if cls is None:
        defined = sorted(k for k, v in vars(module).items() if isinstance(v, type) and not k.startswith("_"))
        raise SamplerError(f"data.sampler.class_name={name!r}: {class_path} defines no such class "
                           f"(classes there: {', '.join(defined) or 'none'})")
    if not isinstance(cls, type):
        raise SamplerError(f"data.sampler.class_name={name!r} in {class_path} is a {type(cls).__name__}, not a class")
    return cls


def _import_module(ref: str) -> Any:
    if ref.startswith(PKG_PREFIX):
        module_name = ref[len(PKG_PREFIX):].replace("/", ".")
        try:
            return importlib.import_module(module_name)
        except ImportError as error:
            raise SamplerError(f"data.sampler.class_path={ref!r}: cannot import {module_name!r}: {error}",
                               key="data.sampler.class_path") from error
    file = Path(ref.removeprefix(FILE_PREFIX)).expanduser().resolve()
    if not file.is_file():
        raise SamplerError(f"data.sampler.class_path={ref!r}: no such file ({file})", key="data.sampler.class_path")
    # One module per file, unique by path, so two samplers both in sampler.py do not collide.
    module_name = f"hybridflow_sampler_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise SamplerError(f"data.sampler.class_path={ref!r}: {file} cannot be imported as a Python module",
                           key="data.sampler.class_path")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:  # noqa: BLE001 - re-raised naming the file and the key
        sys.modules.pop(module_name, None)
        raise SamplerError(f"data.sampler.class_path={ref!r}: importing {file} raised "
                           f"{type(error).__name__}: {error}", key="data.sampler.class_path") from error
    return module


def data_config_view(data_config: Any) -> Any:
    """The data section as the class receives it: verl's type, an OmegaConf ``DictConfig``."""
    from omegaconf import OmegaConf

    plain = dataclasses.asdict(data_config) if dataclasses.is_dataclass(data_config) else dict(data_config)
    return OmegaConf.create(plain)


class PluginSampler:
    """A ``PromptSampler`` around a user's sampler class: batches from its epochs, its ``update``
    fed after each step, its state in checkpoints (module docstring)."""

    epoch = cursor_property("epoch")
    position = cursor_property("position")

    def __init__(self, cls: type, dataset: Sized, data_config: Any, batch_size: int) -> None:
        self._cls, self._dataset, self._data_config = cls, dataset, data_config_view(data_config)
        self.batch_size = batch_size
        self.class_ref = f"{cls.__module__}:{cls.__qualname__}"
        self._lock = threading.Lock()  # draws (a rollout thread) vs update and checkpoints (the trainer's)
        self._sampler = self._construct()
        self._update = getattr(self._sampler, "update", None)
        self.resumes_by_state = callable(getattr(self._sampler, "state_dict", None)) and callable(
            getattr(self._sampler, "load_state_dict", None))
        if not callable(getattr(self._sampler, "__iter__", None)):
            raise SamplerError(f"data.sampler.class_name: {self.class_ref} has no __iter__ (it must yield dataset indices)")
        try:
            per_epoch = len(self._sampler)  # type: ignore[arg-type]
        except TypeError as error:
            raise SamplerError(f"data.sampler.class_name: {self.class_ref} has no __len__ (indices per epoch), which "
                               f"sets the steps of an epoch") from error
        self.steps_per_epoch = per_epoch // batch_size
        if self.steps_per_epoch < 1:
            raise SamplerError(f"data.sampler.class_name: {self.class_ref} yields {per_epoch} indices per epoch, fewer "
                               f"than one batch of {batch_size} prompts")
        self._cursor = EpochCursor()
        self._iterator: Iterator[Any] | None = None
        self._epoch_start_state: Any = None
        if self.resumes_by_state:
            self._checked_state()  # fail at start-up, not at the first checkpoint

    def _construct(self) -> Any:
        try:
            return self._cls(data_source=self._dataset, data_config=self._data_config)
        except Exception as error:
            raise SamplerError(f"data.sampler.class_name: {self.class_ref}(data_source, data_config) raised "
                               f"{type(error).__name__}: {error}") from error

    @property
    def instance(self) -> Any:
        """The user's sampler object itself."""
        return self._sampler

    # ------------------------------------------------------------------ drawing
    def next_batch(self) -> list[int]:
        with self._lock:
            while True:
                if self._iterator is None:
                    self._begin_epoch()
                assert self._iterator is not None
                batch = self._take(self._iterator)
                if batch is not None:
                    if self._cursor.took_batch(self.steps_per_epoch):
                        self._iterator = None
                    return batch
                self._end_epoch()  # ran out early: the short batch is dropped, as a drop_last loader does

    def _begin_epoch(self) -> None:
        if self.resumes_by_state:
            self._epoch_start_state = self._checked_state()
        self._iterator = iter(self._sampler)

    def _end_epoch(self) -> None:
        self._cursor.next_epoch()
        self._iterator = None

    def _take(self, iterator: Iterator[Any]) -> list[int] | None:
        """The next batch_size indices, checked; None when the epoch ends first."""
        batch = []
        for value in iterator:
            batch.append(self._checked_index(value))
            if len(batch) == self.batch_size:
                return batch
        return None

    def _checked_index(self, value: Any) -> int:
        if hasattr(value, "item") and not isinstance(value, numbers.Integral):
            value = value.item()  # a 0-d tensor or numpy scalar
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < len(self._dataset):
            raise SamplerError(f"data.sampler.class_name: {self.class_ref} yielded {value!r}, not an index into the "
                               f"{len(self._dataset)} training prompts")
        return int(value)

    def _skip(self, iterator: Iterator[Any], batches: int) -> int:
        """Draw and drop up to ``batches`` batches; how many there were."""
        for taken in range(batches):
            if self._take(iterator) is None:
                return taken
        return batches

    # ------------------------------------------------------------------ feedback
    def after_step(self, feedback: SamplerFeedback) -> None:
        """The class's ``update(batch=feedback)``, when it has one (verl's curriculum hook)."""
        if self._update is None:
            return
        with self._lock:
            self._update(batch=feedback)

    # ------------------------------------------------------------------ checkpoints
    def _checked_state(self) -> Any:
        state = self._sampler.state_dict()
        try:
            json.dumps(state)
        except (TypeError, ValueError) as error:
            raise SamplerError(f"data.sampler.class_name: {self.class_ref}.state_dict() must return JSON-able data "
                               f"(checkpoints keep it in trainer_state.json): {error}") from error
        return state

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            state: dict[str, Any] = {"sampler_class": self.class_ref, "epoch": self._cursor.epoch,
                                     "position": self._cursor.position,
                                     "batch_size": self.batch_size}
            if self.resumes_by_state:
                # Between epochs the next iter() starts from the state now.
                start = self._epoch_start_state if self._iterator is not None else self._checked_state()
                state |= {"epoch_start_state": start, "state": self._checked_state()}
            return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (module docstring, Resume). Raises ValueError when it was saved
        by another class or batch size, or lacks what this class needs."""
        for key, mine in (("sampler_class", self.class_ref), ("batch_size", self.batch_size)):
            if state.get(key) != mine:
                raise ValueError(f"the sampler state was saved with {key}={state.get(key)!r}, this run has {mine!r}")
        epoch, position = state.get("epoch"), state.get("position")
        if not isinstance(epoch, int) or not isinstance(position, int) or epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ValueError(f"the sampler state's epoch {epoch!r} / position {position!r} is out of range")
        if self.resumes_by_state and ("epoch_start_state" not in state or "state" not in state):
            raise ValueError(f"the sampler state has no state_dict of {self.class_ref}")
        with self._lock:
            # A fresh instance each time: a load that fails part-way leaves nothing half-replayed.
            self._sampler = self._construct()
            self._update = getattr(self._sampler, "update", None)
            self._cursor, self._iterator = EpochCursor(epoch, 0), None
            if self.resumes_by_state:
                self._sampler.load_state_dict(state["epoch_start_state"])
            else:
                for _ in range(epoch):  # replay the finished epochs' draws as they were taken
                    self._skip(iter(self._sampler), self.steps_per_epoch)
            self._begin_epoch()
            assert self._iterator is not None
            if self._skip(self._iterator, position) < position:
                raise ValueError(f"{self.class_ref} yields fewer batches in epoch {epoch} than the {position} taken")
            self._cursor.position = position
            if self.resumes_by_state:
                self._sampler.load_state_dict(state["state"])


def named_sampler_class(sampler_config: Any) -> type | None:
    """The class ``data.sampler`` names, imported; None for the built-in shuffle (nothing named,
    or verl's test RandomCurriculumSampler, noted). ``config explain`` and start-up call it."""
    class_path, class_name = sampler_config.class_path, sampler_config.class_name
    if class_path is None and class_name is None:
        return None
    if is_verl_test_random_sampler(class_path, class_name):
        if not _noted:  # once per process: start-up resolves the plug-ins, then builds the sampler
            _noted.append(True)
            log.info("data.sampler: verl's test RandomCurriculumSampler shuffles and learns nothing: hybridflow's "
                     "seeded shuffle (data.shuffle=true) does the same")
        return None
    if class_path is None:
        raise SamplerError(f"data.sampler.class_name={class_name!r} needs data.sampler.class_path (the file or "
                           f"pkg://module holding it)", key="data.sampler.class_path")
    return load_sampler_class(class_path, class_name)


def build_prompt_sampler(data_config: Any, dataset: Sized, batch_size: int, seed: int) -> Any:
    """The run's ``PromptSampler``: the class ``data.sampler`` names, or the built-in seeded
    ``ResumableSampler`` (``seed``; shuffled unless data.shuffle=false, always for verl's test sampler)."""
    from hybridflow.data.sampler import ResumableSampler

    cls = named_sampler_class(data_config.sampler)
    if cls is not None:
        return PluginSampler(cls, dataset, data_config, batch_size)
    shuffle = data_config.shuffle or data_config.sampler.class_name is not None  # verl's test sampler shuffles
    return ResumableSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed)
