"""The MoE router load-balancing loss (meshtron.train.moe.router_loss): transformers' value and gradient, the
same over any split of the global micro-batch over data- / context-parallel ranks, and in training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshtron.config import load_config
from meshtron.data.dataset import build_packed_dataset
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.data.tokenizer import load_tokenizer
from meshtron.distributed.context_parallel import shard_sequence
from meshtron.distributed.runtime import Runtime
from meshtron.errors import ConfigError
from meshtron.metrics.flops import flops_per_token
from meshtron.train.moe.router_loss import (
    LocalRouting,
    RouterLoss,
    StepRouting,
    layer_routing,
    micro_batch_aux,
    pack,
    router_loss_enabled,
)
from meshtron.train.trainer import train

CPU_RUNTIME = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
E, K, LAYERS = 4, 2, 3


def tiny_moe_config(vocab_size: int = 64, **overrides):
    from transformers import Qwen3MoeConfig

    settings = dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=K,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    settings.update(overrides)
    return Qwen3MoeConfig(**settings)


def hf_aux(layer_logits: list[torch.Tensor]) -> torch.Tensor:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(tuple(layer_logits), E, K)


def local_routing(layer_logits: list[torch.Tensor]) -> LocalRouting:
    counts, prob_sums = zip(*(layer_routing(logits, K) for logits in layer_logits))
    return LocalRouting(torch.stack(counts), torch.stack(prob_sums), torch.tensor(float(layer_logits[0].shape[0])))


def ranks_aux(rank_logits: list[list[torch.Tensor]]):
    """Simulated ranks: each rank's layers' logits; the all-reduce is the sum of the packs. Returns
    (the aux every rank sees, the sum of the ranks' shares, the global counts)."""
    locals_ = [local_routing(layers) for layers in rank_logits]
    reduced = torch.stack([pack(local) for local in locals_]).sum(0)
    results = [micro_batch_aux(local, reduced) for local in locals_]
    for result in results[1:]:
        assert torch.equal(result.aux, results[0].aux)
    return results[0].aux, sum(result.share for result in results), results[0].counts


def test_one_rank_matches_transformers_value_and_gradient():
    torch.manual_seed(0)
    logits = [torch.randn(40, E, requires_grad=True) for _ in range(LAYERS)]
    want = hf_aux(logits)
    want_grads = torch.autograd.grad(want, logits, retain_graph=True)
    want = want.detach()
    got, share, counts = ranks_aux([logits])
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert share.item() == pytest.approx(float(want), rel=1e-6)
    for g, w in zip(torch.autograd.grad(share, logits), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert counts.shape == (LAYERS, E) and float(counts.sum()) == LAYERS * 40 * K


@pytest.mark.parametrize("layout", ["dp2", "cp2", "dp2_cp2", "uneven"])
def test_any_split_over_ranks_gives_the_one_process_value_and_gradient(layout):
    """dp: whole sequences per rank; cp: meshtron's load-balanced sequence chunks; the shares' gradients
    summed over the ranks (what FSDP's mean times dp x cp gives) are the one-process gradient."""
    torch.manual_seed(1)
    batch, seq = 4, 8
    logits = [torch.randn(batch, seq, E, requires_grad=True) for _ in range(LAYERS)]
    want = hf_aux([x.reshape(-1, E) for x in logits])
    want_grads = torch.autograd.grad(want, logits, retain_graph=True)
    want = want.detach()
    dp, cp = {"dp2": (2, 1), "cp2": (1, 2), "dp2_cp2": (2, 2), "uneven": (1, 1)}[layout]
    ranks = []
    for d in range(dp):
        rows = slice(d * batch // dp, (d + 1) * batch // dp)
        for c in range(cp):
            ranks.append([shard_sequence(x[rows], cp, c).reshape(-1, E) for x in logits])
    if layout == "uneven":  # any partition of the tokens: 5 and 27
        flat = [x.reshape(-1, E) for x in logits]
        ranks = [[x[:5] for x in flat], [x[5:] for x in flat]]
    got, share, _ = ranks_aux(ranks)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert share.item() == pytest.approx(float(want), rel=1e-6)
    for g, w in zip(torch.autograd.grad(share, logits), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_step_metrics_average_the_micro_batches():
    torch.manual_seed(2)
    routing = StepRouting()
    values = []
    for _ in range(3):
        logits = [torch.randn(16, E) for _ in range(LAYERS)]
        values.append(float(hf_aux(logits)))
        local = local_routing(logits)
        routing.add(micro_batch_aux(local, pack(local)))
    aux, load_max, load_min = (float(t) for t in routing.tensors())
    assert aux == pytest.approx(np.mean(values), rel=1e-6)
    counts = routing.counts
    assert float(counts.sum()) == 3 * 16 * LAYERS * K
    mean = 3 * 16 * K / E
    assert load_max == pytest.approx(float(counts.max()) / mean) and load_min == pytest.approx(
        float(counts.min()) / mean
    )
    assert load_min <= 1 <= load_max


def test_hooks_on_a_transformers_model_record_its_aux_loss():
    """The hooks see what transformers' own ForCausalLM adds (output_router_logits=True); activation
    checkpointing's recomputation outside the recording adds nothing."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_moe_config())
    router = RouterLoss(model, model.config, model.config.router_aux_loss_coef)
    assert len(router.blocks) == 2
    input_ids = torch.randint(0, 64, (2, 24))
    with router.recording():
        out = model(input_ids=input_ids)
    got = router.micro_batch()
    assert float(got.aux) == pytest.approx(float(out.aux_loss.detach()), rel=1e-6)
    model(input_ids=input_ids)  # not recording: nothing kept
    assert router._layers == []
    router.remove()


def test_no_tensor_is_made_from_host_data_per_micro_batch(monkeypatch):
    """``torch.tensor(...)`` on a GPU is a blocking host-to-device copy: the router loss makes none per micro-batch
    (it made one for the token count), a pipeline stage's routing carry one in all (its layer indices; it made one
    per microbatch)."""
    import sys

    from transformers import AutoModelForCausalLM

    from meshtron.train.moe.pipeline_router_loss import StageRouting

    made = []
    tensor = torch.tensor

    def counting_tensor(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("meshtron."):
            made.append(sys._getframe(1).f_globals["__name__"])
        return tensor(*args, **kwargs)

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_moe_config())
    input_ids = torch.randint(0, 64, (2, 24))
    router = RouterLoss(model, model.config, model.config.router_aux_loss_coef)
    monkeypatch.setattr(torch, "tensor", counting_tensor)
    for _ in range(3):
        with router.recording():
            model(input_ids=input_ids)
        router.micro_batch()
    assert made == []
    router.remove()
    stage = StageRouting(model, model.config, 2, E)
    for _ in range(3):
        _, carry = stage.run(lambda: model(input_ids=input_ids), None, torch.device("cpu"))
    assert made == ["meshtron.train.moe.pipeline_router_loss"]
    assert carry[:, 2 * E].tolist() == [48.0, 48.0]  # both layers' rows landed: 2 x 24 tokens each
    stage.remove()


def test_hooks_on_gptoss_record_its_aux_loss():
    """gpt-oss's router is ``mlp.router`` (softmax over the top-k logits for the weights); its aux loss is
    transformers' Switch-style one on softmax(all logits), which the hooks compute from the logits alike."""
    from transformers import AutoModelForCausalLM

    from meshtron.models.presets import make_preset_config

    config = make_preset_config("gptoss-tiny", 64)
    config.output_router_logits = True
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    router = RouterLoss(model, model.config, model.config.router_aux_loss_coef)
    assert len(router.blocks) == 2
    input_ids = torch.randint(0, 64, (2, 24))
    with router.recording():
        out = model(input_ids=input_ids)
    assert float(router.micro_batch().aux) == pytest.approx(float(out.aux_loss.detach()), rel=1e-6)
    router.remove()


def test_setting():
    dense = tiny_moe_config(num_experts=0)
    moe_off = tiny_moe_config(output_router_logits=False)
    assert router_loss_enabled("auto", tiny_moe_config()) and not router_loss_enabled("auto", moe_off)
    assert router_loss_enabled("true", moe_off) and not router_loss_enabled("false", tiny_moe_config())
    assert not router_loss_enabled("auto", dense)
    with pytest.raises(ConfigError, match="dense"):
        router_loss_enabled("true", dense)
    for text, want in (("on", "true"), ("off", "false"), ("auto", "auto")):
        assert load_config(None, [f"moe.router_aux_loss={text}"], env={}).moe.router_aux_loss == want
    with pytest.raises(ConfigError, match="router_aux_loss"):
        load_config(None, ["moe.router_aux_loss=maybe"], env={})


def test_flops_count_active_experts_only():
    moe = tiny_moe_config()
    h, inter, layers = 64, 32, 2
    dense_equivalent = tiny_moe_config(num_experts=0)
    attention_and_head = flops_per_token(dense_equivalent, 32) - 6 * layers * 3 * h * 96  # its dense MLPs out
    want = attention_and_head + 6 * layers * (K * 3 * h * inter + h * E)  # top-k experts + router
    assert flops_per_token(moe, 32) == pytest.approx(want)


def test_single_process_loss_at_step_1_is_transformers_loss(tmp_path, cache_dir):
    """meshtron's step-1 loss (LM loss + coef x aux) on a saved Qwen3-MoE equals transformers' loss with
    output_router_logits=True on the same global batch (one micro-batch); with accumulation the aux loss is
    the mean of transformers' over the micro-batches."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer("byte")
    model_dir = tmp_path / "qwen3moe"
    torch.manual_seed(4)
    reference = AutoModelForCausalLM.from_config(tiny_moe_config(tokenizer.vocab_size, initializer_range=0.2))
    reference.save_pretrained(model_dir)
    overrides = [
        f"model.name_or_path={model_dir}",
        "data.max_documents=40",
        "data.seq_len=32",
        f"data.cache_dir={cache_dir}",
        "train.steps=1",
        "train.global_batch_size=4",
        "run.progress=false",
        f"run.output_dir={tmp_path / 'run'}",
    ]
    cfg = load_config(None, overrides, env={})
    result = train(cfg, CPU_RUNTIME)
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])

    dataset = build_packed_dataset(cfg.data, tokenizer, is_builder=True)
    schedule = GlobalBatchSchedule(len(dataset), 4, cfg.data.shuffle, cfg.data.seed)
    input_ids, labels = dataset.batch(schedule.global_batch(0))
    with torch.no_grad():
        out = reference(input_ids=input_ids, labels=labels, shift_labels=labels)
    assert record["aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert result.losses[0] == pytest.approx(float(out.loss), rel=1e-5)
    assert float(out.aux_loss) * 0.02 > 1e-3 * float(out.loss)  # the aux term is visible at this tolerance
    assert 1 <= record["expert_load_max"] and 0 <= record["expert_load_min"] <= 1

    off = load_config(
        None, overrides[:-1] + [f"run.output_dir={tmp_path / 'off'}", "moe.router_aux_loss=false"], env={}
    )
    lm_only = train(off, CPU_RUNTIME).losses[0]
    assert lm_only == pytest.approx(float(out.loss) - 0.02 * float(out.aux_loss), rel=1e-5)

    # Accumulation over 2 micro-batches: aux_loss is the mean of transformers' aux of each, the LM loss the global mean.
    accum = load_config(
        None, overrides[:-1] + [f"run.output_dir={tmp_path / 'accum'}", "train.micro_batch_size=2"], env={}
    )
    accum_loss = train(accum, CPU_RUNTIME).losses[0]
    accum_record = json.loads((tmp_path / "accum" / "metrics.jsonl").read_text().splitlines()[0])
    with torch.no_grad():
        halves = [float(reference(input_ids=input_ids[i : i + 2], output_router_logits=True).aux_loss) for i in (0, 2)]
    assert accum_record["aux_loss"] == pytest.approx(np.mean(halves), rel=1e-5)
    assert accum_loss == pytest.approx(lm_only + 0.02 * np.mean(halves), rel=1e-5)


def test_pipeline_stages_carry_the_routing_to_transformers_value_and_gradient():
    """Two pipeline stages (layers 0-1, 2-3 of a 4-layer Qwen3-MoE), chained by hand with the routing carry
    (meshtron.train.moe.pipeline_router_loss): the last stage's aux and the gradient of its share reaching every
    parameter of both stages equal transformers' aux_loss of the whole model and its gradient."""
    from meshtron.distributed.context_parallel import register_attention
    from meshtron.distributed.pipeline_parallel import set_stage_forward, split_pipeline
    from meshtron.models.build import build_meta_model, load_hf_config, materialize
    from meshtron.models.moe import moe_layer_indices
    from meshtron.train.batch import SequenceSplit, sequence_inputs
    from meshtron.train.moe.pipeline_router_loss import PipelineRouterLoss, StageRouting

    cfg = load_config(None, ["model.preset=qwen3moe-tiny", "parallel.pp=2"], env={})
    tokenizer = load_tokenizer("byte")
    hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    hf_config.num_hidden_layers, hf_config.output_router_logits = 4, True
    cpu = torch.device("cpu")
    full, adapter = build_meta_model(hf_config, cfg.model)
    materialize(full, adapter, cpu, seed=3)
    split = SequenceSplit(mask_documents=True, eos_token_id=tokenizer.eos_token_id)
    input_ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    input_ids[0, 5] = tokenizer.eos_token_id
    adapter.use_attention(full, register_attention())
    expected = full(**sequence_inputs(input_ids, split), output_router_logits=True).aux_loss
    expected.backward()

    out, stages = (input_ids,), []
    for pp_rank in range(2):
        meta, _ = build_meta_model(hf_config, cfg.model)
        ((stage_id, stage),) = split_pipeline(meta, adapter, cfg.parallel, pp_rank)
        materialize(stage, adapter, cpu, seed=3)
        adapter.use_attention(stage, register_attention())
        routing = StageRouting(stage, hf_config, 4, E)
        assert routing.layers == [2 * pp_rank, 2 * pp_rank + 1]
        set_stage_forward(
            stage, adapter, stage_id == 0, stage_id == 1, lambda ids: sequence_inputs(ids, split), routing=routing
        )
        out = stage(*out)
        stages.append(stage)
    hidden, carry = out
    assert carry.shape == (4, 2 * E + 1)
    aux = PipelineRouterLoss(0.02, E, moe_layer_indices(full)).micro_batch(carry)
    assert float(aux.aux) == pytest.approx(expected.item(), rel=1e-6)
    assert aux.share.item() == pytest.approx(expected.item(), rel=1e-6)  # one rank: its share is all of it
    aux.share.backward()
    want = {name: p.grad for name, p in full.named_parameters() if p.grad is not None}
    got = {name: p.grad for stage in stages for name, p in stage.named_parameters() if p.grad is not None}
    assert set(got) == set(want) and any(".layers.0." in name for name in got)  # reached the first stage
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
