"""``meshtron export CHECKPOINT OUT_DIR``: a meshtron checkpoint as a Hugging Face model directory.

The checkpoint's model tensors (saved under any layout) are loaded whole into one process and written
with ``save_pretrained`` as safetensors (sharded with an index above ``max_shard_size``), with the
tokenizer when the run used a Hugging Face tokenizer directory: loaded from it and written with the tokenizer's own
``save_pretrained``, so everything it needs comes along (its chat template, ``vocab.json`` / ``merges.txt``, ...).
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load the result; so does meshtron's
``model.name_or_path``. A run on the byte tokenizer exports no tokenizer files (``meshtron generate`` then uses
the byte tokenizer). transformers' progress bars are off while exporting.

A checkpoint is trusted input: torch.distributed.checkpoint unpickles its ``.metadata``. Remote code
(``trust_remote_code``) still runs only when the command line asks for it, never because the
checkpoint's own ``config.toml`` says so.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from meshtron.checkpoint.integrity import altered, damage, recorded_checksums
from meshtron.checkpoint.lora_export import merge_adapters, write_peft_adapter
from meshtron.checkpoint.manager import quiet_single_process, read_meta
from meshtron.errors import ConfigError, MeshtronError


@contextmanager
def quiet_progress_bars():
    """transformers' (and the hub's) progress bars off ("Loading weights", "Writing model shards"), then as before."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def export_checkpoint(
    checkpoint: str,
    out_dir: str,
    max_shard_size: str = "2GB",
    trust_remote_code: bool = False,
    adapter_only: bool = False,
) -> Path:
    """Write ``checkpoint``'s model to ``out_dir`` (which must not exist or be empty); returns the directory.

    ``trust_remote_code``: the caller's choice (``meshtron export --trust-remote-code``); the value in the
    checkpoint's config is ignored. A LoRA run (``[lora]``) exports the merged model, or with ``adapter_only``
    (``--adapter``) a peft adapter directory (meshtron.checkpoint.lora_export), with the run's tokenizer as well.
    """
    with quiet_progress_bars():
        return _export(Path(checkpoint), Path(out_dir), max_shard_size, trust_remote_code, adapter_only)


def peft_base(model) -> tuple[str | None, str | None]:
    """(``base_model_name_or_path``, ``revision``) for a peft adapter of a run on ``model`` (its ModelConfig): a hub
    id with its commit, or the folder's absolute path (peft resolves a relative one against its own cwd)."""
    from meshtron.data.hub import is_hub_id

    if not model.name_or_path:
        return None, None
    if is_hub_id(model.name_or_path):
        return model.name_or_path, model.revision
    return os.path.abspath(os.path.expanduser(model.name_or_path)), None


def _export(source: Path, target: Path, max_shard_size: str, trust_remote_code: bool, adapter_only: bool) -> Path:
    from meshtron.config import load_config
    from meshtron.data.hub import model_folder
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.models.build import build_meta_model, load_hf_config, materialize
    from meshtron.models.lora import add_lora

    check_export_target(target)
    reason = damage(source)
    if reason is None:
        reason = altered(source, {name: crc for name, (_, crc) in recorded_checksums(source).items()})
    if reason is not None:
        raise ConfigError(
            f"meshtron export: '{source}' is not a whole meshtron checkpoint ({reason}); give a step-N "
            "folder from a run's checkpoints/ directory"
        )
    read_meta(source)
    saved = load_config(source / "config.toml", env={})
    cfg = replace(saved, model=replace(saved.model, trust_remote_code=trust_remote_code))
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.trust_remote_code, model_folder(cfg.model))
    hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    model, adapter = build_meta_model(hf_config, cfg.model)
    if adapter_only and not cfg.lora.enabled:
        raise ConfigError(
            f"meshtron export --adapter: checkpoint '{source}' is not of a LoRA run (lora.rank=0); export it "
            "without --adapter"
        )
    targets = add_lora(model, adapter, cfg.lora) if cfg.lora.enabled else []
    if cfg.lora.enabled:  # the checkpoint holds what trained: the frozen base is made as the run made it
        materialize(model, adapter, torch.device("cpu"), seed=cfg.train.seed, pretrained_dir=model_folder(cfg.model))
    else:
        model.to_empty(device=torch.device("cpu"))
        adapter.tie_weights(model)
        adapter.init_buffers(model, torch.device("cpu"))
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    weights = {name: t for name, t in model.state_dict().items() if not cfg.lora.enabled or name in trained}
    if getattr(hf_config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # saved once, as the embeddings
    state = {"model": weights}
    try:
        with quiet_single_process():
            dcp.load(state, checkpoint_id=str(source), no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP raises many types for a broken or foreign checkpoint
        raise MeshtronError(f"checkpoint '{source}' could not be loaded: {str(err).splitlines()[0]}") from None
    missing = model.load_state_dict(state["model"], strict=False).missing_keys
    frozen = set(model.state_dict()) - trained if cfg.lora.enabled else set()  # LoRA: the base, made above
    if set(missing) - {"lm_head.weight"} - frozen:
        raise ConfigError(f"checkpoint '{source}' lacks model weights {sorted(missing)[:3]}; it is incomplete")
    adapter.tie_weights(model)
    if adapter_only:
        base, revision = peft_base(cfg.model)
        write_peft_adapter(model, adapter, cfg.lora, targets, base, target, revision)
        _save_tokenizer(tokenizer, target)
        return target
    merge_adapters(model)
    adapter.fuse_projections(model)  # the family's own layout (Phi-3's fused qkv_proj and gate_up_proj)
    model.config.architectures = [type(model).__name__]
    try:
        target.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(target, safe_serialization=True, max_shard_size=max_shard_size)
    except OSError as err:  # a disk that filled up, a folder made unwritable meanwhile
        raise MeshtronError(
            f"meshtron export: writing '{target}' failed ({err}); free disk space or choose another directory"
        ) from None
    _save_tokenizer(tokenizer, target)
    return target


def check_export_target(target: Path) -> None:
    """Refuse, before any work, an export directory that would overwrite what is there or cannot be made: an
    existing file, a folder that is not empty, a path under a file or in a folder this user cannot write."""
    nothing = "choose a new directory (nothing was written)"
    if target.is_symlink() and not target.exists():
        raise ConfigError(f"export directory '{target}' is a link to nothing; {nothing}")
    if target.exists():
        if not target.is_dir():
            raise ConfigError(f"export directory '{target}' is an existing file; {nothing}")
        try:
            empty = not any(target.iterdir())
        except OSError as err:
            raise ConfigError(
                f"export directory '{target}' cannot be read ({err.strerror or err}); {nothing}"
            ) from None
        if not empty:
            raise ConfigError(f"export directory '{target}' is not empty; {nothing}")
        writable = target
    else:
        writable = next(parent for parent in target.absolute().parents if parent.exists())
        if not writable.is_dir():
            raise ConfigError(f"export directory '{target}' cannot be made: '{writable}' is a file; {nothing}")
    if not os.access(writable, os.W_OK | os.X_OK):
        raise ConfigError(f"export directory '{target}' cannot be made: '{writable}' is not writable; {nothing}")


def _save_tokenizer(tokenizer, target: Path) -> None:
    """A Hugging Face tokenizer (meshtron.data.tokenizer.HFTokenizer: loaded from the run's folder with local files
    only, its own code only when asked) saved whole; the byte tokenizer has no files."""
    hf_tokenizer = getattr(tokenizer, "tok", None)
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(target)
