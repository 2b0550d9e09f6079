"""Device choice, torch version check, the precision policy, the cast hooks and fp16 loss scaling (fast, 1 process)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from torch import nn

from meshtron.config import load_config
from meshtron.distributed.devices import resolve_device_type
from meshtron.distributed.precision import (
    COMPUTE_WEIGHTS_ATTRIBUTE,
    PrecisionPolicy,
    apply_compute_casts,
    precision_policy,
    release_compute_weights,
    resolve_mixed_precision,
)
from meshtron.distributed.runtime import check_torch_version
from meshtron.errors import ConfigError
from meshtron.train.loss.scaling import LossScaler


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
    policy = _policy(load_config(None, ["precision.mixed_precision=bf16"], env={}), "cpu")
    assert policy.compute_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert policy.fsdp_policy().param_dtype == torch.bfloat16
    # bf16 weights: nothing to cast, explicitly or by auto.
    same = _policy(load_config(None, ["precision.mixed_precision=bf16", "model.dtype=bfloat16"], env={}), "cpu")
    assert same.compute_dtype is None
    with pytest.raises(ConfigError, match="master weights must be float32"):
        _policy(load_config(None, ["precision.mixed_precision=fp16", "model.dtype=bfloat16"], env={}), "cpu")
    with pytest.raises(ConfigError, match="model.dtype=float16 stores the weights and AdamW state in fp16"):
        _policy(load_config(None, ["model.dtype=float16"], env={}), "cuda")


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


def test_weight_copies_are_made_once_per_optimizer_step():
    """Every micro-batch of a step computes with the same compute-dtype copies (no cast per forward); the
    optimizer's update makes new ones; a forward without autograd never hands its copies to training."""
    torch.manual_seed(0)
    model = _Model()
    reference = _Model()
    reference.load_state_dict(model.state_dict())
    apply_compute_casts(model, _Adapter(), PrecisionPolicy(torch.bfloat16, torch.float32, "bf16"))
    weights = getattr(model, COMPUTE_WEIGHTS_ATTRIBUTE)
    ids = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])]
    with torch.no_grad():
        model(ids[0])
    copies = []
    for micro_batch in ids:
        model(micro_batch).float().sum().backward()
        copies.append({id(copy) for _, _, copy in weights._copies.values()})
    assert copies[0] == copies[1] and len(copies[0]) == 5  # embed/head (tied), two blocks' weights and biases
    # Gradients: the two micro-batches' gradients of a bf16 model (cast by hand), added in fp32.
    reference.bfloat16()
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for micro_batch in ids:
        grads = torch.autograd.grad(reference(micro_batch).float().sum(), list(reference.parameters()))
        expected = [total + grad.float() for total, grad in zip(expected, grads)]
    for param, want in zip(model.parameters(), expected):
        torch.testing.assert_close(param.grad, want, rtol=0, atol=0)
    release_compute_weights(model)
    assert not weights._copies
    model(ids[0])
    before = {id(copy) for _, _, copy in weights._copies.values()}
    with torch.no_grad():
        model.layers[0].linear.weight.add_(1.0)  # what an optimizer step does
    model(ids[0])
    after = {id(copy) for _, _, copy in weights._copies.values()}
    assert len(before - after) == 1  # only the updated weight was cast again


def test_compiled_blocks_never_recompile_with_casts_document_masks_and_float8():
    """What train.compile compiles (meshtron's own parallelize_model on 8 decoder blocks, bf16 compute casts,
    document-masked attention, float8 linears, full activation checkpointing), over three optimizer steps of two
    micro-batches: dynamo compiles one graph for the blocks (not one per block, which is what guarding on a
    parameter does until the recompile limit) plus the fused loss's two chunk shapes, with no graph break;
    the losses equal the same model's uncompiled ones."""
    from torch._dynamo.utils import counters

    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.distributed.parallelize import parallelize_model
    from meshtron.models.build import build_meta_model, load_hf_config, materialize
    from meshtron.train.batch import SequenceSplit, sequence_inputs
    from meshtron.train.loss.head import head_loss_sum
    from meshtron.train.setup.preflight import preflight
    from meshtron.train.setup.run_setup import parallelize_options

    tokenizer = load_tokenizer("byte")
    input_ids = torch.randint(0, 250, (2, 64), generator=torch.Generator().manual_seed(0))
    input_ids[:, [5, 40]] = tokenizer.eos_token_id  # three documents per row
    split = SequenceSplit(mask_documents=True, eos_token_id=tokenizer.eos_token_id)

    def losses(compile_setting: str) -> list[float]:
        cfg = load_config(
            None,
            [
                "model.preset=llama-deep",
                "precision.mixed_precision=bf16",
                f"train.compile={compile_setting}",
                "precision.float8=true",
                "train.activation_checkpointing=full",
                "data.mask_documents=true",
            ],
            env={},
        )
        model, adapter = build_meta_model(load_hf_config(cfg.model, tokenizer.vocab_size), cfg.model)
        adapter.return_hidden_states(model)
        setup = preflight(cfg, 1, "cpu")
        parallelize_model(model, adapter, setup.dims, None, parallelize_options(cfg, setup), "cpu")
        materialize(model, adapter, torch.device("cpu"), seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        trajectory = []
        for _ in range(3):
            for micro_batch in (input_ids[:1], input_ids[1:]):
                hidden = model(**sequence_inputs(micro_batch, split))
                weight, bias = adapter.head_parameters(model)
                loss = head_loss_sum(
                    hidden,
                    micro_batch,
                    weight,
                    bias,
                    compute_dtype=torch.bfloat16,
                    chunk_size=48,
                    compiled=compile_setting == "true",
                )
                loss.backward()
            release_compute_weights(model)
            trajectory.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        return trajectory

    torch._dynamo.reset()  # forget what other tests compiled
    counters.clear()
    compiled = losses("true")
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])  # blocks, 48-token chunk, 16-token chunk
    assert counters["frames"]["total"] == 3, dict(counters["frames"])
    torch.testing.assert_close(compiled, losses("false"), rtol=2e-2, atol=0)


def _policy(cfg, device_type):
    """The run's precision policy, as preflight makes it."""
    return precision_policy(cfg.precision, cfg.model.dtype, cfg.fsdp.reduce_dtype, device_type)
