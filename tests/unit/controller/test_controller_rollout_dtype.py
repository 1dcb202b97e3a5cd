"""rollout.dtype=auto is decided once per run by set-up, recorded when measured, and reused on resume."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from hybridflow import api
from hybridflow.controller import rollout_dtype
from hybridflow.controller.rollout_dtype import ROLLOUT_DTYPE_FILE, resolve_run_rollout_dtype
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.rollout import precision
from hybridflow.rollout.precision import PrecisionProbe
from hybridflow.utils.device import CpuFeatures

AVX2 = CpuFeatures(vendor="AuthenticAMD", model_name="AMD EPYC", flags=frozenset({"avx2"}), capability="AVX2")
BF16 = CpuFeatures(vendor="AuthenticAMD", model_name="AMD EPYC", flags=frozenset({"avx512_bf16"}), capability="AVX512")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("model"), TinyModelSpec(num_hidden_layers=1)))


CACHE: list[str] = []  # this test's machine records (warm_start.cache_dir), never the user's


@pytest.fixture(autouse=True)
def machine_cache(tmp_path_factory):
    CACHE[:] = [str(tmp_path_factory.mktemp("cache"))]


def config(*overrides: str):
    return api.make_config("grpo", overrides=["rollout.max_batch_size=16", f"warm_start.cache_dir={CACHE[0]}",
                                              *overrides])


def probe_saying(speedup: float, calls: list[int]):
    def probe(model: torch.nn.Module, batch: int) -> PrecisionProbe:
        calls.append(batch)
        return PrecisionProbe(batch=batch, float32_step_s=speedup * 0.01, bfloat16_step_s=0.01,
                              logprob_mismatch=0.002, logprob_mismatch_max=0.01)
    return probe


def test_a_measured_choice_is_recorded_and_a_run_started_again_in_the_folder_reuses_it(model_dir, tmp_path):
    calls: list[int] = []
    with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
            mock.patch.object(precision, "probe_decode_precision", probe_saying(2.0, calls)):
        assert resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path) == "bfloat16"
    assert calls == [16]  # one probe, at the replicas' batch
    record = json.loads((tmp_path / ROLLOUT_DTYPE_FILE).read_text())
    assert record["dtype"] == "bfloat16" and record["bfloat16_speedup"] == pytest.approx(2.0)
    # The same folder again (a resume): the record wins, even where a new probe would say otherwise.
    with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
            mock.patch.object(precision, "probe_decode_precision", probe_saying(0.5, calls)):
        assert resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path) == "bfloat16"
    assert calls == [16]


def test_nothing_is_measured_or_recorded_where_the_answer_is_a_rule(model_dir, tmp_path):
    def never(model: torch.nn.Module, batch: int) -> PrecisionProbe:
        raise AssertionError("no probe expected")

    cases = [
        (config("rollout.dtype=bfloat16"), CPU, BF16, "bfloat16"),  # explicit
        (config(), CPU, AVX2, "float32"),  # no bf16 hardware
        (config(), torch.device("cuda"), AVX2, "bfloat16"),  # auto on a GPU
        (config("rollout.name=hf_vision"), CPU, BF16, "float32"),  # an engine the probe does not time
        (config("rollout.tensor_model_parallel_size=2"), CPU, BF16, "float32"),  # a tensor-parallel replica
    ]
    for cfg, device, cpu, expected in cases:
        with mock.patch.object(rollout_dtype, "cpu_features", return_value=cpu), \
                mock.patch.object(precision, "probe_decode_precision", never):
            assert resolve_run_rollout_dtype(cfg, device, model_dir, tmp_path) == expected
    assert not (tmp_path / ROLLOUT_DTYPE_FILE).exists()


@pytest.mark.parametrize("text", ["{not json", '{"dtype": "float16"}', '{"other": 1}'])
def test_a_damaged_record_is_an_error_naming_the_file_and_the_fix(model_dir, tmp_path, text):
    (tmp_path / ROLLOUT_DTYPE_FILE).write_text(text)
    with pytest.raises(ValueError, match=rf"{ROLLOUT_DTYPE_FILE}.*(delete it to measure again)"):
        resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path)


def test_runs_in_other_folders_take_the_first_measurement_made_on_this_machine(model_dir, tmp_path):
    """A probe is timing: a second run of the same model on the same machine (another folder) must
    not sample in another precision because its probe read otherwise."""
    calls: list[int] = []
    for name in "abc":  # each run's folder
        (tmp_path / name).mkdir()
    with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
            mock.patch.object(precision, "probe_decode_precision", probe_saying(2.0, calls)):
        assert resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path / "a") == "bfloat16"
    with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
            mock.patch.object(precision, "probe_decode_precision", probe_saying(0.5, calls)):
        assert resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path / "b") == "bfloat16"
        # Another batch is another measurement.
        assert resolve_run_rollout_dtype(config("rollout.max_batch_size=8"), CPU, model_dir, tmp_path / "c") == "float32"
    assert calls == [16, 8]
    assert json.loads((tmp_path / "b" / ROLLOUT_DTYPE_FILE).read_text())["dtype"] == "bfloat16"


def test_of_two_runs_measuring_at_once_both_take_the_first_written_answer(model_dir, tmp_path):
    cfg = config()
    machine = rollout_dtype.machine_record(cfg, model_dir, BF16)
    real_write_once = rollout_dtype._write_once

    def lose_the_race(path, fields):  # another run wrote fp32 while this one measured bf16
        real_write_once(path, {"dtype": "float32", "reason": "the other run's probe"})
        return real_write_once(path, fields)

    with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
            mock.patch.object(precision, "probe_decode_precision", probe_saying(2.0, [])), \
            mock.patch.object(rollout_dtype, "_write_once", lose_the_race):
        assert resolve_run_rollout_dtype(cfg, CPU, model_dir, tmp_path) == "float32"
    assert json.loads(machine.read_text())["reason"] == "the other run's probe"
    assert json.loads((tmp_path / ROLLOUT_DTYPE_FILE).read_text())["dtype"] == "float32"


def test_a_damaged_machine_record_is_measured_again(model_dir, tmp_path):
    cfg = config()
    machine = rollout_dtype.machine_record(cfg, model_dir, BF16)
    machine.parent.mkdir(parents=True, exist_ok=True)
    machine.write_text("{not json")
    with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
            mock.patch.object(precision, "probe_decode_precision", probe_saying(2.0, [])):
        assert resolve_run_rollout_dtype(cfg, CPU, model_dir, tmp_path) == "bfloat16"
    assert json.loads(machine.read_text())["dtype"] == "bfloat16"
