"""Float8 training (precision.float8): conversion, its checks, the float8 TP styles, and an emulated CPU run.

Float8 under FSDP and TP (several processes) is checked against a single-process float8 run by the
parity layouts (tests/test_parity.py), which run in the shared torchrun launches.
"""

from __future__ import annotations

import sys

import pytest
import torch

from meshtron.config import ModelConfig, load_config
from meshtron.distributed.float8 import apply_float8, check_capability, check_float8, refresh_float8_scales
from meshtron.distributed.precision import precision_policy
from meshtron.distributed.runtime import Runtime
from meshtron.distributed.tensor_parallel import _block_styles
from meshtron.errors import ConfigError
from meshtron.models.build import build_meta_model, load_hf_config
from meshtron.train.trainer import train

CPU_RUNTIME = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check_float8(cfg, device_type: str) -> None:
    """check_float8 as preflight calls it, with the run's precision policy."""
    policy = precision_policy(cfg.precision, cfg.model.dtype, cfg.fsdp.reduce_dtype, device_type)
    check_float8(cfg.precision, cfg.model.dtype, device_type, policy)


def float8_config(tmp_path, cache_dir, *extra: str):
    return load_config(
        None,
        [
            "model.preset=llama-tiny",
            "data.max_documents=30",
            "data.seq_len=32",
            f"data.cache_dir={cache_dir}",
            "train.steps=6",
            "train.global_batch_size=4",
            "optimizer.lr=3e-3",
            "schedule.warmup_steps=2",
            "run.progress=false",
            f"run.output_dir={tmp_path / 'run'}",
            *extra,
        ],
        env={},
    )


def meta_model(preset: str = "llama-tiny"):
    model_cfg = ModelConfig(preset=preset)
    return build_meta_model(load_hf_config(model_cfg, 257), model_cfg)


def block_linear(block, name: str):
    return getattr(block.self_attn if name in BLOCK_LINEARS[:4] else block.mlp, name)


def test_float8_run_on_cpu_is_emulated_and_close_to_the_plain_run(tmp_path, cache_dir):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    plain = train(float8_config(tmp_path / "plain", cache_dir), CPU_RUNTIME)
    result = train(float8_config(tmp_path / "float8", cache_dir, "precision.float8=true"), CPU_RUNTIME)
    for block in result.model.model.layers:
        assert all(isinstance(block_linear(block, name), Float8Linear) for name in BLOCK_LINEARS)
    assert not isinstance(result.model.lm_head, Float8Linear)
    assert result.losses[-1] < result.losses[0] - 0.3
    # Float8 really ran: its rounding changes every step's loss.
    assert all(a != b for a, b in zip(result.losses, plain.losses))
    # ...but only slightly. e4m3 keeps 3 mantissa bits (relative rounding error up to 2^-4 per operand,
    # unbiased); summed over the 64-160 terms of each dot product and averaged over 128 tokens' losses
    # this is ~1e-4 to 1e-3 of the loss (measured: at most 5e-4 over these steps). 1e-2 leaves room for
    # other torchao versions, while a broken cast (a wrong scale saturating at 448 or flushing to zero,
    # a stale float8 weight) changes the loss by far more and would also stop it from decreasing.
    for step, (a, b) in enumerate(zip(result.losses, plain.losses), start=1):
        assert abs(a - b) <= 1e-2 * b, f"step {step}: float8 loss {a} vs plain {b}"


def test_conversion_skips_the_head_embeddings_and_dims_not_multiples_of_16_per_rank():
    pytest.importorskip("torchao.float8")
    model, adapter = meta_model()
    converted = apply_float8(model, adapter, device_type="cpu", fsdp_enabled=False, tp=2)
    assert len(converted) == 2 * len(BLOCK_LINEARS)  # llama-tiny: every split dim is a multiple of 16 at tp=2
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    # At tp=4 each rank holds 8 of the 32 k/v output features and 40 of the 160 MLP features: those
    # linears stay high precision; q (16 of 64 outputs) and o (16 of 64 inputs) are converted.
    model, adapter = meta_model()
    converted = apply_float8(model, adapter, device_type="cpu", fsdp_enabled=False, tp=4)
    assert sorted(p.split(".")[-1] for p in converted if p.startswith("0.")) == ["o_proj", "q_proj"]


def test_float8_tp_styles_only_for_float8_linears():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    model, adapter = meta_model()
    roles = adapter.block_tp_roles(adapter.named_blocks(model)[0][1])
    shape = adapter.attention_shape(model.config)
    plain = _block_styles(roles, shape, 2, True)
    assert not any(type(style).__module__.startswith("torchao") for style in plain.values())
    every = frozenset(p for p, r in roles.items() if r in ("colwise", "kv_colwise", "rowwise"))
    styles = _block_styles(roles, shape, 2, True, every)
    assert type(styles["self_attn"]) is PrepareFloat8ModuleInput and type(styles["mlp"]) is PrepareFloat8ModuleInput
    assert type(styles["self_attn.q_proj"]) is Float8ColwiseParallel
    assert type(styles["mlp.down_proj"]) is Float8RowwiseParallel
    # A high-precision k/v projection must not be handed a float8 input: attention's input stays plain.
    styles = _block_styles(roles, shape, 2, True, every - {"self_attn.k_proj", "self_attn.v_proj"})
    assert type(styles["self_attn"]).__name__ == "PrepareModuleInput"
    assert type(styles["self_attn.q_proj"]) is Float8ColwiseParallel
    assert type(styles["self_attn.k_proj"]).__name__ == "ColwiseParallel"
    assert type(styles["mlp"]) is PrepareFloat8ModuleInput


def test_float8_tp_styles_run_through_the_blocks(monkeypatch):
    """torchao's float8 TP styles on a 1-rank tp mesh, against the same float8 model without TP.

    gloo cannot send float8 tensors, so the float8 all-gathers of tp > 1 only run on GPUs (NCCL); one
    rank still runs every cast and hook of the styles, forward and backward.
    """
    pytest.importorskip("torchao.float8")
    import torch.distributed as dist
    import torch.nn.functional as F
    from conftest import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    from meshtron.distributed.tensor_parallel import apply_tensor_parallel, loss_context
    from meshtron.models.build import materialize
    from meshtron.tensors import local_tensor

    prepared = []
    original = PrepareFloat8ModuleInput._prepare_input_arg
    monkeypatch.setattr(
        PrepareFloat8ModuleInput,
        "_prepare_input_arg",
        lambda self, x, mesh, layout, desired: (
            prepared.append(layout is not None) or original(self, x, mesh, layout, desired)
        ),
    )
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_and_grad(tp_mesh):
        model, adapter = meta_model()
        apply_float8(model, adapter, device_type="cpu", fsdp_enabled=False)
        if tp_mesh is not None:
            apply_tensor_parallel(model, adapter, tp_mesh, sequence_parallel=True, loss_parallel=True, float8=True)
        materialize(model, adapter, torch.device("cpu"), seed=0)
        logits = model(input_ids=ids).logits
        with loss_context(logits):
            loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
            loss.backward()
        grad = model.model.layers[0].mlp.down_proj.weight.grad
        return local_tensor(loss).item(), local_tensor(grad)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        loss_tp, grad_tp = loss_and_grad(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    finally:
        dist.destroy_process_group()
    assert sum(prepared) == 2 * 2  # attention and MLP inputs cast to float8 once each, in both blocks
    loss, grad = loss_and_grad(None)
    assert loss_tp == pytest.approx(loss, rel=1e-6)  # same float8 scales: only fp32 rounding differs
    torch.testing.assert_close(grad_tp, grad, rtol=1e-5, atol=1e-7)


def test_missing_torchao_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes ``import torchao.float8`` fail
    cfg = load_config(None, ["precision.float8=true"], env={})
    with pytest.raises(ConfigError, match=r"^precision.float8 needs torchao; pip install 'meshtron\[float8\]'$"):
        _check_float8(cfg, "cpu")
    model, adapter = meta_model()
    with pytest.raises(ConfigError, match="precision.float8 needs torchao"):
        apply_float8(model, adapter, device_type="cpu", fsdp_enabled=False)
    _check_float8(load_config(None, [], env={}), "cpu")  # float8 off: torchao is not needed


def test_gpu_without_float8_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"NVIDIA A100 has 8\.0; set precision.float8=false$"):
        check_capability((8, 0), "NVIDIA A100")
    check_capability((8, 9))
    check_capability((9, 0))
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(ConfigError, match=r"Tesla T4 has 7\.5"):
        _check_float8(load_config(None, ["precision.float8=true"], env={}), "cuda")


def test_refresh_float8_scales_without_fsdp_is_a_no_op():
    pytest.importorskip("torchao.float8")
    model, adapter = meta_model()
    apply_float8(model, adapter, device_type="cpu", fsdp_enabled=False)
    refresh_float8_scales(model)
    refresh_float8_scales([model])


def _loss_and_grads(recipe: str | None, ids):
    """llama-tiny (fp32, seed 0) forward + backward; ``recipe`` None: no float8."""
    import torch.nn.functional as F

    from meshtron.models.build import materialize

    model, adapter = meta_model()
    if recipe is not None:
        apply_float8(model, adapter, device_type="cpu", fsdp_enabled=False, recipe=recipe)
    materialize(model, adapter, torch.device("cpu"), seed=0)
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    block = model.model.layers[0]
    return loss.item(), {name: block_linear(block, name).weight.grad for name in BLOCK_LINEARS}


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_recipes_convert_the_same_linears_and_stay_close(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    model, adapter = meta_model()
    tensorwise = apply_float8(model, adapter, device_type="cpu", fsdp_enabled=True)
    model, adapter = meta_model()
    assert apply_float8(model, adapter, device_type="cpu", fsdp_enabled=True, recipe=recipe) == tensorwise
    for block in model.model.layers:
        for name in BLOCK_LINEARS:
            linear = block_linear(block, name)
            assert isinstance(linear, Float8Linear)
            # The recipe was applied: one scale per row of the input and weight...
            assert linear.config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
            assert linear.config.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
            # ...and FSDP all-gathers the weight in high precision (torchao's float8 all-gather is tensorwise only).
            assert not linear.config.enable_fsdp_float8_all_gather
            assert type(linear.weight.data) is torch.Tensor
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    loss_plain, grads_plain = _loss_and_grads(None, ids)
    loss_tensorwise, grads_tensorwise = _loss_and_grads("tensorwise", ids)
    loss_rowwise, grads_rowwise = _loss_and_grads(recipe, ids)
    # Float8 rounding moves the loss by ~1e-4 relative (see the training test above); another recipe
    # rounds differently (it is not tensorwise run again).
    assert loss_rowwise != loss_tensorwise and loss_rowwise != loss_plain
    assert loss_rowwise == pytest.approx(loss_plain, rel=1e-2)
    for name in BLOCK_LINEARS:
        assert not torch.equal(grads_rowwise[name], grads_tensorwise[name])
        # Every operand cast to e4m3 / e5m2 (2-3 mantissa bits), in sums of mixed signs at initialization:
        # measured 7-8% of the gradient's norm for the rowwise recipes (tensorwise: 10.5%). A wrong
        # scale (saturating, flushing to zero) or a stale float8 weight is off by about 100%.
        error = (grads_rowwise[name] - grads_plain[name]).norm() / grads_plain[name].norm()
        assert error <= 0.25, f"{name}: {error:.3f} of the gradient's norm"


def test_tensorwise_recipe_alone_gets_float8_all_gathers(monkeypatch):
    """FSDP's float8 all-gather (and its scale refresh) and the float8 TP styles cast per tensor: tensorwise only."""
    pytest.importorskip("torchao.float8")
    import torchao.float8

    from meshtron.distributed.float8 import float8_tp_paths

    calls = []
    monkeypatch.setattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", calls.append)
    model, adapter = meta_model()
    apply_float8(model, adapter, device_type="cpu", fsdp_enabled=True, recipe="rowwise")
    assert float8_tp_paths(model.model.layers[0]) == frozenset()
    refresh_float8_scales([model])
    assert calls == []  # no float8 all-gather, no scales to precompute
    model, adapter = meta_model()
    apply_float8(model, adapter, device_type="cpu", fsdp_enabled=True)
    assert block_linear(model.model.layers[0], "q_proj").config.enable_fsdp_float8_all_gather
    assert len(float8_tp_paths(model.model.layers[0])) == len(BLOCK_LINEARS)
    refresh_float8_scales([model])
    assert calls == [model]


def test_bad_float8_recipe_is_one_line():
    with pytest.raises(
        ConfigError,
        match=r"^precision.float8_recipe: 'blockwise' is not one of tensorwise, rowwise, rowwise_with_gw_hp$",
    ):
        load_config(None, ["precision.float8=true", "precision.float8_recipe=blockwise"], env={})
    assert load_config(None, [], env={}).precision.float8_recipe == "tensorwise"


def test_rowwise_on_gpu_needs_bf16_compute(monkeypatch):
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")
    rowwise = ["precision.float8=true", "precision.float8_recipe=rowwise"]
    with pytest.raises(
        ConfigError, match=r"^precision.float8_recipe=rowwise needs bf16 compute on GPUs, got float32; "
    ):
        _check_float8(load_config(None, [*rowwise, "precision.mixed_precision=none"], env={}), "cuda")
    _check_float8(load_config(None, [*rowwise, "precision.mixed_precision=bf16"], env={}), "cuda")
    _check_float8(
        load_config(None, [*rowwise, "precision.mixed_precision=none", "model.dtype=bfloat16"], env={}), "cuda"
    )
    _check_float8(
        load_config(None, ["precision.float8=true", "precision.mixed_precision=none"], env={}), "cuda"
    )  # tensorwise
    _check_float8(load_config(None, [*rowwise, "precision.mixed_precision=none"], env={}), "cpu")  # emulated: any dtype


def test_rowwise_run_on_cpu(tmp_path, cache_dir):
    """``precision.float8_recipe`` reaches the model through the trainer; rowwise trains emulated on CPU."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.config import ScalingGranularity

    cfg = float8_config(
        tmp_path, cache_dir, "precision.float8=true", "precision.float8_recipe=rowwise", "train.steps=3"
    )
    result = train(cfg, CPU_RUNTIME)
    linear = block_linear(result.model.model.layers[0], "down_proj")
    assert linear.config.cast_config_grad_output.scaling_granularity is ScalingGranularity.AXISWISE
    assert all(torch.isfinite(torch.tensor(result.losses)))
