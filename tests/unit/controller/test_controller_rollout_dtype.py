"""rollout.dtype is decided once per run by set-up (auto: a rule; tune: measured), recorded, and reused on resume."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from hybridflow import api
from hybridflow.controller import rollout_dtype
from hybridflow.config.budget import read_model_shape
from hybridflow.controller.rollout_dtype import ROLLOUT_DTYPE_FILE, resolve_run_rollout_dtype
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.inference import precision
from hybridflow.inference.precision import PrecisionProbe
from hybridflow.utils.device import CpuFeatures

AVX2 = CpuFeatures(vendor="AuthenticAMD", model_name="AMD EPYC", flags=frozenset({"avx2"}), capability="AVX2")
BF16 = CpuFeatures(vendor="AuthenticAMD", model_name="AMD EPYC", flags=frozenset({"avx512_bf16"}), capability="AVX512")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("model"), TinyModelSpec(num_hidden_layers=1)))


def config(*overrides: str):
    return api.make_config("grpo", overrides=["rollout.max_batch_size=16", *overrides])


def probe_saying(speedup: float, calls: list[int]):
    def probe(model: torch.nn.Module, batch: int) -> PrecisionProbe:
        calls.append(batch)
        return PrecisionProbe(batch=batch, float32_step_s=speedup * 0.01, bfloat16_step_s=0.01,
                              logprob_mismatch=0.002, logprob_mismatch_max=0.01)
    return probe


def test_auto_is_the_same_whatever_a_timing_would_say(model_dir, tmp_path):
    """The issue's defect: a probe under load read 0.13x in one run and 7.16x in the next, and the
    same command sampled in two precisions. auto must not time anything."""
    answers = []
    for speedup in (0.13, 7.16):
        calls: list[int] = []
        with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
                mock.patch.object(precision, "probe_decode_precision", probe_saying(speedup, calls)):
            out = tmp_path / str(speedup)
            out.mkdir()
            answers.append(resolve_run_rollout_dtype(config(), CPU, model_dir, out))
        assert calls == []  # nothing was timed
    assert answers == ["float32", "float32"]  # the 1-layer tiny model is far below BF16_MIN_PARAMETERS


def test_auto_is_bfloat16_from_the_parameter_threshold_up_on_bf16_hardware(model_dir, tmp_path, monkeypatch):
    shape = read_model_shape(model_dir)
    assert shape is not None
    for threshold, expected in ((shape.num_parameters, "bfloat16"), (shape.num_parameters + 1, "float32")):
        monkeypatch.setattr(precision, "BF16_MIN_PARAMETERS", threshold)
        (tmp_path / ROLLOUT_DTYPE_FILE).unlink(missing_ok=True)
        with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16):
            assert resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path) == expected
        record = json.loads((tmp_path / ROLLOUT_DTYPE_FILE).read_text())
        assert record["dtype"] == expected and "parameters" in record["reason"]
        assert record["reuse"] == f"rollout.dtype={expected}" and record["rollout.dtype"] == "auto"


def test_every_decision_is_recorded_with_its_reason_and_the_weight_layout(model_dir, tmp_path):
    cases = [
        (config("rollout.dtype=bfloat16"), CPU, BF16, "bfloat16", "set explicitly"),
        (config(), CPU, AVX2, "float32", "no avx512_bf16/amx_bf16"),
        (config(), torch.device("cuda"), AVX2, "bfloat16", "on a GPU"),
        (config("rollout.name=hf_vision"), CPU, BF16, "float32", "no model size"),
        (config("rollout.tensor_model_parallel_size=2"), CPU, BF16, "float32", "no model size"),
    ]
    for cfg, device, cpu, expected, why in cases:
        (tmp_path / ROLLOUT_DTYPE_FILE).unlink(missing_ok=True)
        with mock.patch.object(rollout_dtype, "cpu_features", return_value=cpu):
            assert resolve_run_rollout_dtype(cfg, device, model_dir, tmp_path) == expected
        record = json.loads((tmp_path / ROLLOUT_DTYPE_FILE).read_text())
        assert record["dtype"] == expected and why in record["reason"], record
        assert ("weight_layout" in record) == (cfg.rollout.name == "native"), record
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left beside it


def test_tune_measures_records_the_figures_and_a_run_started_again_in_the_folder_reuses_it(model_dir, tmp_path):
    calls: list[int] = []
    with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
            mock.patch.object(precision, "probe_decode_precision", probe_saying(2.0, calls)):
        assert resolve_run_rollout_dtype(config("rollout.dtype=tune"), CPU, model_dir, tmp_path) == "bfloat16"
    assert calls == [16]  # one probe, at the replicas' batch
    record = json.loads((tmp_path / ROLLOUT_DTYPE_FILE).read_text())
    assert record["dtype"] == "bfloat16" and record["bfloat16_speedup"] == pytest.approx(2.0)
    assert record["reuse"] == "rollout.dtype=bfloat16"  # what another run passes to sample the same way
    # The same folder again (a resume): the record wins, even where a new probe would say otherwise,
    # and under auto too (the rule would say float32 for this model).
    for dtype in ("tune", "auto"):
        with mock.patch.object(rollout_dtype, "cpu_features", return_value=BF16), \
                mock.patch.object(precision, "probe_decode_precision", probe_saying(0.5, calls)):
            assert resolve_run_rollout_dtype(config(f"rollout.dtype={dtype}"), CPU, model_dir, tmp_path) == "bfloat16"
    assert calls == [16]


def test_a_resume_on_hardware_with_another_weight_layout_says_so(model_dir, tmp_path, caplog):
    (tmp_path / ROLLOUT_DTYPE_FILE).write_text(json.dumps({"dtype": "float32", "weight_layout": "no-such-layout"}))
    with caplog.at_level("WARNING"):
        assert resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path) == "float32"
    assert "no-such-layout weight layout" in caplog.text and "will not be bitwise" in caplog.text


@pytest.mark.parametrize(("now", "warns"), [("onednn", False), ("panels", False), ("fused", True)])
def test_a_resume_in_bf16_on_another_weight_layout_warns_only_where_the_layouts_round_apart(
        model_dir, tmp_path, caplog, now, warns):
    # dense, onednn and panels sum in oneDNN's order in bf16; the fused decode rounds its own way.
    (tmp_path / ROLLOUT_DTYPE_FILE).write_text(json.dumps({"dtype": "bfloat16", "weight_layout": "dense"}))
    with caplog.at_level("WARNING"), mock.patch.object(rollout_dtype, "resolve_weight_layout", return_value=now):
        assert resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path) == "bfloat16"
    assert ("will not be bitwise" in caplog.text) == warns


@pytest.mark.parametrize("text", ["{not json", '{"dtype": "float16"}', '{"other": 1}'])
def test_a_damaged_record_is_an_error_naming_the_file_and_the_fix(model_dir, tmp_path, text):
    (tmp_path / ROLLOUT_DTYPE_FILE).write_text(text)
    with pytest.raises(ValueError, match=rf"{ROLLOUT_DTYPE_FILE}.*(delete it to decide again)"):
        resolve_run_rollout_dtype(config(), CPU, model_dir, tmp_path)
