"""Config fuzzing (hypothesis): typo'd keys, wrong-typed values and impossible batch arithmetic
fail fast, before anything loads, naming the dotted key; a one-character typo of a real key is
answered with that key (or the valid keys of its section)."""

from __future__ import annotations

import dataclasses
import re
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.config import Config, ConfigError, load_config, validate_config

FUZZ = settings(max_examples=60, deadline=None)


def _leaf_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    keys = []
    for field in dataclasses.fields(cls):
        path = f"{prefix}{field.name}"
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if dataclasses.is_dataclass(default):
            keys += _leaf_keys(type(default), path + ".")
        else:
            keys.append((path, type(default)))
    return keys


LEAVES = _leaf_keys()
INT_KEYS = [k for k, t in LEAVES if t is int]
KEYS = {k for k, _ in LEAVES}


def _fails_fast(overrides: list[str]) -> str:
    start = time.perf_counter()
    try:
        validate_config(load_config(overrides=overrides))
    except ConfigError as exc:
        assert time.perf_counter() - start < 5.0
        return str(exc)
    raise AssertionError(f"{overrides} was accepted")


@FUZZ
@given(key=st.sampled_from([k for k, _ in LEAVES]), data=st.data())
def test_a_one_character_typo_of_a_leaf_is_named_with_a_suggestion(key: str, data) -> None:
    section, _, leaf = key.rpartition(".")
    if len(leaf) < 4:
        return
    i = data.draw(st.integers(0, len(leaf) - 1))
    edit = data.draw(st.sampled_from(["drop", "double", "swap"]))
    if edit == "drop":
        typo = leaf[:i] + leaf[i + 1 :]
    elif edit == "double":
        typo = leaf[:i] + leaf[i] + leaf[i:]
    else:
        j = min(i + 1, len(leaf) - 1)
        typo = leaf[:i] + leaf[j] + leaf[i] + leaf[j + 1 :] if j != i else leaf + "x"
    if typo == leaf:
        return
    bad = f"{section}.{typo}" if section else typo
    message = _fails_fast([f"{bad}=1"])
    assert f"unknown config key '{bad}" in message
    # Either a suggestion that is a real key of the same section (the typo may be equally close to
    # two keys, e.g. rollout_is / rollout_rs), or the list of the section's keys.
    match = re.search(r"did you mean '([^']+)'", message)
    if match:
        assert match.group(1) in KEYS and match.group(1).rpartition(".")[0] == section, message
    else:
        assert leaf in message, message


@FUZZ
@given(key=st.sampled_from(INT_KEYS), value=st.sampled_from(["abc", "1.5", "[1, 2]", "{a: 1}"]))
def test_a_wrong_typed_int_is_named(key: str, value: str) -> None:
    message = _fails_fast([f"{key}={value}"])
    assert key in message


@FUZZ
@given(train=st.integers(1, 64), mini=st.integers(1, 64), n=st.integers(1, 8), micro=st.integers(1, 64))
def test_batch_arithmetic_is_either_valid_or_explained_with_its_keys(train: int, mini: int, n: int, micro: int) -> None:
    overrides = [f"data.train_batch_size={train}", f"actor.ppo_mini_batch_size={mini}", f"rollout.n={n}",
                 f"actor.ppo_micro_batch_size_per_gpu={micro}", "data.builtin_train_size=4096",
                 "actor.use_dynamic_bsz=false"]
    cfg = load_config(overrides=overrides)
    start = time.perf_counter()
    try:
        validate_config(cfg)
    except ConfigError as exc:
        assert time.perf_counter() - start < 5.0
        assert any(k in str(exc) for k in ("data.train_batch_size", "actor.ppo_mini_batch_size",
                                           "actor.ppo_micro_batch_size_per_gpu", "rollout.n")), str(exc)
        return
    # Accepted: then the arithmetic really is consistent.
    assert mini <= train and train % mini == 0 and micro <= mini * n and (mini * n) % micro == 0
