"""``meshtron generate CKPT_OR_EXPORT --prompt "..."``: what a run learned, sampled with transformers' ``generate``.

A meshtron checkpoint (``step-N`` folder) is exported to a temporary Hugging Face directory first
(meshtron.checkpoint.export); an exported directory, or any local Hugging Face model, is loaded as it is; a peft
LoRA adapter directory (``meshtron export --adapter``, or peft's own) is loaded on its base model
(``base_model_name_or_path``) with peft and merged. The prompt is tokenized as training tokenized documents (no
special tokens added), with the run's own tokenizer (``data.tokenizer`` of the checkpoint's config), the
directory's (an adapter's own, else its base's), or ``--tokenizer``. With ``chat`` (``--chat``) the prompt is one
user message rendered with the tokenizer's chat template and its generation prompt (rendered, then tokenized, as
chat fine-tuning does) and only the reply comes back, up to its end (EOS). transformers' progress bars are off.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from meshtron.checkpoint.export import export_checkpoint, quiet_progress_bars
from meshtron.checkpoint.integrity import META
from meshtron.data.tokenizer import has_tokenizer
from meshtron.errors import ConfigError, import_extra

ADAPTER_CONFIG = "adapter_config.json"


def _base_of_adapter(adapter_dir: Path) -> Path:
    """The local base model folder a peft adapter names (``base_model_name_or_path``: a folder, or a hub id at its
    ``revision``, from the Hugging Face cache or fetched)."""
    import json

    from meshtron.data.hub import local_folder

    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    folder = local_folder(base, config.get("revision"), setting=f"{ADAPTER_CONFIG}'s base_model_name_or_path")
    if not base or not (Path(folder) / "config.json").is_file():
        raise ConfigError(
            f"meshtron generate: adapter '{adapter_dir}' names base model {base!r} (base_model_name_or_path in "
            f"{ADAPTER_CONFIG}), which is no local Hugging Face model folder; set it to the base model's folder, "
            "or generate from the merged export (meshtron export CKPT OUT)"
        )
    return Path(folder)


def _merge_peft_adapter(adapter_dir: Path, base: Path, out: Path, trust_remote_code: bool) -> Path:
    """The base model with the adapter merged (peft's ``merge_and_unload``), saved in ``out``."""
    peft = import_extra("peft", needed_by=f"meshtron generate: the peft adapter '{adapter_dir}'", extra="peft")
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=trust_remote_code)
        peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().save_pretrained(out)
    except (OSError, ValueError, RuntimeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"meshtron generate: cannot load adapter '{adapter_dir}' on base '{base}': {first_line}"
        ) from None
    return out


def _tokenizer_for(model_dir: Path, spec: str | None, trust_remote_code: bool):
    """``spec`` (``--tokenizer``, or the run's), by default ``auto``: ``model_dir``'s own tokenizer, else bytes."""
    from meshtron.data.tokenizer import AUTO, load_tokenizer

    return load_tokenizer(spec or AUTO, trust_remote_code, model_dir)


def _check_chat_template(tok, source: str) -> None:
    hf_tokenizer = getattr(tok, "tok", None)
    if hf_tokenizer is None or not getattr(hf_tokenizer, "chat_template", None):
        which = "the byte tokenizer" if hf_tokenizer is None else f"the tokenizer of '{tok.name}'"
        raise ConfigError(
            f"meshtron generate --chat: {which} (used for '{source}') has no chat template; drop --chat to continue "
            "the prompt as plain text, or pass --tokenizer a tokenizer folder with a chat template (the export of a "
            "chat fine-tune, data.format=chat, has its run's)"
        )


def _prompt_ids(tok, prompt: str, chat: bool) -> list[int]:
    if chat:  # rendered, then tokenized without special tokens added: as meshtron.data.chat renders training data
        prompt = tok.tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return [int(i) for i in tok.encode(prompt)]


def generate_text(
    source: str,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    device: str | None = None,
    chat: bool = False,
) -> str:
    """The prompt's continuation (greedy at ``temperature`` 0, else sampled with ``top_p``), decoded; with ``chat``
    the reply to the prompt as a user message, without its end-of-turn EOS."""
    with quiet_progress_bars():
        return _generate_text(
            source, prompt, max_new_tokens, temperature, top_p, seed, tokenizer, trust_remote_code, device, chat
        )


def _generate_text(
    source, prompt, max_new_tokens, temperature, top_p, seed, tokenizer, trust_remote_code, device, chat
) -> str:
    from meshtron.config import load_config
    from meshtron.data.hub import model_folder
    from meshtron.data.tokenizer import resolve_tokenizer

    path = Path(source)
    if not path.is_dir():
        raise ConfigError(f"meshtron generate: '{source}' is not a folder; give a checkpoint (step-N) or an export")
    if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError("meshtron generate: needs --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    checkpoint = (path / META).is_file()
    adapter = not checkpoint and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()
    if not (checkpoint or adapter or (path / "config.json").is_file()):
        raise ConfigError(
            f"meshtron generate: '{source}' is neither a meshtron checkpoint (step-N), a Hugging Face model "
            f"folder (config.json) nor a peft adapter ({ADAPTER_CONFIG}); give one of them"
        )
    tokenizer_dir = path
    if checkpoint:  # its run's tokenizer unless told otherwise
        if tokenizer is None:
            run = load_config(path / "config.toml", env={})
            tokenizer = resolve_tokenizer(run.data.tokenizer, model_folder(run.model))
    elif adapter and not has_tokenizer(path):  # an adapter without a tokenizer of its own: its base's
        tokenizer_dir = _base_of_adapter(path)
    tok = _tokenizer_for(tokenizer_dir, tokenizer, trust_remote_code)
    if chat:
        _check_chat_template(tok, source)
    with tempfile.TemporaryDirectory(prefix="meshtron-generate-") as scratch:
        if checkpoint:
            path = export_checkpoint(str(path), str(Path(scratch) / "model"), trust_remote_code=trust_remote_code)
        elif adapter:
            path = _merge_peft_adapter(path, _base_of_adapter(path), Path(scratch) / "model", trust_remote_code)
        ids = _prompt_ids(tok, prompt, chat)
        return _generate(path, tok, ids, max_new_tokens, temperature, top_p, seed, trust_remote_code, device, chat)


def _generate(
    model_dir: Path,
    tok,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    trust_remote_code: bool,
    device: str | None,
    chat: bool,
) -> str:
    from transformers import AutoModelForCausalLM

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"meshtron generate: cannot load a causal LM from '{model_dir}': {first_line}") from None
    model = model.to(device).eval()
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tok.eos_token_id]], device=device)  # an empty prompt starts after a document's end
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
            top_k=None,
            **sampling,
        )
    new = out[0, ids.shape[1] :].tolist()
    if chat and tok.eos_token_id in new:  # the reply ends at its end of turn
        new = new[: new.index(tok.eos_token_id)]
    return tok.decode(new)
