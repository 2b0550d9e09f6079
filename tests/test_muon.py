"""Muon (optimizer.name=muon): the orthogonalization, one step against the formulas, which parameters it takes.
Every layout's Muon run is checked against one process in test_parity.py, resharded checkpoints in
test_checkpoint.py."""

from __future__ import annotations

import json
import math

import torch
from conftest import run_forked
from torch import nn

from meshtron.config import load_config
from meshtron.train.optim.build import build_optimizer
from meshtron.train.optim.muon import RMS_MATCH, MuonAdamW, muon_parameters, newton_schulz


def test_newton_schulz_brings_every_singular_value_near_one():
    torch.manual_seed(0)
    for shape in ((16, 40), (40, 16), (3, 8, 24)):  # wide, tall (transposed inside), a batch of expert matrices
        matrix = torch.randn(*shape) * torch.logspace(-1, 0.5, shape[-1])  # columns scaled over 1.5 decades
        singular = torch.linalg.svdvals(newton_schulz(matrix, steps=5))
        assert singular.min() > 0.5 and singular.max() < 1.3, (shape, singular)
        before = torch.linalg.svdvals(matrix)
        assert (before.max(-1).values / before.min(-1).values).min() > 5  # the input was far from orthogonal


def test_one_muon_step_follows_the_formulas():
    """A matrix steps along NS5 of its Nesterov momentum, scaled by 0.2 sqrt(max dim), after decoupled decay;
    a bias steps exactly as torch's AdamW steps it."""
    torch.manual_seed(0)
    layer = nn.Linear(12, 5)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.weight.grad, layer.bias.grad = torch.randn(5, 12), torch.randn(5)
    lr, decay, momentum = 0.02, 0.1, 0.95
    optimizer = MuonAdamW(
        [layer.weight],
        [{"params": [layer.bias], "weight_decay": 0.0}],
        momentum=momentum,
        ns_steps=5,
        lr=lr,
        weight_decay=decay,
    )
    reference_bias = nn.Parameter(bias.clone())
    reference_bias.grad = layer.bias.grad.clone()
    adamw = torch.optim.AdamW([{"params": [reference_bias], "weight_decay": 0.0}], lr=lr)
    optimizer.step()
    adamw.step()
    buffer = (1 - momentum) * layer.weight.grad
    nesterov = layer.weight.grad + momentum * (buffer - layer.weight.grad)
    expected = weight * (1 - lr * decay) - lr * RMS_MATCH * math.sqrt(12) * newton_schulz(nesterov, 5)
    torch.testing.assert_close(layer.weight.detach(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(layer.bias.detach(), reference_bias.detach())
    assert set(optimizer.state[layer.weight]) == {"momentum_buffer", "step"}
    assert {"exp_avg", "exp_avg_sq"} <= set(optimizer.state[layer.bias])


def test_muon_takes_the_blocks_matrices_and_experts_not_embeddings_head_norms_or_routers():
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.models.build import build_meta_model
    from meshtron.models.presets import make_preset_config

    cfg = load_config(None, ["model.preset=qwen3moe-tiny", "optimizer.name=muon"], env={})
    model, adapter = build_meta_model(make_preset_config("qwen3moe-tiny", load_tokenizer("byte").vocab_size), cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = sorted(names[id(p)] for p in muon_parameters([model], adapter))
    assert "model.layers.0.self_attn.q_proj.weight" in chosen and "model.layers.1.mlp.experts.gate_up_proj" in chosen
    assert not any(n.endswith(("norm.weight", "mlp.gate.weight")) or "embed" in n or "lm_head" in n for n in chosen), (
        chosen
    )
    optimizer = build_optimizer(model, cfg.optimizer, [model], adapter)
    groups = {bool(g.get("muon")): g for g in optimizer.param_groups}
    assert len(groups[True]["params"]) == len(chosen)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


# Per case of tests/muon_worker.py: the groups of ranks that share out each matrix (one owner in each group), or
# None where every rank orthogonalizes its own whole matrices (experts split only over experts) or every matrix
# (a partial sum, gathered whole).
OWNER_GROUPS = {
    "fsdp": [[0, 1, 2, 3]],
    "fsdp_cols": [[0, 1, 2, 3]],
    "fsdp_tp_rowwise": [[0, 1, 2, 3]],
    "fsdp_tp_colwise": [[0, 1, 2, 3]],
    "hsdp": [[0, 1], [2, 3]],
    "tp": [[0, 1], [2, 3]],
    "ep_tp": [[0, 1], [2, 3]],
    "ep_only": None,
    "partial": None,
}


def test_each_matrix_is_orthogonalized_by_one_owner_in_the_iterations_dtype(tmp_path):
    """Four ranks (gloo): updates split as FSDP (rows, columns, uneven), FSDP x TP (row- and column-wise, FSDP's
    _StridedShard), HSDP, TP and EP x TP come back equal to one process's Newton-Schulz of the whole matrix, in
    float32 and bf16; each matrix was orthogonalized by exactly one rank of the group that splits it, the owners
    balanced; the only collectives are all-to-alls in the iteration's dtype (no all-gather of float32 matrices).
    Before: every rank gathered every matrix in float32 (full_tensor) and orthogonalized all of them."""
    out = tmp_path / "muon.json"
    proc = run_forked(4, ["tests/muon_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert results.pop("step") == 0.0  # two MuonAdamW steps of FSDP x TP parameters: one process's, bit for bit
    assert {key.split("/")[0] for key in results} == set(OWNER_GROUPS)
    for key, got in results.items():
        name, dtype = key.split("/")
        assert got["diff"] == 0.0, key
        per_rank, count, local = got["matrices_per_rank"], got["updates"], got["local_matrices"]
        groups = OWNER_GROUPS[name]
        if groups is None:  # whole matrices where they are: each rank its own
            assert per_rank == [count * local] * 4, key
            continue
        for group in groups:
            work = [per_rank[rank] for rank in group]
            assert sum(work) == count * local, key  # each matrix once in the group
            assert max(work) - min(work) <= local, key  # balanced: one update's matrices apart at most
        assert got["carried"] == [dtype], key
        assert got["collectives"] == ["c10d.alltoall_base_"], key
    assert results["partial/torch.bfloat16"]["carried"] == []


def test_the_exchange_in_a_rehearsal_reads_what_one_rank_has_where_the_fake_writes_nothing(monkeypatch):
    """A rehearsal's fake process group (torch 2.11's) leaves an all-to-all's output as allocated; on a GPU that is
    recycled memory, often NaN. Here fresh memory is NaN: under the rehearsal's one-rank collectives
    (meshtron.distributed.one_rank_group) the exchange returns this rank's own (finite) pieces, so a rehearsed Muon
    step stays finite."""
    import torch.distributed as dist

    from meshtron.distributed.one_rank_group import one_rank_group
    from meshtron.train.optim import muon

    with one_rank_group(0, 2):
        monkeypatch.setattr(muon.torch, "empty", lambda *args, **kwargs: torch.full(args, math.nan, **kwargs))
        pieces = [torch.ones(2, 3), 2 * torch.ones(1, 3)]
        received = muon._all_to_all(pieces, [[2, 3], [2, 3]], dist.group.WORLD)
    assert [tuple(r.shape) for r in received] == [(2, 3), (2, 3)]
    # what was sent, repeated to fill the longer output, as one rank alone would receive it
    sent = torch.cat([pieces[0].reshape(-1), pieces[1].reshape(-1), pieces[0].reshape(-1)[:3]]).view(4, 3)
    assert torch.equal(torch.cat(received), sent)
