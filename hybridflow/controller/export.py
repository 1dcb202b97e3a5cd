"""Export a training checkpoint as a plain Hugging Face model directory.

A full-format checkpoint's ``actor/model`` folder is already in Hugging Face format (config,
tokenizer, safetensors); a sharded one (``trainer.checkpoint_format``) holds the same folder
without weights, and the weights are written from the shards a file of at most
``max_shard_bytes`` at a time (``sharded_checkpoint.write_hf_weights``), never the whole model
in memory at once. Exporting verifies the checkpoint against its manifest, copies only the model
files (not the optimizer state), writes them atomically, and loads the result with
``transformers`` to prove it is usable before reporting success (that check does hold the
whole model).

A LoRA checkpoint (``actor.lora.rank`` > 0) holds only the adapter (``model/lora.json`` names
the base model's directory and the adapter's shape): the export loads the base model, merges the
adapter into it with PEFT's ``merge_and_unload`` and writes the merged model, a plain Hugging Face
directory of the base model's class and names (that path holds the whole model in memory).

Only the policy is exported: it is what a user deploys. A PPO checkpoint also holds the critic
(``critic/model``, a Hugging Face token-classification model with one label, loadable with
``AutoModelForTokenClassification`` as it is); it is needed only to resume training.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from hybridflow.controller.checkpoint import STATE_FILE, CheckpointError, CheckpointManager, verify_checkpoint
from hybridflow.models.loading import hf_progress_bars_off, load_causal_lm
from hybridflow.models.lora import LORA_MANIFEST, merge_adapter_into_base, read_lora_manifest
from hybridflow.training import sharded_checkpoint
from hybridflow.training.engine import TRAINABLE_FILE
from hybridflow.utils.files import give_default_modes

log = logging.getLogger(__name__)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the newest intact one under a run folder or a ``checkpoints`` folder."""
    p = Path(path).expanduser()
    if (p / STATE_FILE).is_file():
        return p
    for root in (p / "checkpoints", p):
        found = CheckpointManager(root, max_to_keep=None).find("auto", None)
        if found is not None:
            return found
    raise CheckpointError(f"{p} is not a checkpoint, nor a run or checkpoints folder holding an intact one")


# A sharded checkpoint's weights are written in safetensors files of at most this many bytes:
# an export holds one file's tensors at a time (transformers' own default shard is larger).
EXPORT_SHARD_BYTES = 1 << 30


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False,
                      max_shard_bytes: int = EXPORT_SHARD_BYTES) -> Path:
    """Write the policy of ``checkpoint`` to ``out_dir`` as a Hugging Face directory; returns it."""
    ckpt = resolve_checkpoint(checkpoint)
    verify_checkpoint(ckpt)
    model_dir = ckpt / "actor" / "model"
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} holds no Hugging Face model (config.json missing)")
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another folder or pass --overwrite")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_export(ckpt / "actor", tmp, max_shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("exported %s -> %s", ckpt, out)
    return out


def _write_export(actor_dir: Path, tmp: Path, max_shard_bytes: int) -> None:
    shutil.copytree(actor_dir / "model", tmp)
    lora = read_lora_manifest(actor_dir / "model")
    if lora is not None:
        _write_merged_lora(actor_dir, tmp, *lora, max_shard_bytes=max_shard_bytes)
    elif sharded_checkpoint.is_sharded_checkpoint(actor_dir):
        sharded_checkpoint.write_hf_weights(actor_dir, tmp, max_shard_bytes=max_shard_bytes, skip=_tied_outputs(tmp))
    give_default_modes(tmp)  # checkpoints written before modes were fixed hold a 0600 model.safetensors
    _check_loads(tmp)


def _write_merged_lora(actor_dir: Path, tmp: Path, base_path: str, spec, *, max_shard_bytes: int) -> None:
    """The base model with the checkpoint's adapter merged, saved in ``tmp`` (which already holds
    the checkpoint's config and tokenizer); the adapter files are not part of the export."""
    from safetensors.torch import load_file

    if not Path(base_path).is_dir():
        raise CheckpointError(f"{actor_dir / 'model' / LORA_MANIFEST}: its base model {base_path} is gone; the "
                              f"export merges the adapter into it")
    if sharded_checkpoint.is_sharded_checkpoint(actor_dir):
        dcp_dir = actor_dir / sharded_checkpoint.DCP_DIR
        metadata = sharded_checkpoint.read_metadata(dcp_dir)
        names = list(sharded_checkpoint.tensor_shapes(metadata, sharded_checkpoint.MODEL_PREFIX))
        adapters = sharded_checkpoint.read_model_tensors(dcp_dir, names, metadata)
    else:
        adapters = load_file(actor_dir / "model" / TRAINABLE_FILE)
    with hf_progress_bars_off():
        merged = merge_adapter_into_base(load_causal_lm(base_path), spec, adapters)
        merged.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_bytes)
    for name in (TRAINABLE_FILE, LORA_MANIFEST):
        (tmp / name).unlink(missing_ok=True)


def _tied_outputs(model_dir: Path) -> frozenset[str]:
    """The output embedding when the config ties it to the input one: HF files hold it once."""
    from transformers import AutoConfig

    tied = getattr(AutoConfig.from_pretrained(model_dir, local_files_only=True), "tie_word_embeddings", False)
    return frozenset({"lm_head.weight"}) if tied else frozenset()


def _check_loads(model_dir: Path) -> None:
    """Load the export with plain transformers (local files only), as a user would."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with hf_progress_bars_off():
        AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
