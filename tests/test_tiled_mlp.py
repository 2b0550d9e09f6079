"""Tiled MLP (train.mlp_tiles): the same outputs and gradients as the untiled MLP, less kept for backward, refusals.
Parity of the layouts (FSDP, TP, CP with checkpointing, PP with 1F1B and zero-bubble): *_mlp_tiles in test_parity.py."""

from __future__ import annotations

import pytest
import torch
from conftest import train_llama_tiny
from torch import nn

from meshtron.config import load_config
from meshtron.distributed.activation_memory.tiled_mlp import apply_tiled_mlp, check_mlp_tiles
from meshtron.errors import ConfigError
from meshtron.models.presets import make_preset_config


def llama_block():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = make_preset_config("llama-tiny", 257)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaDecoderLayer(config, layer_idx=0)


ROLES = {"mlp": "mlp", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


@pytest.mark.parametrize("tokens", [16, 13])  # 13: tiles of unequal length
def test_tiles_give_the_mlps_outputs_and_gradients(tokens):
    plain, tiled = llama_block().mlp, llama_block().mlp
    holder = nn.Module()
    holder.mlp = tiled
    apply_tiled_mlp([("layers.0", holder)], lambda block: ROLES, 4)
    assert type(tiled).__name__ == "TiledLlamaMLP" and list(tiled.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, tokens, plain.gate_proj.in_features, generator=torch.Generator().manual_seed(1))
    inputs = [x.clone().requires_grad_(True) for _ in range(2)]
    outputs = [mlp(inp) for mlp, inp in zip((plain, tiled), inputs)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(outputs[0])
    for out in outputs:
        out.backward(grad)
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation and generation run untiled
        torch.testing.assert_close(tiled(x), plain(x))


def test_a_run_with_tiles_trains_the_same_model_and_keeps_less_for_backward(tmp_path, cache_dir):
    results = {
        tiles: train_llama_tiny(cache_dir, tmp_path / str(tiles), f"train.mlp_tiles={tiles}") for tiles in (0, 4)
    }
    plain, tiled = results[0], results[4]
    assert tiled.losses == pytest.approx(plain.losses, rel=1e-6)
    assert tiled.grad_norms == pytest.approx(plain.grad_norms, rel=1e-5)
    # llama-tiny: intermediate 4x hidden; measured 2.95 MB -> 1.64 MB at 4 x 64 tokens (docs/long-context.md)
    assert tiled.activation_bytes < 0.7 * plain.activation_bytes, (tiled.activation_bytes, plain.activation_bytes)


def test_what_tiles_cannot_split_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train.mlp_tiles: must be >= 0"):
        load_config(None, ["train.mlp_tiles=-1"], env={})
    with pytest.raises(ConfigError, match="mixtures of experts"):
        check_mlp_tiles(4, make_preset_config("qwen3moe-tiny", 257))
    check_mlp_tiles(0, make_preset_config("qwen3moe-tiny", 257))  # off: nothing to refuse
    block = llama_block()
    block.mlp.dropout = nn.Dropout(0.1)
    with pytest.raises(ConfigError, match="other dropout masks"):
        apply_tiled_mlp([("layers.0", block)], lambda b: ROLES, 4)
    with pytest.raises(ConfigError, match="block layers.0 has no dense MLP"):
        apply_tiled_mlp([("layers.0", block)], lambda b: {"mlp": "replicated_block"}, 4)


def test_the_planner_models_tiles_and_emits_them(tmp_path):
    """Fewer activation bytes (the MLP keeps its input only) and a longer compute time (its forward again) for the
    same layout; the emitted config sets train.mlp_tiles."""
    import json

    from conftest import run_main

    args = ["plan", "--model", "llama-1b", "--gpus", "4", "--seq-len", "8192", "--global-batch", "4", "--json"]
    plain, tiled = (json.loads(run_main(args + extra).stdout) for extra in ([], ["--mlp-tiles", "8"]))

    def by_layout(plan):
        return {json.dumps(c["layout"], sort_keys=True): c for c in plan["candidates"]}

    plain_rows, tiled_rows = by_layout(plain), by_layout(tiled)
    unchecked = [k for k, c in tiled_rows.items() if c["layout"]["activation_checkpointing"] == "none"]
    assert unchecked
    for key in unchecked:
        assert tiled_rows[key]["memory_gb"]["activations"] < 0.8 * plain_rows[key]["memory_gb"]["activations"]
        assert tiled_rows[key]["compute_s"] > plain_rows[key]["compute_s"]
    emitted = tmp_path / "tiled.toml"
    assert run_main([*args[:-1], "--mlp-tiles", "8", "--emit-config", str(emitted)]).returncode == 0
    assert load_config(emitted, env={}).train.mlp_tiles == 8  # the config trains with the tiles it was planned with


def test_tiles_recompute_with_the_forwards_compute_dtype_weights(tmp_path, cache_dir):
    """bf16 compute without FSDP (precision.apply_compute_casts): the block's hooks swap the bf16 weight copies in for
    its forward only, so backward's recomputation of the tiles must use the copies the forward used (it met the
    float32 weights and bf16 inputs: "expected mat1 and mat2 to have the same dtype", found on an H200)."""
    bf16 = ("precision.mixed_precision=bf16", "train.compile=false")
    plain, tiled = (train_llama_tiny(cache_dir, tmp_path / str(n), *bf16, f"train.mlp_tiles={n}") for n in (0, 4))
    assert tiled.losses == pytest.approx(plain.losses, rel=1e-3)
    assert tiled.grad_norms == pytest.approx(plain.grad_norms, rel=2e-2)
