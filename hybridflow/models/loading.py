"""Loading models and tokenizers from local Hugging Face directories.

Nothing here downloads: ``local_files_only=True`` everywhere, and a path that is not a local
directory is an error that says so. The built-in model (``builtin:tiny``) is materialised as
an ordinary HF directory first (see ``hybridflow.models.tiny``) and then loaded by the same code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

BUILTIN_PREFIX = "builtin:"


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


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    p = check_model_dir(path)
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        # Padding positions are masked everywhere; any id works, EOS is the usual choice.
        tok.pad_token = tok.eos_token
    if getattr(tok, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer in {p} has no chat template; prompts are chat messages and need one "
            "(add chat_template to tokenizer_config.json or a chat_template.jinja file)"
        )
    return tok


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
):
    """A causal LM from a local directory, safetensors only (no pickle), on ``device``."""
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(
        p,
        dtype=dtype,
        local_files_only=True,
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
    )
    return model.to(device)


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
