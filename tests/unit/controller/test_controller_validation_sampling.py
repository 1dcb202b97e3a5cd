"""rollout.val_kwargs reach the validation's sampling parameters, with verl's do_sample rule."""

from __future__ import annotations

from hybridflow.config import ValKwargsConfig
from hybridflow.controller.setup import dump_dir
from hybridflow.controller.step_plan import validation_sampling


def test_default_validation_is_one_greedy_sample():
    params = validation_sampling(ValKwargsConfig(), max_tokens=16)
    assert (params.n, params.greedy, params.temperature, params.max_tokens) == (1, True, 0.0, 16)


def test_do_sample_uses_the_val_kwargs_sampling():
    v = ValKwargsConfig(n=4, do_sample=True, temperature=0.7, top_p=0.9, top_k=5)
    params = validation_sampling(v, max_tokens=8)
    assert (params.n, params.greedy, params.temperature, params.top_p, params.top_k) == (4, False, 0.7, 0.9, 5)


def test_without_do_sample_the_temperature_is_ignored_and_n_repeats_greedy():
    params = validation_sampling(ValKwargsConfig(n=3, temperature=1.0, top_p=0.5), max_tokens=8)
    assert (params.n, params.greedy, params.top_p) == (3, True, 1.0)


def test_relative_dump_dirs_are_inside_the_run_folder(tmp_path):
    assert dump_dir(None, tmp_path) is None
    assert dump_dir("val", tmp_path) == tmp_path / "val"
    assert dump_dir(str(tmp_path / "abs"), tmp_path / "run") == tmp_path / "abs"
