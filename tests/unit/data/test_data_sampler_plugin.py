"""data.sampler.class_path/class_name: a user's sampler class orders the prompts, learns from each
step through update(batch), and resumes to the uninterrupted run's order."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

import pytest
from omegaconf import DictConfig

from hybridflow.config import load_config
from hybridflow.data.sampler import ResumableSampler, SamplerFeedback
from hybridflow.data.sampler_plugin import (
    VERL_TEST_RANDOM_SAMPLER,
    PluginSampler,
    SamplerError,
    build_prompt_sampler,
    load_sampler_class,
)

SAMPLERS = '''
import torch


class Reversed:
    """Every epoch: the last row first."""

    def __init__(self, data_source, data_config):
        self.n = len(data_source)
        self.seed = data_config.seed
        self.shuffle = data_config.get("shuffle")

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class SeededRandom:
    """A fresh permutation per epoch from a generator seeded once: no state_dict."""

    def __init__(self, data_source, data_config):
        self.n = len(data_source)
        self.generator = torch.Generator().manual_seed(7)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())

    def __len__(self):
        return self.n


class HardestFirst:
    """A curriculum: each draw takes the unvisited row with the lowest mean reward so far (unseen
    rows count as 0.5), read lazily, so an update reorders the rest of the epoch."""

    def __init__(self, data_source, data_config):
        self.n = len(data_source)
        self.scores = {}
        self.updates = []

    def __iter__(self):
        left = set(range(self.n))
        while left:
            pick = min(left, key=lambda i: (self.scores.get(str(i), 0.5), i))
            left.discard(pick)
            yield pick

    def __len__(self):
        return self.n

    def update(self, batch):
        self.updates.append(batch)
        for index, score in batch.mean_score_by_index().items():
            self.scores[str(index)] = score

    def state_dict(self):
        return {"scores": dict(self.scores)}

    def load_state_dict(self, state):
        self.scores = dict(state["scores"])


class Unsized:
    def __init__(self, data_source, data_config):
        pass

    def __iter__(self):
        return iter([0, 1])


class OutOfRange:
    def __init__(self, data_source, data_config):
        self.n = len(data_source)

    def __iter__(self):
        return iter([self.n] * self.n)

    def __len__(self):
        return self.n


class TensorState(Reversed):
    def state_dict(self):
        return {"generator": torch.Generator().get_state()}

    def load_state_dict(self, state):
        pass
'''


@dataclass
class Data:
    """The data section's fields a sampler reads (the typed DataConfig is passed in the run)."""

    seed: int = 3
    shuffle: bool = True
    sampler: Any = field(default_factory=dict)


@pytest.fixture
def sampler_file(tmp_path):
    path = tmp_path / "my_samplers.py"
    path.write_text(SAMPLERS)
    return path


def plugin(path, name: str, rows: int = 10, batch: int = 3) -> PluginSampler:
    return PluginSampler(load_sampler_class(str(path), name), list(range(rows)), Data(), batch)


def feedback(step: int, batch: list[int], scores: dict[int, float]) -> SamplerFeedback:
    """Two samples per prompt, both scored ``scores[index]``."""
    rows = [i for i in batch for _ in range(2)]
    return SamplerFeedback(step=step, indices=rows, scores=[scores[i] for i in rows],
                           group_ids=[g for g in range(len(batch)) for _ in range(2)])


def test_the_class_orders_the_prompts_epoch_by_epoch_dropping_the_short_batch(sampler_file):
    s = plugin(sampler_file, "Reversed")
    assert s.steps_per_epoch == 3  # 10 // 3, as verl's drop_last dataloader
    assert [s.next_batch() for _ in range(4)] == [[9, 8, 7], [6, 5, 4], [3, 2, 1], [9, 8, 7]]
    assert (s.epoch, s.position) == (1, 1)


def test_the_class_gets_the_dataset_and_the_data_section_as_a_dictconfig(sampler_file):
    s = plugin(sampler_file, "Reversed")
    assert isinstance(s._data_config, DictConfig)
    assert (s.instance.n, s.instance.seed, s.instance.shuffle) == (10, 3, True)


@pytest.mark.parametrize("spelling", ["file", "pkg", "module"])
def test_class_path_spellings(sampler_file, monkeypatch, spelling):
    monkeypatch.syspath_prepend(str(sampler_file.parent))
    path, name = {"file": (f"file://{sampler_file}", "Reversed"), "pkg": ("pkg://my_samplers", "Reversed"),
                  "module": ("my_samplers:Reversed", None)}[spelling]
    assert load_sampler_class(path, name).__name__ == "Reversed"


def test_update_is_fed_and_reorders_what_is_drawn_next(sampler_file):
    s = plugin(sampler_file, "HardestFirst", rows=6, batch=2)
    first = s.next_batch()
    assert first == [0, 1]  # all unseen: by index
    s.after_step(feedback(1, first, {0: 1.0, 1: 0.0}))
    (update,) = s.instance.updates
    assert update.indices == [0, 0, 1, 1] and update.scores == [1.0, 1.0, 0.0, 0.0]
    assert s.next_batch() == [2, 3]
    s.after_step(feedback(2, [2, 3], {2: 0.2, 3: 0.9}))
    assert s.next_batch() == [4, 5]
    # Epoch 2 starts from the hardest: 1 (0.0), 2 (0.2), then 4 and 5 (0.5, unseen).
    assert [s.next_batch() for _ in range(2)] == [[1, 2], [4, 5]]


def drive(s: PluginSampler, steps: int, start: int = 1) -> list[list[int]]:
    """Draw and feed ``steps`` steps with scores a fixed function of the index."""
    drawn = []
    for step in range(start, start + steps):
        batch = s.next_batch()
        drawn.append(batch)
        s.after_step(feedback(step, batch, {i: (i * 37 % 11) / 10 for i in batch}))
    return drawn


@pytest.mark.parametrize("name", ["HardestFirst", "SeededRandom"])  # with state_dict, and replayed without
@pytest.mark.parametrize("cut", [1, 3, 4, 5])  # mid-epoch, at the boundary, into the second epoch
def test_resume_continues_the_uninterrupted_order(sampler_file, name, cut):
    whole = drive(plugin(sampler_file, name, rows=9, batch=2), 10)
    first = plugin(sampler_file, name, rows=9, batch=2)
    before = drive(first, cut)
    state = json.loads(json.dumps(first.state_dict()))  # as trainer_state.json keeps it
    resumed = plugin(sampler_file, name, rows=9, batch=2)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (first.epoch, first.position)
    assert before + drive(resumed, 10 - cut, start=cut + 1) == whole


def test_a_state_from_another_class_or_batch_size_is_refused(sampler_file):
    s = plugin(sampler_file, "HardestFirst")
    s.next_batch()
    state = s.state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        plugin(sampler_file, "HardestFirst", batch=2).load_state_dict(state)
    with pytest.raises(ValueError, match="sampler_class"):
        plugin(sampler_file, "SeededRandom").load_state_dict(state)
    with pytest.raises(ValueError, match="sampler_class"):
        plugin(sampler_file, "HardestFirst").load_state_dict(ResumableSampler(10, 3).state_dict())


@pytest.mark.parametrize(("name", "message"), [
    ("Missing", "defines no such class.*Reversed"),
    ("Unsized", "no __len__"),
    ("TensorState", "JSON-able"),
])
def test_a_class_that_cannot_serve_fails_at_start_up(sampler_file, name, message):
    with pytest.raises(SamplerError, match=message):
        plugin(sampler_file, name)


def test_an_index_outside_the_dataset_fails_naming_the_class(sampler_file):
    with pytest.raises(SamplerError, match=r"OutOfRange yielded 10, not an index into the 10 training prompts"):
        plugin(sampler_file, "OutOfRange").next_batch()


def test_an_unimportable_path_names_the_key(tmp_path):
    with pytest.raises(SamplerError, match="data.sampler.class_path='pkg://no_such_module_here'"):
        load_sampler_class("pkg://no_such_module_here", "X")
    with pytest.raises(SamplerError, match="no such file"):
        load_sampler_class(str(tmp_path / "absent.py"), "X")


def test_no_class_is_the_builtin_seeded_shuffle_and_verls_test_sampler_is_the_same():
    data = load_config(overrides=["data.seed=5"]).data
    builtin = build_prompt_sampler(data, list(range(12)), 4, seed=5)
    assert isinstance(builtin, ResumableSampler) and builtin.shuffle
    path, name = VERL_TEST_RANDOM_SAMPLER
    verl_test = build_prompt_sampler(
        load_config(overrides=["data.shuffle=false", f"data.sampler.class_path={path}",
                               f"data.sampler.class_name={name}"]).data, list(range(12)), 4, seed=5)
    assert isinstance(verl_test, ResumableSampler) and verl_test.shuffle  # a shuffle, whatever data.shuffle said
    assert [verl_test.next_batch() for _ in range(3)] == [builtin.next_batch() for _ in range(3)]


def test_a_named_class_from_the_config(sampler_file):
    data = load_config(overrides=[f"data.sampler.class_path={sampler_file}", "data.sampler.class_name=Reversed"]).data
    s = build_prompt_sampler(data, list(range(6)), 2, seed=0)
    assert isinstance(s, PluginSampler) and s.next_batch() == [5, 4]
    with pytest.raises(SamplerError, match="needs data.sampler.class_path"):
        build_prompt_sampler(load_config(overrides=["data.sampler.class_name=Reversed"]).data, list(range(6)), 2, 0)


def test_verls_example_keys_load(sampler_file):
    """verl's spelling on the command line reaches the typed keys unchanged."""
    path = textwrap.dedent(f"{sampler_file}")
    cfg = load_config(overrides=[f"data.sampler.class_path={path}", "data.sampler.class_name=HardestFirst"])
    assert (cfg.data.sampler.class_path, cfg.data.sampler.class_name) == (path, "HardestFirst")


@pytest.mark.parametrize(("overrides", "key"), [
    (["data.sampler.class_path=pkg://no_such_module_here", "data.sampler.class_name=X"], "data.sampler.class_path"),
    (["data.sampler.class_name=Reversed"], "data.sampler.class_path"),
])
def test_a_wrong_class_fails_when_plugins_resolve_before_any_data_loads(overrides, key):
    from hybridflow.config import ConfigError
    from hybridflow.controller.preflight import resolve_plugins

    with pytest.raises(ConfigError) as info:
        resolve_plugins(load_config(overrides=overrides), check_machine=False)
    assert info.value.key == key


def test_plugins_resolve_a_good_class_and_verls_test_sampler(sampler_file):
    from hybridflow.controller.preflight import resolve_plugins

    path, name = VERL_TEST_RANDOM_SAMPLER
    for overrides in ([f"data.sampler.class_path={sampler_file}", "data.sampler.class_name=Reversed"],
                      [f"data.sampler.class_path={path}", f"data.sampler.class_name={name}"]):
        resolve_plugins(load_config(overrides=overrides), check_machine=False)
