"""The distillation teacher (meshtron.train.distill.teacher) under FSDP: after its forward only the module that holds
its head stays gathered (the student's loss reads the head), and ``release`` shards that too and forgets the forward;
the targets carry the labels and hidden states bit for bit, each row of the hidden states 16-byte aligned."""

from __future__ import annotations

import pytest
import torch
from test_preference_reference import ADAPTER, VOCAB, Decoder, one_rank_mesh  # noqa: F401 (a fixture)
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from meshtron.config import FSDPConfig
from meshtron.data.labels import IGNORE_INDEX
from meshtron.distributed.data_parallel import apply_fsdp
from meshtron.train.batch import SequenceSplit
from meshtron.train.distill.targets import pack_targets, unpack_targets
from meshtron.train.distill.teacher import TeacherModel
from meshtron.train.preference.reference import freeze


def test_the_teacher_keeps_only_its_head_gathered_until_released(one_rank_mesh):  # noqa: F811
    """With blocks that FSDP does not reshard after forward (``fsdp.reshard_after_forward=false``, the default under
    pipeline parallelism), the teacher's forward left every block gathered through the student's whole step (a
    whole llama-8b on each rank of a pipelined run); now only the root, which holds the head, is, until the student's
    loss has used it."""
    torch.manual_seed(0)
    model = Decoder()
    apply_fsdp(model, ADAPTER, one_rank_mesh, FSDPConfig(reshard_after_forward=False), MixedPrecisionPolicy())
    freeze([model])
    teacher = TeacherModel("test", [model], ADAPTER, SequenceSplit())
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.where(input_ids % 3 == 0, IGNORE_INDEX, input_ids)
    target = teacher.targets(input_ids, labels)
    gathered = {name for name, p in model.named_parameters() if not isinstance(p, DTensor)}
    assert gathered == {"embed.weight", "head.weight"}, gathered
    weight, bias = teacher.head()
    assert not isinstance(weight, DTensor) and weight.shape == (VOCAB, 8) and bias is None
    got_labels, hidden = unpack_targets(target)
    assert torch.equal(got_labels, labels) and hidden.shape == (2, 12, 8)
    teacher.release()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    state = model._get_fsdp_state()
    groups = [group for s in state._state_ctx.all_states for group in s._fsdp_param_groups]
    assert not any(group._post_forward_indices for group in groups) and not state._comm_ctx.post_forward_order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_targets_hold_labels_and_hidden_states_exactly_and_aligned(dtype):
    """Labels (IGNORE_INDEX's bits are a NaN in bfloat16) survive the packing and a pipeline schedule's split over
    microbatches exactly; the hidden states' rows start 16-byte aligned (cuBLAS's fast kernels)."""
    labels = torch.randint(0, 50_000, (4, 6))
    labels[0, :3] = IGNORE_INDEX
    hidden = torch.randn(4, 6, 24).to(dtype)
    target = pack_targets(labels, hidden)
    parts = [unpack_targets(part) for part in target.tensor_split(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), labels)
    assert torch.equal(torch.cat([p[1] for p in parts]), hidden)
    _, view = unpack_targets(target)
    assert (view.stride(1) * view.element_size()) % 16 == 0
