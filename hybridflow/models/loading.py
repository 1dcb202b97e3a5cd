"""Loading models and tokenizers from local Hugging Face directories.

Nothing here downloads: ``local_files_only=True`` everywhere, and a path that is not a local
directory is an error that says so. The built-in model (``builtin:tiny``) is materialised as
an ordinary HF directory first (see ``hybridflow.models.tiny``) and then loaded by the same code.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

BUILTIN_PREFIX = "builtin:"
# Vision-language model types (Qwen2-VL, Qwen2.5-VL) that load as their image-text-to-text class:
# the same next-token head as a causal LM, with a vision tower in front (hybridflow.models.vision).
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")

# transformers draws a "Loading weights" bar for every from_pretrained and a "Writing model
# shards" bar for every save_pretrained: a run loads and saves several times, and each bar
# clutters the console, test logs and our own progress bar. They are switched off while our
# code loads or saves (the flags are process-wide, so nested and concurrent users share one
# switch: the first one in turns them off, the last one out puts back what was there).
_BARS_LOCK = threading.Lock()
_bars_users = 0
_bars_saved: tuple[bool, dict[str, bool] | None] | None = None


def _user_forces_bars() -> bool:
    """``HF_HUB_DISABLE_PROGRESS_BARS=0``: the user asked for the bars; leave them on."""
    from huggingface_hub import constants

    return constants.HF_HUB_DISABLE_PROGRESS_BARS is False


def _hub_bar_states() -> dict[str, bool] | None:
    """huggingface_hub's per-group bar switches (a module-level dict), to put back exactly."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    states = getattr(hub_tqdm, "progress_bar_states", None)
    return states if isinstance(states, dict) else None


@contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """transformers' and huggingface_hub's progress bars off inside the block, as before after it."""
    global _bars_users, _bars_saved
    from transformers.utils import logging as hf_logging

    with _BARS_LOCK:
        _bars_users += 1
        if _bars_users == 1 and not _user_forces_bars():
            states = _hub_bar_states()
            _bars_saved = (hf_logging.is_progress_bar_enabled(), None if states is None else dict(states))
            hf_logging.disable_progress_bar()  # turns huggingface_hub's bars off too
    try:
        yield
    finally:
        with _BARS_LOCK:
            _bars_users -= 1
            if _bars_users == 0 and _bars_saved is not None:
                _restore_bars(*_bars_saved)
                _bars_saved = None


def _restore_bars(transformers_on: bool, hub_states: dict[str, Any] | None) -> None:
    from transformers.utils import logging as hf_logging

    if transformers_on:
        hf_logging.enable_progress_bar()  # also switches huggingface_hub's on: its own states follow
    states = _hub_bar_states()
    if states is not None and hub_states is not None:
        states.clear()
        states.update(hub_states)


def disable_hf_progress_bars() -> None:
    """transformers' and huggingface_hub's bars off for good: for processes that only run our code
    (a Ray rank), where every load and save is ours."""
    if not _user_forces_bars():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


def check_model_dir(path: str | os.PathLike) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(
            f"model.path={str(path)!r} is not a local directory. hybridflow never downloads models: "
            "point model.path at a Hugging Face directory on disk (config.json, *.safetensors, "
            "tokenizer files) or use model.path=builtin:tiny"
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path={str(p)!r} has no config.json; is it a Hugging Face model directory?")
    return p


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False, chat_template: str | None = None):
    """The tokenizer of the model at ``path``; ``chat_template`` (data.chat_template) replaces its own."""
    from transformers import AutoTokenizer

    p = check_model_dir(path)
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tok.chat_template = chat_template
    if tok.pad_token_id is None:
        # Padding positions are masked everywhere; any id works, EOS is the usual choice.
        tok.pad_token = tok.eos_token
    if getattr(tok, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer in {p} has no chat template; prompts are chat messages and need one "
            "(add chat_template to tokenizer_config.json or a chat_template.jinja file)"
        )
    return tok


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (``model.enable_gradient_checkpointing``):
    transformers' ``activation_checkpointing_enable`` (v5 names it so), else the older
    ``gradient_checkpointing_enable``."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    override_config: Mapping[str, Any] | None = None,
):
    """A causal LM from a local directory, safetensors only (no pickle), on ``device``, its
    config.json with ``override_config`` (``model.override_config``) applied before the model is built.

    A vision-language model (``VL_MODEL_TYPES``) loads as ``AutoModelForImageTextToText``
    (``Qwen2VLForConditionalGeneration``): transformers' causal-LM auto class does not map it,
    and the actor and the reference need its whole model, vision tower included."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    p = check_model_dir(path)
    auto = AutoModelForImageTextToText if _model_type(p) in VL_MODEL_TYPES else AutoModelForCausalLM
    # Without overrides transformers reads config.json itself, exactly as before they existed.
    config = {"config": load_model_config(p, override_config=override_config, trust_remote_code=trust_remote_code)
              } if override_config else {}
    return _weights_from_dir(auto, p, dtype, trust_remote_code, **config).to(device)


def _weights_from_dir(auto_class: Any, model_dir: Path, dtype: torch.dtype, trust_remote_code: bool,
                      **options: Any) -> Any:
    """``auto_class.from_pretrained`` on a local model directory, as every loader here reads one: no
    download, safetensors only (no pickle), no progress bars; ``options`` (a config, loading info)
    passed on."""
    with hf_progress_bars_off():
        return auto_class.from_pretrained(model_dir, **options, dtype=dtype, local_files_only=True,
                                          trust_remote_code=trust_remote_code, use_safetensors=True)


def meta_causal_lm(path: str | os.PathLike, *, trust_remote_code: bool = False,
                   override_config: Mapping[str, Any] | None = None):
    """The causal LM of a local directory on the meta device: its parameters' names and shapes
    from config.json (``override_config`` applied), no weights read and no memory behind them (the
    manifest a weight sync is checked against, for an engine that loads the checkpoint itself)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    p = check_model_dir(path)
    config = load_model_config(p, override_config=override_config, trust_remote_code=trust_remote_code)
    auto = AutoModelForImageTextToText if config.model_type in VL_MODEL_TYPES else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=trust_remote_code)


OVERRIDE_KEY = "model.override_config"
# Not an attribute of the config but the attention kernel transformers builds the model with (eager |
# sdpa | flash_attention_2), which verl reads from override_config too: passed to from_pretrained.
ATTN_IMPLEMENTATION = "attn_implementation"


def load_model_config(path: str | os.PathLike, *, override_config: Mapping[str, Any] | None = None,
                      trust_remote_code: bool = False):
    """The Hugging Face config of the model at ``path`` with ``override_config`` applied
    (``apply_config_overrides``): what every role builds its model from, so the actor, the
    reference and the rollout engine see one config."""
    from transformers import AutoConfig

    p = check_model_dir(path)
    overrides = dict(override_config or {})
    attention = overrides.pop(ATTN_IMPLEMENTATION, None)
    config = AutoConfig.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code,
                                        **({} if attention is None else {ATTN_IMPLEMENTATION: attention}))
    apply_config_overrides(config, overrides)
    return config


def apply_config_overrides(config: Any, overrides: Mapping[str, Any], key: str = OVERRIDE_KEY) -> None:
    """Set each entry of ``overrides`` on ``config`` in place, as verl's ``update_model_config``
    does: a mapping value updates the sub-config of that name (``text_config``) entry by entry,
    anything else replaces the attribute. A name the config class does not have is a ValueError
    naming the key and the class: transformers would keep it as an unused extra attribute, so a
    typo (``max_position_embedding``) would change nothing and say nothing."""
    for name, value in overrides.items():
        if not hasattr(config, name):
            raise ValueError(f"{key}.{name}: {type(config).__name__} has no attribute {name!r} (the keys are those of "
                             f"the model's config.json, e.g. max_position_embeddings, attention_dropout, rope_theta)")
        current = getattr(config, name)
        if isinstance(value, Mapping) and _is_config(current):
            apply_config_overrides(current, value, f"{key}.{name}")
        else:
            setattr(config, name, copy.deepcopy(value))


def _is_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _model_type(model_dir: Path) -> str | None:
    """``model_type`` from a model directory's config.json (None when it names none)."""
    return json.loads((model_dir / "config.json").read_text()).get("model_type")


# Where a transformers ``*ForTokenClassification`` model keeps its per-token head.
VALUE_HEAD_NAMES = ("score", "classifier")


def value_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The linear hidden -> 1 head of a value model (``load_value_model``)."""
    return getattr(model, value_head_name(model))


def value_head_name(model: torch.nn.Module) -> str:
    """The attribute name of ``value_head(model)`` (its parameters' name prefix)."""
    for name in VALUE_HEAD_NAMES:
        if isinstance(getattr(model, name, None), torch.nn.Linear):
            return name
    raise ValueError(f"{type(model).__name__} has no value head (a linear layer named one of {VALUE_HEAD_NAMES})")


def load_value_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
):
    """A value model: the backbone of the causal LM at ``path`` with a scalar head per token.

    It is transformers' ``AutoModelForTokenClassification`` with one label (what verl's critic
    loads), so a saved critic is an ordinary Hugging Face directory that loads back the same
    way. Its dropout is off, as verl sets it: the value loss regresses onto returns, and dropout
    noise would only add variance to it.

    A head that ``path`` does not hold (a causal LM: the usual start) is initialised to zero, so
    every first value is 0, a neutral guess on a reward scale centred near 0..1: the first
    advantages are the returns themselves rather than returns minus random noise. The backbone
    gets gradients from the second update on, once the head's weights have moved off zero.
    A head that ``path`` holds (a saved critic) is kept.
    """
    from transformers import AutoModelForTokenClassification

    return _one_label_model(AutoModelForTokenClassification, path, dtype, trust_remote_code,
                            classifier_dropout=0.0).to(device)


def _one_label_model(auto_class: Any, path: str | os.PathLike, dtype: torch.dtype, trust_remote_code: bool,
                     **config_changes: Any) -> Any:
    """``auto_class`` (a token or sequence classifier) with one label from the model at ``path``, the
    config changed by ``config_changes``; a head that ``path`` does not hold is zero (see ``load_value_model``)."""
    p = check_model_dir(path)
    config = load_model_config(p, trust_remote_code=trust_remote_code)
    config.num_labels = 1
    for key, value in config_changes.items():
        setattr(config, key, value)
    with _transformers_quiet():
        model, info = _weights_from_dir(auto_class, p, dtype, trust_remote_code, config=config,
                                        output_loading_info=True)
    head = value_head(model)
    missing = set(info["missing_keys"])
    if any(key.split(".")[0] in VALUE_HEAD_NAMES for key in missing):
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
    return model


def check_sequence_classifier(path: str | os.PathLike, *, trust_remote_code: bool = False) -> None:
    """``path`` is a local scalar sequence classifier (a reward model): its config.json names a
    ``*ForSequenceClassification`` architecture with one label. Reads config.json only."""
    p = check_model_dir(path)
    config = load_model_config(p, trust_remote_code=trust_remote_code)
    architectures = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"{p} holds {architectures or 'no architectures'}, not a *ForSequenceClassification model "
                         "(a reward model scores a whole sequence with one number)")
    if config.num_labels != 1:
        raise ValueError(f"{p} has num_labels={config.num_labels}; a reward model has one (a scalar score)")


def load_sequence_classifier(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
):
    """A frozen reward model: transformers' ``AutoModelForSequenceClassification`` with one label,
    in eval mode (no dropout), safetensors only."""
    from transformers import AutoModelForSequenceClassification

    check_sequence_classifier(path, trust_remote_code=trust_remote_code)
    model = _weights_from_dir(AutoModelForSequenceClassification, Path(path).expanduser(), dtype, trust_remote_code)
    model.requires_grad_(False)
    return model.eval().to(device)


def load_reward_model_to_train(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    pad_token_id: int = 0,
    extra_layers: int = 0,
):
    """The model at ``path`` as a reward model to train (``hybridflow rm``): transformers'
    ``AutoModelForSequenceClassification`` with one label. From a causal LM (the usual start) the
    head is new and zero, as a value model's: every first score is 0 and the first loss log 2 on
    every rank alike (no random draw to agree on), and the backbone gets gradients once the head
    has moved. A reward model's own head is kept. ``extra_layers``: decoder layers appended on top of
    the model's own (``add_pass_through_layers``), so the head reads a layer trained for it."""
    from transformers import AutoModelForSequenceClassification

    changes = _more_layers(path, trust_remote_code, extra_layers) if extra_layers else {}
    model = _one_label_model(AutoModelForSequenceClassification, path, dtype, trust_remote_code, **changes)
    if extra_layers:
        add_pass_through_layers(model, extra_layers)
    allow_padded_batches(model, pad_token_id)
    return model.to(device)


PASS_THROUGH_OUTPUTS = ("self_attn.o_proj", "mlp.down_proj")  # the two writes of a pre-norm layer to the residual


def _more_layers(path: str | os.PathLike, trust_remote_code: bool, extra: int) -> dict[str, Any]:
    """The config changes that give the model at ``path`` ``extra`` more decoder layers, of its last layer's kind."""
    config = load_model_config(path, trust_remote_code=trust_remote_code).get_text_config()
    changes: dict[str, Any] = {"num_hidden_layers": config.num_hidden_layers + extra}
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # transformers picks each layer's attention mask by it
        changes["layer_types"] = [*layer_types, *[layer_types[-1]] * extra]
    return changes


def add_pass_through_layers(model: torch.nn.Module, extra: int) -> None:
    """Make the last ``extra`` decoder layers of ``model`` (new, randomly initialised by transformers) copies
    of the layer below them with their outputs to the residual stream zeroed: each adds nothing, so the model
    computes what it computed before, and on every rank alike (no random draw). The zeroed outputs get
    gradients first (their inputs are the copied layer's non-zero activations), then the rest of the layer.
    For the Llama-style layers (``self_attn.o_proj``, ``mlp.down_proj``: Qwen, Llama, Mistral and kin)."""
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) <= extra:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers (base_model.layers) to add {extra} to")
    source = layers[len(layers) - extra - 1]
    names = {n for n, _ in source.named_modules()}
    if not all(name in names for name in PASS_THROUGH_OUTPUTS):
        raise ValueError(f"{type(source).__name__} has no {' and '.join(PASS_THROUGH_OUTPUTS)}: extra layers are built "
                         "for Llama-style decoder layers only")
    with torch.no_grad():
        for layer in layers[len(layers) - extra:]:
            layer.load_state_dict(source.state_dict())
            for name in PASS_THROUGH_OUTPUTS:
                for param in layer.get_submodule(name).parameters():
                    param.zero_()


def allow_padded_batches(model: torch.nn.Module, pad_token_id: int) -> None:
    """Give a sequence classifier a ``pad_token_id`` when its config has none: transformers refuses
    a batch of more than one row without one, for its own pooling, which ``models.scoring`` discards."""
    config = model.config.get_text_config()
    if config.pad_token_id is None:
        config.pad_token_id = pad_token_id


@contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers' warnings off: loading a causal LM as a value model always "misses" the new
    head and "ignores" the LM head, which is the point, not a problem to report."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def eos_token_ids(model_dir: str | os.PathLike, tokenizer) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS plus generation_config's eos ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    if not ids:
        raise ValueError(f"no EOS token id found for the model in {model_dir}")
    return sorted(ids)
