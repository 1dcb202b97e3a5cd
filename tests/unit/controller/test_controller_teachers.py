"""On-policy distillation's teachers: which teacher scores which row, the refusal of a teacher with another
tokenizer, and the config checks of the distillation section."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.cluster.backends import build_worker_group
from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.controller.preflight import check_teacher_tokenizer
from hybridflow.controller.teachers import Teachers, check_teacher_sources, teacher_paths, teacher_roles
from hybridflow.models.loading import load_tokenizer
from hybridflow.models.tiny import write_tiny_model
from hybridflow.models.tokenizer_match import role_differences, tokenizer_differences
from hybridflow.types import Trajectory, collate_trajectories
from hybridflow.workers.reference import ReferenceSetup, ReferenceWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return str(write_tiny_model(root / "a", seed=1)), str(write_tiny_model(root / "b", seed=2))


def _group(path: str, ranks: int = 1):
    setup = ReferenceSetup(model_path=path, dtype="float32", device=torch.device("cpu"), temperature=1.0,
                           micro_batch_size=4)
    return build_worker_group("local", "teacher", lambda r, w: ReferenceWorker(r, w, setup), ranks)


def _batch(rows: int = 6):
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(rows):
        p, r = 5 + i % 3, 3 + i % 4
        ids = torch.randint(0, 200, (p + r,), generator=g).tolist()
        trajectories.append(Trajectory(ids[:p], ids[p:], [1] * r, [-1.0] * r, "stop", group_id=i))
    return collate_trajectories(trajectories, pad_token_id=256)


def test_each_row_is_scored_by_its_data_sources_teacher(models) -> None:
    a, b = _group(models[0]), _group(models[1])
    batch = _batch()
    whole_a = a.call_one(0, ReferenceWorker.compute_ref_logprobs, batch)
    whole_b = b.call_one(0, ReferenceWorker.compute_ref_logprobs, batch)
    assert not torch.allclose(whole_a, whole_b)
    teachers = Teachers({"teacher": a, "teacher_1": b}, by_source={"math": "teacher_1"}, default="teacher")
    sources = ["gsm8k", "math", "math", "gsm8k", "math", "other"]
    scored = teachers.logprobs(batch, sources).logprobs
    for row, source in enumerate(sources):
        expected = whole_b[row] if source == "math" else whole_a[row]
        torch.testing.assert_close(scored[row], expected, rtol=0, atol=1e-6)


class TwoRanks:
    """A worker group of two ranks as ``split_gather`` sees one: the batch split in two equal halves, each
    scored by a real reference worker (two local ranks need a process group; this tests the routing)."""

    world_size = 2

    def __init__(self, path: str) -> None:
        self.worker = ReferenceWorker(0, 1, ReferenceSetup(model_path=path, dtype="float32", device=torch.device("cpu"),
                                                           temperature=1.0, micro_batch_size=4))

    def split_gather(self, method, batch):
        return [method(self.worker, shard) for shard in batch.chunk(self.world_size)]


def test_a_teachers_rows_are_spread_evenly_over_its_ranks(models) -> None:
    """Three rows on two ranks: padded to four by repeating one, the copy dropped after."""
    one = _group(models[0])
    batch = _batch(4)
    expected = one.call_one(0, ReferenceWorker.compute_ref_logprobs, batch.select([0, 2, 3]))
    teachers = Teachers({"teacher": TwoRanks(models[0]), "teacher_1": one}, {"x": "teacher", "y": "teacher_1"}, None)
    torch.testing.assert_close(teachers.logprobs(batch, ["x", "y", "x", "x"]).logprobs[[0, 2, 3]], expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="data_source 'z' has no teacher"):
        teachers.logprobs(batch, ["x", "y", "z", "x"])


def test_roles_paths_and_missing_sources() -> None:
    cfg = load_config(overrides=["distillation.enable=true", "distillation.teacher.path=/m/a",
                                 "distillation.teachers={math: /m/b, code: /m/a}"])
    assert teacher_paths(cfg) == {"math": "/m/b", "code": "/m/a", None: "/m/a"}
    assert teacher_roles(teacher_paths(cfg)) == {"teacher": "/m/a", "teacher_1": "/m/b"}
    check_teacher_sources(cfg, ["anything"])  # the default teacher scores it
    cfg.distillation.teacher.path = None
    with pytest.raises(ConfigError, match=r"data_source \['gsm8k'\]") as error:
        check_teacher_sources(cfg, ["math", "gsm8k"])
    assert error.value.key == "distillation.teachers"


def test_the_same_tokenizer_passes_and_another_is_refused_with_the_difference(models, tmp_path) -> None:
    student = load_tokenizer(models[0])
    assert check_teacher_tokenizer(student, models[1], "distillation.teacher.path", False) is None
    other = tmp_path / "other"
    write_tiny_model(other, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<only-here>"])
    tokenizer.save_pretrained(other)
    assert any("'<only-here>'" in p for p in tokenizer_differences(student, tokenizer))
    with pytest.raises(ConfigError, match="does not share the student's tokenizer") as error:
        check_teacher_tokenizer(student, str(other), "distillation.teachers.math", False)
    assert error.value.key == "distillation.teachers.math"
    with pytest.raises(ConfigError, match="no config.json"):
        check_teacher_tokenizer(student, str(tmp_path / "missing"), "distillation.teacher.path", False)


def test_another_eos_is_a_note_not_a_refusal(models) -> None:
    student, teacher = load_tokenizer(models[0]), load_tokenizer(models[1])
    # As a base model and its chat model: the same tokens, another one ends a turn.
    teacher.add_special_tokens({"additional_special_tokens": [student.eos_token]})
    teacher.eos_token = teacher.pad_token
    assert role_differences(student, teacher) and not tokenizer_differences(student, teacher)


@pytest.mark.parametrize("overrides, message", [
    (["distillation.enable=true"], "needs a teacher"),
    (["distillation.enable=true", "distillation.teacher.path=/m", "distillation.kl_coef=-1"], "kl_coef=-1.0"),
    (["distillation.enable=true", "distillation.teacher.path=/m", "distillation.discount=2"], "discount=2.0"),
    (["distillation.enable=true", "distillation.teacher.path=builtin:big"], "the only built-in teacher"),
    (["distillation.enable=true", "distillation.teacher.path=builtin:tiny-teacher", "data.builtin_task=calculator"],
     "knows the built-in arithmetic task only"),
])
def test_config_errors_name_the_key(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(overrides=overrides))


def test_the_preset_validates_and_a_teacher_without_enable_warns() -> None:
    assert validate_config(load_config("distill")) == []
    warnings = validate_config(load_config(overrides=["distillation.teacher.path=/m"]))
    assert any("distillation.enable=false" in w for w in warnings)
