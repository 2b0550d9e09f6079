"""Device choice, torch version check, the precision policy, the cast hooks and fp16 loss scaling (fast, 1 process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import run_cli
from meshtron.config import load_config
from meshtron.errors import ConfigError
from meshtron.train.precision import (
    LossScaler,
    PrecisionPolicy,
    apply_compute_casts,
    precision_policy,
    resolve_mixed_precision,
)
from meshtron.train.runtime import check_torch_version, resolve_device_type


def test_device_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device_type("auto", 4) == "cpu"
    assert resolve_device_type("cpu", 4) == "cpu"
    with pytest.raises(ConfigError, match="run.device=cuda but no CUDA GPU is visible; use --run.device=cpu"):
        resolve_device_type("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device_type("auto", 1) == "cuda"
    assert resolve_device_type("cpu", 8) == "cpu"
    with pytest.raises(ConfigError, match=r"4 processes on this machine but only 1 GPU\(s\) visible.*--run.device=cpu"):
        resolve_device_type("auto", 4)


def test_cuda_without_a_gpu_stops_the_cli_before_any_work(tmp_path):
    proc = run_cli(["train", "--nproc", "2", "--run.device=cuda", f"--run.output_dir={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode == 2
    assert "run.device=cuda but no CUDA GPU is visible; use --run.device=cpu" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_torch_version_check():
    check_torch_version("2.13.0+cpu")
    check_torch_version("2.11.0")
    with pytest.raises(ConfigError, match=r"meshtron needs torch >= 2.11, found 2.6.0; install torch>=2.11"):
        check_torch_version("2.6.0")


def test_mixed_precision_resolution_and_errors():
    assert resolve_mixed_precision("auto", "cpu") == "none"
    assert resolve_mixed_precision("auto", "cuda", bf16_supported=True) == "bf16"
    assert resolve_mixed_precision("auto", "cuda", bf16_supported=False) == "fp16"
    assert resolve_mixed_precision("fp16", "cpu") == "fp16"
    policy = precision_policy(load_config(None, ["train.mixed_precision=bf16"], env={}), "cpu")
    assert policy.compute_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert policy.fsdp_policy().param_dtype == torch.bfloat16
    # bf16 weights: nothing to cast, explicitly or by auto.
    same = precision_policy(load_config(None, ["train.mixed_precision=bf16", "model.dtype=bfloat16"], env={}), "cpu")
    assert same.compute_dtype is None
    with pytest.raises(ConfigError, match="master weights must be float32"):
        precision_policy(load_config(None, ["train.mixed_precision=fp16", "model.dtype=bfloat16"], env={}), "cpu")
    with pytest.raises(ConfigError, match="model.dtype=float16 stores the weights and AdamW state in fp16"):
        precision_policy(load_config(None, ["model.dtype=float16"], env={}), "cuda")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        seen.append(self.linear.weight.dtype)
        return self.linear(x)


class _Model(nn.Module):
    """An embedding, two blocks and a head tied to the embedding, like a small tied LM."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        seen.append(self.embed.weight.dtype)
        hidden = self.embed(ids)
        for block in self.layers:
            hidden = block(hidden)
        return self.head(hidden)


seen: list = []


class _Adapter:
    def named_blocks(self, model):
        return list(model.layers.named_children())


def test_cast_hooks_compute_in_bf16_and_keep_fp32_master_weights():
    """The casts happen per block and at the root; gradients reach the fp32 parameters; after forward the
    module holds its fp32 parameters again; the tied weight is one copy."""
    torch.manual_seed(0)
    model = _Model()
    reference = _Model()
    reference.load_state_dict(model.state_dict())
    apply_compute_casts(model, _Adapter(), PrecisionPolicy(torch.bfloat16, torch.float32, "bf16"))
    ids = torch.tensor([[1, 2, 3]])
    seen.clear()
    out = model(ids)
    assert seen == [torch.bfloat16] * 3 and out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert isinstance(model.head.weight, nn.Parameter) and model.head.weight is model.embed.weight
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    # Same gradient as computing by hand with bf16 copies of the weights.
    reference.bfloat16()
    torch.testing.assert_close(out, reference(ids), rtol=0, atol=0)  # exactly a bf16 model's arithmetic


def test_loss_scaler_halves_on_overflow_and_grows_after_clean_steps():
    scaler = LossScaler(1024.0, growth_interval=2)
    scaler.update(overflowed=True)
    assert scaler.scale == 512.0
    scaler.update(overflowed=False)
    assert scaler.scale == 512.0
    scaler.update(overflowed=False)
    assert scaler.scale == 1024.0
    restored = LossScaler(1.0, 2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 1024.0 and restored.clean_steps == 0


def test_a_decoder_block_compiles_as_one_graph_with_document_masks_and_bf16_casts():
    """What train.compile compiles: a decoder block with meshtron's document-masked attention and the
    mixed-precision cast hooks. fullgraph=True fails on any graph break; the result equals eager."""
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.models.attention import register_attention
    from meshtron.models.build import build_meta_model, load_hf_config, materialize
    from meshtron.train.batch import SequenceSplit, sequence_inputs

    cfg = load_config(None, ["model.preset=llama-tiny", "train.mixed_precision=bf16"], env={})
    tokenizer = load_tokenizer("byte")
    model, adapter = build_meta_model(load_hf_config(cfg.model, tokenizer.vocab_size), cfg.model)
    materialize(model, adapter, torch.device("cpu"), seed=0)
    adapter.use_attention(model, register_attention())
    apply_compute_casts(model, adapter, precision_policy(cfg, "cpu"))
    input_ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    input_ids[:, [5, 20]] = tokenizer.eos_token_id  # three documents per row
    inputs = sequence_inputs(input_ids, SequenceSplit(mask_documents=True, eos_token_id=tokenizer.eos_token_id))
    hidden = model.model.embed_tokens(inputs["input_ids"]).bfloat16()
    kwargs = dict(
        attention_mask=None, position_ids=inputs["position_ids"], use_cache=False,
        position_embeddings=model.model.rotary_emb(hidden, inputs["position_ids"]),
        sequence_layout=inputs["sequence_layout"],
    )
    block = model.model.layers[0]
    eager = block(hidden, **kwargs)
    compiled = torch.compile(block, fullgraph=True)(hidden, **kwargs)
    assert compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
