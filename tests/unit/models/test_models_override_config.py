"""``model.override_config``: entries set on the HF config before the model is built, seen by every
role that builds the policy (the actor, the reference, the rollout engine's model), passed to vLLM
as ``hf_overrides`` and to SGLang as ``--json-model-override-args``; a name the config class lacks
is an error naming the key and the class."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.models.loading import apply_config_overrides, load_causal_lm, meta_causal_lm
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.rollout.factory import ROLLOUT_ENGINES, _model_override_arg
from hybridflow.rollout.sglang_engine import launch_args
from hybridflow.rollout.vllm_engine import engine_kwargs
from hybridflow.workers.reference import ReferenceSetup, ReferenceWorker
from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024)
    return str(write_tiny_model(tmp_path_factory.mktemp("override") / "model", spec, seed=3))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_overrides_reach_the_built_model_and_change_its_forward(model_dir):
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    plain = load_causal_lm(model_dir)
    overridden = load_causal_lm(model_dir, override_config={"max_position_embeddings": 32768, "rms_norm_eps": 0.5})
    assert (overridden.config.max_position_embeddings, overridden.config.rms_norm_eps) == (32768, 0.5)
    assert plain.config.max_position_embeddings == 1024
    # The modules were built from the overridden config: a larger epsilon in every RMSNorm moves the logits.
    assert not torch.allclose(_logits(plain, ids), _logits(overridden, ids))
    # The weights are the checkpoint's either way.
    assert torch.equal(plain.state_dict()["model.embed_tokens.weight"], overridden.state_dict()["model.embed_tokens.weight"])
    assert meta_causal_lm(model_dir, override_config={"max_position_embeddings": 32768}).config.max_position_embeddings \
        == 32768


def test_attn_implementation_picks_the_attention_kernel_as_in_verl(model_dir):
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    eager = load_causal_lm(model_dir, override_config={"attn_implementation": "eager"})
    assert eager.config._attn_implementation == "eager"
    assert load_causal_lm(model_dir).config._attn_implementation == "sdpa"
    assert torch.allclose(_logits(eager, ids), _logits(load_causal_lm(model_dir), ids), atol=1e-5)
    # vLLM and SGLang run kernels of their own: only config entries reach them.
    assert _model_override_arg(ROLLOUT_ENGINES["vllm"], {"attn_implementation": "eager"}) == {}
    assert _model_override_arg(ROLLOUT_ENGINES["vllm"], {"attn_implementation": "eager", "rope_theta": 1.0}) == {
        "model_override_config": {"rope_theta": 1.0}}


def test_a_name_the_config_class_lacks_is_an_error_naming_key_and_class(model_dir):
    with pytest.raises(ValueError, match=r"model.override_config.max_position_embedding: Qwen2Config has no "
                                         r"attribute 'max_position_embedding'"):
        load_causal_lm(model_dir, override_config={"max_position_embedding": 32768})


def test_a_mapping_updates_a_sub_config_entry_by_entry():
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig()
    depth = config.vision_config.depth
    apply_config_overrides(config, {"vision_config": {"hidden_act": "gelu"}})
    assert (config.vision_config.hidden_act, config.vision_config.depth) == ("gelu", depth)
    with pytest.raises(ValueError, match=r"model.override_config.vision_config.nope: Qwen2VLVisionConfig has no "
                                         r"attribute 'nope'"):
        apply_config_overrides(config, {"vision_config": {"nope": 1}})


def test_the_reference_and_the_native_rollout_build_from_the_overridden_config(model_dir):
    overrides = {"max_position_embeddings": 2048, "rms_norm_eps": 0.25}
    ref = ReferenceWorker(0, 1, ReferenceSetup(model_path=model_dir, dtype="float32", device=torch.device("cpu"),
                                               temperature=1.0, micro_batch_size=4, override_config=overrides))
    assert ref.engine.model.config.rms_norm_eps == 0.25
    rollout = RolloutWorker(0, 1, RolloutSetup(model_path=model_dir, engine="native", dtype="float32",
                                               device=torch.device("cpu"), max_batch_size=2, seed=0,
                                               override_config=overrides))
    try:
        assert (rollout.model.config.max_position_embeddings, rollout.model.config.rms_norm_eps) == (2048, 0.25)
        assert rollout.engine._max_model_len == 2048  # the native engine sizes its context from the config it serves
    finally:
        rollout.close()


def test_engines_that_read_the_checkpoint_get_the_overrides():
    overrides = {"max_position_embeddings": 32768, "text_config": {"rope_theta": 1e6}}
    # The factory passes them only to engines that read config.json themselves.
    assert _model_override_arg(ROLLOUT_ENGINES["vllm"], overrides) == {"model_override_config": overrides}
    assert _model_override_arg(ROLLOUT_ENGINES["sglang"], overrides) == {"model_override_config": overrides}
    assert _model_override_arg(ROLLOUT_ENGINES["native"], overrides) == {}
    assert _model_override_arg(ROLLOUT_ENGINES["vllm"], {}) == {}
    common = dict(dtype="float32", seed=0, max_batch_size=2, enable_prefix_caching=True, enforce_eager=True,
                  kv_cache_bytes=None, on_gpu=False, chunking={})
    kwargs = engine_kwargs("/m", **common, hf_overrides=overrides)
    assert kwargs["hf_overrides"] == overrides and kwargs["hf_overrides"] is not overrides
    assert "hf_overrides" not in engine_kwargs("/m", **common)
    args = launch_args(dtype="bfloat16", seed=0, max_batch_size=2, enforce_eager=False, enable_prefix_caching=True,
                       device=torch.device("cuda", 0), model_override_config=overrides)
    flag = args.index("--json-model-override-args")
    assert json.loads(args[flag + 1]) == overrides
    assert "--json-model-override-args" not in launch_args(dtype="bfloat16", seed=0, max_batch_size=2,
                                                           enforce_eager=False, enable_prefix_caching=True,
                                                           device=torch.device("cuda", 0))
