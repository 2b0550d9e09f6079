"""``meshtron generate CKPT_OR_EXPORT --prompt "..."``: what a run learned, sampled with transformers' ``generate``.

A meshtron checkpoint (``step-N`` folder) is exported to a temporary Hugging Face directory first
(meshtron.checkpoint.export); an exported directory, or any local Hugging Face model, is loaded as it is; a peft
LoRA adapter directory (``meshtron export --adapter``, or peft's own) is loaded on its base model
(``base_model_name_or_path``) with peft and merged. The prompt is tokenized as training tokenized documents (no
special tokens added), with the run's own tokenizer (``data.tokenizer`` of the checkpoint's config), the
directory's (an adapter's: its base's), or ``--tokenizer``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from meshtron.checkpoint.integrity import META
from meshtron.errors import ConfigError

ADAPTER_CONFIG = "adapter_config.json"


def _base_of_adapter(adapter_dir: Path) -> Path:
    """The local base model folder a peft adapter names (``base_model_name_or_path``)."""
    import json

    base = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ConfigError(
            f"meshtron generate: adapter '{adapter_dir}' names base model {base!r} (base_model_name_or_path in "
            f"{ADAPTER_CONFIG}), which is no local Hugging Face model folder; set it to the base model's folder, "
            "or generate from the merged export (meshtron export CKPT OUT)"
        )
    return Path(base)


def _merge_peft_adapter(adapter_dir: Path, base: Path, out: Path, trust_remote_code: bool) -> Path:
    """The base model with the adapter merged (peft's ``merge_and_unload``), saved in ``out``."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ConfigError(
            f"meshtron generate: '{adapter_dir}' is a peft adapter and loading it needs peft; pip install peft"
        ) from None
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=trust_remote_code)
        PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().save_pretrained(out)
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
) -> str:
    """The prompt's continuation (greedy at ``temperature`` 0, else sampled with ``top_p``), decoded."""
    from meshtron.checkpoint.export import export_checkpoint
    from meshtron.config import load_config
    from meshtron.data.tokenizer import resolve_tokenizer

    path = Path(source)
    if not path.is_dir():
        raise ConfigError(f"meshtron generate: '{source}' is not a folder; give a checkpoint (step-N) or an export")
    if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError("meshtron generate: needs --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    with tempfile.TemporaryDirectory(prefix="meshtron-generate-") as scratch:
        tokenizer_dir = path
        if (path / META).is_file():  # a meshtron checkpoint: its run's tokenizer unless told otherwise
            if tokenizer is None:
                run = load_config(path / "config.toml", env={})
                tokenizer = resolve_tokenizer(run.data.tokenizer, run.model.name_or_path)
            path = export_checkpoint(str(path), str(Path(scratch) / "model"), trust_remote_code=trust_remote_code)
            tokenizer_dir = path
        elif (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
            tokenizer_dir = _base_of_adapter(path)
            path = _merge_peft_adapter(path, tokenizer_dir, Path(scratch) / "model", trust_remote_code)
        elif not (path / "config.json").is_file():
            raise ConfigError(
                f"meshtron generate: '{source}' is neither a meshtron checkpoint (step-N), a Hugging Face model "
                f"folder (config.json) nor a peft adapter ({ADAPTER_CONFIG}); give one of them"
            )
        tok = _tokenizer_for(tokenizer_dir, tokenizer, trust_remote_code)
        return _generate(path, tok, prompt, max_new_tokens, temperature, top_p, seed, trust_remote_code, device)


def _generate(
    model_dir: Path,
    tok,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    trust_remote_code: bool,
    device: str | None,
) -> str:
    from transformers import AutoModelForCausalLM

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"meshtron generate: cannot load a causal LM from '{model_dir}': {first_line}") from None
    model = model.to(device).eval()
    ids = torch.as_tensor(tok.encode(prompt), dtype=torch.long, device=device).reshape(1, -1)
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
    return tok.decode(out[0, ids.shape[1] :].tolist())
