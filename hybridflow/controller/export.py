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

Either end may be in object storage (``s3://``, ``gs://``): a remote checkpoint (a
``global_step_<N>`` folder, or a checkpoint folder whose newest complete one is taken) is
downloaded and verified first; a remote ``out_dir`` is written and load-checked locally, then
uploaded. Its bucket is checked before anything is read or written.

Only the policy is exported: it is what a user deploys. A PPO checkpoint also holds the critic
(``critic/model``, a Hugging Face token-classification model with one label, loadable with
``AutoModelForTokenClassification`` as it is); it is needed only to resume training.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from hybridflow.controller.checkpoint import (
    STATE_FILE,
    STEP_DIR,
    CheckpointError,
    CheckpointManager,
    RemoteCheckpoints,
    verify_checkpoint,
)
from hybridflow.models.loading import hf_progress_bars_off, load_causal_lm
from hybridflow.models.lora import LORA_MANIFEST, merge_adapter_into_base, read_lora_manifest
from hybridflow.training import sharded_checkpoint
from hybridflow.training.checkpoint import TRAINABLE_FILE
from hybridflow.utils.files import give_default_modes
from hybridflow.utils.storage import Storage, is_remote

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


def _download_checkpoint(url: str, storage: Storage, staging: Path) -> Path:
    """A remote checkpoint folder, or the newest complete one under a remote checkpoint folder,
    downloaded into ``staging`` and verified."""
    local = CheckpointManager(staging, max_to_keep=None)
    parent, name = url.rstrip("/").rsplit("/", 1)
    if STEP_DIR.match(name):
        return RemoteCheckpoints(parent, storage, None).download(url, local)
    found = RemoteCheckpoints(url, storage, None).pull_newest(local)
    if found is None:
        raise CheckpointError(f"{url} is not a checkpoint, nor a checkpoint folder holding a complete one")
    return found


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False,
                      max_shard_bytes: int = EXPORT_SHARD_BYTES, storage: Storage | None = None) -> Path | str:
    """Write the policy of ``checkpoint`` to ``out_dir`` as a Hugging Face directory; returns it.
    Either may be a URL, reached through ``storage``."""
    storage = storage or Storage()
    remote_out = str(out_dir) if is_remote(out_dir) else None
    if remote_out is not None:
        storage.check(remote_out, "root")  # no bucket or no credentials: fail before any work
        if storage.listdir(remote_out) and not overwrite:
            raise FileExistsError(f"{remote_out} exists and is not empty; choose another folder or pass --overwrite")
    if not is_remote(checkpoint) and remote_out is None:
        return _export_local(resolve_checkpoint(checkpoint), Path(out_dir).expanduser(), overwrite, max_shard_bytes)
    with tempfile.TemporaryDirectory(prefix="hybridflow-export-") as tmp:
        ckpt = _download_checkpoint(str(checkpoint), storage, Path(tmp) / "checkpoint") if is_remote(checkpoint) \
            else resolve_checkpoint(checkpoint)
        if remote_out is None:
            return _export_local(ckpt, Path(out_dir).expanduser(), overwrite, max_shard_bytes)
        local = _export_local(ckpt, Path(tmp) / "export", False, max_shard_bytes)
        storage.remove(remote_out)  # only reached when empty or --overwrite
        storage.upload(local, remote_out)
        log.info("uploaded the export to %s", remote_out)
        return remote_out


def _export_local(ckpt: Path, out: Path, overwrite: bool, max_shard_bytes: int) -> Path:
    verify_checkpoint(ckpt)
    model_dir = ckpt / "actor" / "model"
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} holds no Hugging Face model (config.json missing)")
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
    """Load the export with plain transformers (local files only), as a user would, by the Auto class
    its architecture names: a reward model (``hybridflow rm``) or a critic loads as the classifier it
    is, not as a causal LM that would report its head as an unexpected weight."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    architectures = AutoConfig.from_pretrained(model_dir, local_files_only=True).architectures or []
    auto = transformers.AutoModelForCausalLM
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        auto = transformers.AutoModelForSequenceClassification
    elif any(a.endswith("ForTokenClassification") for a in architectures):
        auto = transformers.AutoModelForTokenClassification
    with hf_progress_bars_off():
        auto.from_pretrained(model_dir, local_files_only=True)
