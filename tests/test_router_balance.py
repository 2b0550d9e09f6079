"""Auxiliary-loss-free router balancing (moe.router_balance=bias, meshtron.train.moe.router_balance): the biased
router equals transformers' while the bias is zero, the load of a skewed router tightens as the bias moves, and the
settings fail with one line. Parity under EP2 / TP2 / FSDP2 (biases compared) is in test_parity.py, a resumed run
in test_checkpoint.py."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import load_config
from meshtron.errors import ConfigError
from meshtron.models.moe import router_of
from meshtron.models.presets import make_preset_config
from meshtron.train.moe import router_balance
from meshtron.train.moe.router_balance import RouterBalance, check_router_balance, load_spread

BYTE_VOCAB = 257


def tiny(preset: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_preset_config(preset, BYTE_VOCAB))


@pytest.mark.parametrize("preset", ["qwen3moe-tiny", "mixtral-tiny", "qwen2moe-tiny", "olmoe-tiny", "gptoss-tiny"])
def test_a_zero_bias_routes_exactly_as_transformers(preset):
    """gpt-oss's router (``mlp.router``, with a bias of its own) takes the balancing bias on its logits."""
    model = tiny(preset)
    router = router_of(model.model.layers[0].mlp)
    hidden = torch.randn(2, 9, model.config.hidden_size, requires_grad=True)
    want = router(hidden)
    want_grad = torch.autograd.grad(want[1].square().sum(), hidden)[0]
    RouterBalance([model], model.config, rate=1e-3)
    got = router(hidden)
    got_grad = torch.autograd.grad(got[1].square().sum(), hidden)[0]
    for name, a, b in zip(("logits", "weights", "indices"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)
    name = "router" if preset == "gptoss-tiny" else "gate"
    assert f"model.layers.0.mlp.{name}.balance_bias" in model.state_dict()  # checkpoints hold the biases


def test_gptoss_bias_changes_the_choice_not_the_weights():
    """A large balancing bias on expert 3 puts it among every token's top 2; the routing weights stay the softmax
    over the chosen experts' own logits (with the router's bias), as gpt-oss computes them."""
    model = tiny("gptoss-tiny")
    router = router_of(model.model.layers[0].mlp)
    hidden = torch.randn(18, model.config.hidden_size)
    RouterBalance([model], model.config, rate=1e-3)
    with torch.no_grad():
        router.balance_bias[3] = 100.0
        logits, weights, indices = router(hidden)
    assert (indices == 3).any(dim=-1).all()
    want = torch.softmax(torch.nn.functional.linear(hidden, router.weight, router.bias).gather(-1, indices), dim=-1)
    torch.testing.assert_close(weights, want, rtol=0, atol=0)


def test_a_skewed_routers_load_tightens_as_its_bias_moves():
    """Tokens that all prefer expert 0 (of 4, top-2): the busiest expert starts at ~1.9x the mean load; the bias
    (rate 0.005, moved after each of 100 forwards of the same tokens) brings it to about 1.1x, and the biases end
    ordered against the load they corrected (expert 0's lowest)."""
    model = tiny("qwen3moe-tiny")
    balance = RouterBalance([model], model.config, rate=0.005)
    router = balance.routers[0]
    direction = torch.randn(64, generator=torch.Generator().manual_seed(1))
    direction /= direction.norm()
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
        router.weight[0] = 3 * direction
    hidden = torch.randn(512, 64, generator=torch.Generator().manual_seed(2)) * 0.5 + direction
    spreads = []
    for _ in range(100):
        with balance.recording():
            router(hidden)
        router(hidden)  # outside recording (evaluation, recomputation): not counted
        load = balance.update()[0]
        assert load.sum() == 512 * 2
        spreads.append(load_spread(load[None])[0].item())
    late = sum(spreads[-10:]) / 10
    print(f"busiest expert / mean load: first step {spreads[0]:.3f}, mean of the last 10 steps {late:.3f}")
    assert spreads[0] > 1.8 and late < 1.25
    assert router.balance_bias.argmin() == 0


def test_bias_balancing_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="moe.router_balance: 'none' is not one of auto, aux_loss, bias"):
        load_config(None, ["moe.router_balance=none"], env={})
    with pytest.raises(ConfigError, match="moe.router_bias_rate: must be > 0"):
        load_config(None, ["moe.router_balance=bias", "moe.router_bias_rate=0"], env={})
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        check_router_balance("bias", make_preset_config("llama-tiny", BYTE_VOCAB))


def test_a_lora_checkpoint_keeps_the_routers_biases():
    """A LoRA run's checkpoints hold what training changes: the adapters, and the biases (no gradient) too."""
    from meshtron.checkpoint.state import TrainingState
    from meshtron.config import LoraConfig
    from meshtron.models.adapter import adapter_for
    from meshtron.models.lora import add_lora

    model = tiny("qwen3moe-tiny")
    add_lora(model, adapter_for(model.config), LoraConfig(rank=2, targets=["q_proj"]))
    RouterBalance([model], model.config, rate=1e-3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    kept = TrainingState([model], model, optimizer, trained_only=True)._kept(model)
    assert {name for name in kept if "balance_bias" in name} == {
        f"model.layers.{layer}.mlp.gate.balance_bias" for layer in (0, 1)
    }
    assert not any(name.endswith("q_proj.weight") for name in kept)


class Communicated(Exception):
    """Raised by the test's all-reduce once it has seen the tensor (on the "meta" device nothing can be read back)."""


def test_bias_balancing_communicates_on_the_runs_device(monkeypatch):
    """NCCL refuses CPU tensors: the biases and every tensor balancing all-reduces (the load over dp x cp, the spread
    over the pipeline) are on the run's compute device, here "meta" (on the CPU the test could not tell). Also on a
    pipeline stage without MoE layers (DeepSeek-V3's dense first layers), whose load and spread were CPU tensors, and
    with the routers' weights on the CPU (fsdp.cpu_offload), where the biases were made."""
    devices = []

    def all_reduce(tensor, *args, **kwargs):
        devices.append(tensor.device)
        raise Communicated

    monkeypatch.setattr(router_balance.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(router_balance.dist, "get_world_size", lambda group=None: 2)
    meta = torch.device("meta")
    model = tiny("qwen3moe-tiny")  # its routers' weights on the CPU
    moe_stage = RouterBalance([model], model.config, 1e-3, group="dp x cp", pp_group="pp", device=meta)
    dense_stage = RouterBalance(
        [torch.nn.Linear(4, 4)], model.config, 1e-3, group="dp x cp", pp_group="pp", device=meta
    )
    assert [router.balance_bias.device for router in moe_stage.routers] == [meta, meta]
    with pytest.raises(Communicated):
        moe_stage.update()
    load = dense_stage.update()
    assert load.shape == (0, model.config.num_experts) and load.device == meta
    with pytest.raises(Communicated):
        dense_stage.spread(load)
    assert devices == [meta, meta]
