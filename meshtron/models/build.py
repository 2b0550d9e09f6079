"""Build a Hugging Face causal LM on the meta device, then fill it per rank, independent of the layout.

Fresh weights are drawn in tiles fixed by each parameter's shape, seeded from the parameter's name and the
tile's index, and each rank draws only the tiles its shard overlaps, so the values never depend on how the
model is split. Pretrained weights are read shard by shard: each rank reads only the slice of each tensor
it holds (safetensors slices or a memory-mapped ``weights_only`` file), so no rank ever loads the full model.
"""

from __future__ import annotations

import itertools
import json
import math
import zlib
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.config import ModelConfig
from meshtron.data.hub import is_hub_id, model_folder
from meshtron.errors import ConfigError, MeshtronError
from meshtron.models.adapter import DecoderAdapter, adapter_for, canonical_name
from meshtron.models.context_extension import extend_context
from meshtron.models.families import resolve_attn_implementation
from meshtron.models.lora import is_lora_parameter, lora_init
from meshtron.models.moe import read_experts
from meshtron.models.presets import make_preset_config
from meshtron.tensors import dtensor_like, local_tensor

DEFAULT_PRESET = "tiny"
CHECKPOINT_VOCAB_ATTRIBUTE = "meshtron_checkpoint_vocab_size"
"""Set on a model's config built at a smaller vocabulary than its checkpoint's (a distillation teacher padded
further than the student, meshtron.models.teacher): the embedding and head rows beyond ``vocab_size`` are not read."""


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def check_model_path(model_cfg: ModelConfig, setting: str = "model.name_or_path") -> None:
    """Fail early if ``model.name_or_path`` is missing or is not a decoder-only causal LM (``setting``: the name
    the user gave the folder by, for the message)."""
    if not model_cfg.name_or_path:
        return
    if model_cfg.revision is not None and not is_hub_id(model_cfg.name_or_path):
        raise ConfigError(
            f"model.revision: '{model_cfg.name_or_path}' is a local folder, which has no revisions; leave "
            "model.revision out, or give a hub id (org/name)"
        )
    path = Path(model_folder(model_cfg)).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"{setting}: '{model_cfg.name_or_path}' is not an existing directory nor a hub id (org/name); "
            "give a local Hugging Face model directory, a hub id, or use model.preset"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{setting}: '{path}' has no config.json; it is not a Hugging Face model directory")
    check_causal_lm_config(config_file, setting)


def check_causal_lm_config(config_file: Path, setting: str = "model.name_or_path") -> None:
    """Fail early if the Hugging Face ``config_file`` is not valid JSON or not a decoder-only causal LM's."""
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{setting}: '{config_file}' is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{setting}: '{config_file}' is not a JSON object; it is not a Hugging Face config")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if not model_type and not architectures:
        raise ConfigError(f"{setting}: '{config_file}' names no model_type; it is not a Hugging Face model config")
    if architectures:  # what the checkpoint was trained as decides (BERT has a causal-LM class too)
        causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    else:
        causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if raw.get("is_encoder_decoder") or not causal:
        shown = config_file.parent if config_file.name == "config.json" else config_file
        raise ConfigError(
            f"{setting}: '{shown}' (model_type '{model_type}') is not a decoder-only causal language "
            "model; use a Llama, Qwen or Mistral style model"
        )
    quantization = raw.get("quantization_config")
    if quantization:  # e.g. DeepSeek-V3's FP8 blocks with scales, gpt-oss's MXFP4: read as they are, they are wrong
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else "unknown"
        raise ConfigError(
            f"{setting}: '{config_file.parent}' holds quantized weights (quant_method {method}), which meshtron does "
            "not dequantize; train from a bf16 / fp32 copy (load it with transformers, which dequantizes, and "
            "save_pretrained it)"
        )


def load_hf_config(model_cfg: ModelConfig, tokenizer_vocab_size: int):
    """The Hugging Face config of the model to train, from a preset, a local directory or a hub id's snapshot."""
    if model_cfg.name_or_path:
        check_model_path(model_cfg)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            model_folder(model_cfg), local_files_only=True, trust_remote_code=model_cfg.trust_remote_code
        )
    else:
        config = make_preset_config(model_cfg.preset or DEFAULT_PRESET, tokenizer_vocab_size)
    extend_context(config, model_cfg)
    if tokenizer_vocab_size > config.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer_vocab_size} tokens but the model's vocab_size is {config.vocab_size}; "
            "use the tokenizer that belongs to the model"
        )
    return config


def check_seq_len(hf_config, seq_len: int, setting: str = "data.seq_len") -> None:
    """Refuse sequences longer than the model's positions (``max_position_embeddings``, where it has one)."""
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError(
            f"{setting} {seq_len} is larger than the model's max_position_embeddings {max_positions}; "
            f"use {setting} <= {max_positions}, or extend the model's context with "
            f"{'--rope-scaling' if setting.startswith('--') else 'model.rope_scaling'} "
            "(docs/models.md#longer-context-modelrope_scaling)"
        )


def build_meta_model(hf_config, model_cfg: ModelConfig) -> tuple[nn.Module, DecoderAdapter]:
    """Instantiate the model on the meta device (no memory) and find its adapter."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            hf_config,
            attn_implementation=resolve_attn_implementation(model_cfg.attn_implementation, hf_config),
            dtype=torch_dtype(model_cfg.dtype),
            trust_remote_code=model_cfg.trust_remote_code,
        )
    adapter = adapter_for(hf_config)
    adapter.check_anatomy(model)
    adapter.split_fused_projections(model)
    return model, adapter


def _name_seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


# Fresh matrices are drawn in tiles fixed by the parameter's shape alone, each from its own CPU generator seeded
# from (seed, name, tile index): the last dim in tiles of min(C, TILE_COLUMNS) columns, the second-to-last in tiles
# of max(1, TILE_ELEMENTS // those columns) rows, every leading dim (experts) one index per tile. The full tensor
# is its tiles put together, so a rank draws only the tiles its shard overlaps, and the values depend neither on
# the layout nor on the device (always CPU generators).
# 256 x 256 tiles align with the FSDP8 / tp8 shards of Llama-8B's and -70B's matrices, except the vocabulary's
# and the key/value projections' 128-row FSDP8 shards (rank 0 of Llama-8B's FSDP8 draws 1.038e9 values for its
# 1.004e9); a tile costs ~6 us on top of its ~0.3 ms of drawing.
# Tensors of at most WHOLE_DRAW_ELEMENTS values are drawn whole from one generator seeded from (seed, name), as all
# were before tiles: drawing one costs milliseconds, and small models (every test model) keep the values, and so the
# rounding noise, their runs were measured with.
TILE_COLUMNS = 256
TILE_ELEMENTS = 2**16
WHOLE_DRAW_ELEMENTS = 2**20


def _tile_seed(seed: int, name: str, index: int) -> int:
    # The CPU generator keeps the seed's low 32 bits; an odd multiplier keeps the tiles of one tensor distinct there.
    return (_name_seed(seed, name) + (index + 1) * 0x9E3779B97F4A7C15) % (2**63)


def init_tensor(name: str, shape: torch.Size, std: float, seed: int, norm_value: float = 1.0) -> torch.Tensor:
    """Fresh full-size fp32 value of parameter ``name``: normal(0, std) matrices and attention sinks (gpt-oss's
    per-head ``self_attn.sinks``, as transformers draws them), ``norm_value`` for norms (0 for norms that scale by
    ``1 + weight``), 0 for biases (gpt-oss's experts' ``gate_up_proj_bias`` / ``down_proj_bias`` too)."""
    return init_region(name, shape, std, seed, norm_value)


def init_region(
    name: str,
    shape: torch.Size,
    std: float,
    seed: int,
    norm_value: float = 1.0,
    region: tuple[slice, ...] | None = None,
) -> torch.Tensor:
    """``init_tensor(name, shape, std, seed, norm_value)[region]`` (``region``: contiguous slices, None: all),
    drawing only the tiles of a matrix that ``region`` overlaps."""
    shape = tuple(shape)
    region = region or ()
    bounds = []
    for dim, size in enumerate(shape):
        piece = region[dim] if dim < len(region) else slice(None)
        start, stop, step = piece.indices(size)
        if step != 1:
            raise ValueError(f"init_region: region {region} of '{name}' is not contiguous")
        bounds.append((start, max(start, stop)))
    out_shape = tuple(stop - start for start, stop in bounds)
    if name.endswith((".bias", "_bias")):
        return torch.zeros(out_shape)
    if len(shape) <= 1 and not name.endswith(".sinks"):
        return torch.full(out_shape, float(norm_value))
    if len(shape) <= 1 or math.prod(shape) <= WHOLE_DRAW_ELEMENTS:
        generator = torch.Generator().manual_seed(_name_seed(seed, name))
        full = torch.normal(0.0, std, shape, generator=generator)
        return full[tuple(slice(start, stop) for start, stop in bounds)].clone()
    out = torch.empty(out_shape)
    if out.numel() == 0:
        return out
    *lead, (row0, row1), (col0, col1) = bounds
    rows, cols = shape[-2:]
    tile_cols = min(cols, TILE_COLUMNS)
    tile_rows = max(1, TILE_ELEMENTS // tile_cols)
    row_tiles, col_tiles = -(-rows // tile_rows), -(-cols // tile_cols)
    for index in itertools.product(*(range(start, stop) for start, stop in lead)):
        matrix = 0
        for i, size in zip(index, shape[:-2]):
            matrix = matrix * size + i
        where = tuple(i - start for i, (start, _) in zip(index, lead))
        for r in range(row0 // tile_rows, (row1 - 1) // tile_rows + 1):
            top, bottom = r * tile_rows, min(rows, (r + 1) * tile_rows)
            for c in range(col0 // tile_cols, (col1 - 1) // tile_cols + 1):
                left, right = c * tile_cols, min(cols, (c + 1) * tile_cols)
                number = (matrix * row_tiles + r) * col_tiles + c
                generator = torch.Generator().manual_seed(_tile_seed(seed, name, number))
                tile = torch.normal(0.0, std, (bottom - top, right - left), generator=generator)
                r0, r1, c0, c1 = max(row0, top), min(row1, bottom), max(col0, left), min(col1, right)
                placed = (*where, slice(r0 - row0, r1 - row0), slice(c0 - col0, c1 - col0))
                out[placed] = tile[r0 - top : r1 - top, c0 - left : c1 - left]
    return out


class CheckpointReader:
    """Reads single tensors from a Hugging Face model directory (safetensors, else ``weights_only`` torch files)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._torch_files: dict[Path, dict] = {}
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.directory / index_name
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self._where = {k: self.directory / v for k, v in weight_map.items()}
                return
        for single in ("model.safetensors", "pytorch_model.bin"):
            file = self.directory / single
            if file.is_file():
                self._where = {k: file for k in self._keys_of(file)}
                return
        raise MeshtronError(
            f"model.name_or_path: '{self.directory}' has no model.safetensors or pytorch_model.bin weights; "
            "use model.preset to train from scratch"
        )

    def _keys_of(self, file: Path) -> list[str]:
        if file.suffix == ".safetensors":
            return list(self._handle(file).keys())
        return list(self._torch_file(file).keys())

    def _handle(self, file: Path):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def _torch_file(self, file: Path) -> dict:
        if file not in self._torch_files:
            self._torch_files[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        return self._torch_files[file]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        file = self._where[name]
        if file.suffix == ".safetensors":
            return tuple(self._handle(file).get_slice(name).get_shape())
        return tuple(self._torch_file(file)[name].shape)

    def get(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name``, or only ``region`` of it (read from disk without loading the rest)."""
        file = self._where[name]
        if file.suffix == ".safetensors":
            if region is None:
                return self._handle(file).get_tensor(name)
            return self._handle(file).get_slice(name)[region]
        tensor = self._torch_file(file)[name]  # memory-mapped: slicing reads only the region
        return tensor if region is None else tensor[region].clone()


def _local_region(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The slice of the full tensor that this rank's shard of ``param`` holds (None: all of it)."""
    if not isinstance(param, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def _weight_for(
    name: str, param: torch.Tensor, reader: CheckpointReader, adapter: DecoderAdapter, config, region
) -> torch.Tensor:
    """This rank's ``region`` of parameter ``name`` read from the checkpoint, wherever the family keeps it there
    (``adapter.checkpoint_sources``: another name, or a row range of a fused tensor; a mixture of experts'
    fused expert parameter: the experts' own tensors, ``moe.read_experts``)."""
    wanted = tuple(param.shape)
    for candidate, first_row in adapter.checkpoint_sources(name, config):
        if candidate not in reader:
            continue
        shape = reader.shape(candidate)
        if first_row is None and _vocabulary_prefix(shape, wanted, config):
            first_row = 0  # the checkpoint's first vocab_size rows
        if first_row is None:
            fits = shape == wanted
        else:  # rows first_row.. of a fused tensor
            fits = len(shape) == len(wanted) and shape[1:] == wanted[1:] and shape[0] >= first_row + wanted[0]
        if not fits:
            rows = "" if first_row is None else f" from row {first_row}"
            raise MeshtronError(
                f"model.name_or_path: weight '{candidate}' has shape {shape} but the config asks for {wanted}{rows}; "
                "the weights do not belong to this config.json"
            )
        if first_row is None:
            return reader.get(candidate, region)
        region = region or tuple(slice(0, size) for size in wanted)
        row_range = slice(region[0].start + first_row, region[0].stop + first_row)
        return reader.get(candidate, (row_range, *region[1:]))
    experts = read_experts(name, wanted, reader, region, adapter.family)  # MoE experts saved one by one
    if experts is not None:
        return experts
    raise MeshtronError(f"model.name_or_path: the checkpoint has no weight '{name}'; it does not match config.json")


def _vocabulary_prefix(shape: tuple[int, ...], wanted: tuple[int, ...], config) -> bool:
    """Whether a checkpoint tensor of ``shape`` is an embedding or head padded to the checkpoint's larger vocabulary
    (``CHECKPOINT_VOCAB_ATTRIBUTE``), of which the model holds the first ``config.vocab_size`` rows."""
    checkpoint_vocab = getattr(config, CHECKPOINT_VOCAB_ATTRIBUTE, None)
    return (
        checkpoint_vocab is not None
        and shape[:1] == (checkpoint_vocab,)
        and wanted[:1] == (config.vocab_size,)
        and shape[1:] == wanted[1:]
    )


@torch.no_grad()
def materialize(
    model: nn.Module,
    adapter: DecoderAdapter,
    device: torch.device,
    *,
    seed: int,
    pretrained_dir: str | None = None,
    buffer_device: torch.device | None = None,
) -> None:
    """Allocate the (possibly sharded) parameters on ``device`` and fill each with this rank's region only.

    ``buffer_device``: where every buffer goes (computed ones such as rotary frequencies, and persistent ones
    such as DeepSeek-V3's router bias), if not ``device``: the compute device when FSDP offloads the parameters
    to the CPU (see data_parallel.parameter_device); FSDP moves only parameters between the two.
    """
    model.to_empty(device=device)
    if buffer_device is not None and torch.device(buffer_device) != torch.device(device):
        _buffers_to_empty(model, torch.device(buffer_device))
    # to_empty gives each module a new Parameter for plain tensors, which unties a tied head.
    adapter.tie_weights(model)
    adapter.init_buffers(model, buffer_device or device)
    reader = CheckpointReader(pretrained_dir) if pretrained_dir else None
    std = getattr(model.config, "initializer_range", 0.02)
    # A pipeline stage of a tied model names {head: embeddings}: its head starts as the first stage's embeddings.
    tied_to = getattr(model, "pipeline_tied_weights", {})
    for raw_name, param in model.named_parameters():
        name = canonical_name(raw_name)
        name = tied_to.get(name, name)
        region = _local_region(param)
        if is_lora_parameter(name):  # never in a pretrained model: LoRA's own start, from the seed and the name
            full = lora_init(name, param.shape, torch.Generator().manual_seed(_name_seed(seed, name)))
            local = full if region is None else full[region]
        elif reader is not None:
            local = _weight_for(name, param, reader, adapter, model.config, region)
        else:  # only the tiles the shard overlaps are drawn; the values never depend on the layout
            local = init_region(name, param.shape, std, seed, adapter.norm_init, region)
        target = local_tensor(param)
        target.copy_(local.to(device=device, dtype=param.dtype))
    _fill_persistent_buffers(model, reader)


def _buffers_to_empty(model: nn.Module, device: torch.device) -> None:
    """Give every buffer of ``model`` fresh (uninitialized) memory on ``device``, as ``to_empty`` does; a DTensor
    buffer (one a tensor-parallel style replicated) keeps its mesh and placements."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is None or buffer.device == device:
                continue
            if isinstance(buffer, DTensor):
                local = torch.empty_like(buffer.to_local(), device=device)
                fresh = dtensor_like(local, buffer)
            else:
                fresh = torch.empty_like(buffer, device=device)
            module._buffers[name] = fresh


@torch.no_grad()
def _fill_persistent_buffers(model: nn.Module, reader: CheckpointReader | None) -> None:
    """State the model saves that is no parameter (DeepSeek-V3's router bias ``e_score_correction_bias``), left
    uninitialized by ``to_empty``: read from a pretrained checkpoint that holds it, else zero (as transformers
    initializes it)."""
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full_name = canonical_name(f"{module_name}.{name}" if module_name else name)
            target = local_tensor(buffer)
            if reader is not None and full_name in reader:
                target.copy_(reader.get(full_name).to(device=target.device, dtype=target.dtype))
            else:
                target.zero_()
