"""The live reference model (meshtron.train.preference.reference) under FSDP: a model that never runs backward must
not keep the parameters that FSDP gathers for backward (the root's, the last block's) gathered after its forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from meshtron.config import FSDPConfig
from meshtron.data.labels import IGNORE_INDEX
from meshtron.distributed.data_parallel import apply_fsdp
from meshtron.train.batch import SequenceSplit
from meshtron.train.loss.preference import preference_runs
from meshtron.train.preference.head import HeadOptions
from meshtron.train.preference.reference import ReferenceModel, freeze

VOCAB, WIDTH, SEQ = 40, 8, 12


class Decoder(nn.Module):
    """Embeddings, three blocks, a head that the loss applies (as meshtron's models return hidden states)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return hidden


ADAPTER = SimpleNamespace(
    named_blocks=lambda model: list(model.layers.named_children()),
    head_parameters=lambda model: (model.head.weight, None),
)


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo process group in this process and its mesh, destroyed after the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def preference_rows(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels of ``rows`` rows, each labelled in two runs (a chosen and a rejected answer)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    labels = torch.full((rows, SEQ), IGNORE_INDEX)
    labels[:, 2:5] = input_ids[:, 3:6]
    labels[:, 8:11] = input_ids[:, 9:12]
    return input_ids, labels


@pytest.mark.parametrize("kind", ["model", "lora_base"])
def test_a_sharded_reference_leaves_every_parameter_sharded_after_its_forward(one_rank_mesh, kind):
    """FSDP keeps the root's and the last block's parameters gathered after forward for the backward that follows;
    a reference runs none, so without a reshard a frozen copy (``model``) kept them gathered for the whole run (a
    whole embedding, head and block on every rank), and the policy (``lora_base``) entered its training forward
    gathered, as evaluation once did (meshtron.distributed.data_parallel.reshard_all). FSDP over one rank is a
    real layout: ``fsdp.cpu_offload`` on one process. A frozen copy also clears FSDP2's record of its forwards,
    which only a backward clears (it grew by an entry per FSDP module and forward for the whole run)."""
    torch.manual_seed(0)
    model = Decoder()
    apply_fsdp(model, ADAPTER, one_rank_mesh, FSDPConfig(cpu_offload=True), MixedPrecisionPolicy())
    if kind == "model":
        freeze([model])
    reference = ReferenceModel(kind, [model], ADAPTER, HeadOptions(), SequenceSplit())
    input_ids, labels = preference_rows(2)
    logps = reference.answer_logps(input_ids, labels, preference_runs(labels))
    assert logps.shape == (2, 2) and bool(torch.isfinite(logps).all()) and bool((logps < 0).all())
    gathered = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not gathered, f"gathered after the reference's forward: {gathered}"
    again = reference.answer_logps(input_ids, labels, preference_runs(labels))
    assert torch.equal(again, logps)
    if kind == "model":  # FSDP2's record of forwards, which only a backward clears, stays empty (see forget_forwards)
        state = model._get_fsdp_state()
        groups = [group for s in state._state_ctx.all_states for group in s._fsdp_param_groups]
        assert len(groups) == 4 and not any(group._post_forward_indices for group in groups)
        assert not state._comm_ctx.post_forward_order


@pytest.mark.parametrize("frozen", [False, True])
def test_a_resumed_runs_reference_gets_its_float8_scales_at_build(monkeypatch, frozen):
    """Under float8 tensorwise the FSDP all-gathers use weight scales computed once (``refresh_float8_scales``):
    a resumed policy gets them from its restored weights (meshtron.train.run.resumable), but a reference copy,
    whose weights are always its initial ones, got them from nobody on a resume, and FSDP then scaled each weight
    at each all-gather by its own shard's maximum under tensor parallelism (another rounding than the run before
    the resume). build_model's set-up around the check is stood in for."""
    from meshtron.config import load_config
    from meshtron.distributed import float8
    from meshtron.train.setup import build

    refreshed = []
    model = nn.Linear(4, 4)
    adapter = SimpleNamespace(return_hidden_states=lambda m: None)
    monkeypatch.setattr(build, "build_meta_model", lambda hf_config, model_cfg: (model, adapter))
    monkeypatch.setattr(build, "moe_layer_indices", lambda m: [])
    monkeypatch.setattr(build, "parallelize_options", lambda cfg, setup: None)
    monkeypatch.setattr(build, "parallelize", lambda m, *rest: [(0, m)])
    monkeypatch.setattr(build, "materialize", lambda *args, **kwargs: None)
    monkeypatch.setattr(float8, "refresh_float8_scales", lambda parts: refreshed.append(parts))
    cfg = load_config(None, ["precision.float8=true"], env={})
    setup = SimpleNamespace(dims=SimpleNamespace(pp=1), hf_config=None, resume_from="runs/a/checkpoints/step-2")
    runtime = SimpleNamespace(device=torch.device("cpu"), rehearsal=False)
    build.build_model(cfg, runtime, setup, None, SequenceSplit(), None, frozen)
    assert refreshed == ([[model]] if frozen else [])  # the policy's come from the checkpoint
