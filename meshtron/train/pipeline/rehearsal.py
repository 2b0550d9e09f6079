"""Pipeline stages for ``meshtron train --rehearse`` (one rank of a larger layout on a fake process group).

torch's pipeline stages learn the shapes they receive from their neighbours: a vote over point-to-point
sends, then the metadata as pickled objects. On a fake process group nothing arrives, so a rehearsed stage
is given its shapes instead (torch's static mode: ``input_args`` / ``output_args``), computed from the
layout as meshtron's stage forward (``set_stage_forward``) sends them, and skips the vote.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage

TOKEN_IDS_INDEX = 1
"""Where a non-first stage's inputs hold the micro-batch's token ids (see ``stage_shapes``)."""


class RehearsalStage(PipelineStage):
    """A ``PipelineStage`` with static shapes whose warm-up vote needs no neighbour (all stages are static).

    What it "receives" is whatever its buffers held: it fills them itself, activations with unit normal values
    (so that routers spread tokens over experts as real hidden states do) and token ids and gradients with
    zeros (valid ids, finite updates), so that a rehearsed step never turns non-finite and skips its update.
    """

    def __init__(self, *args, output_args=None, **kwargs):
        super().__init__(*args, output_args=output_args, **kwargs)
        self._static_output_shapes = [tuple(t.shape) for t in output_args] if output_args is not None else None

    def forward_one_chunk(self, *args, **kwargs):
        output = super().forward_one_chunk(*args, **kwargs)
        if self.is_last:  # torch 2.11 checks the last stage's outputs against output_args too, 2.13 does not: check
            self._check_last_outputs(output)  # them on every torch, so that a wrong shape fails here as well
        return output

    def _check_last_outputs(self, output) -> None:
        actual = [tuple(t.shape) for t in (output if isinstance(output, tuple) else (output,))]
        if self._static_output_shapes is not None and actual != self._static_output_shapes:
            raise RuntimeError(
                f"rehearsed stage {self.stage_index}: its outputs have shapes {actual}, "
                f"stage_shapes said {self._static_output_shapes}"
            )

    def _warmup_forward_vote(self, has_backward, received_acc=None):  # torch >= 2.13
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _warmup_backward_result(self, received_result=None):  # torch >= 2.13
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _retrieve_recv_activations(self, fwd_chunk_id):
        activations = super()._retrieve_recv_activations(fwd_chunk_id)
        with torch.no_grad():
            for index, activation in enumerate(activations):
                local = activation.to_local() if hasattr(activation, "to_local") else activation
                local.zero_() if index == TOKEN_IDS_INDEX else local.normal_()
        return activations

    def _retrieve_recv_grads(self, bwd_chunk_id):
        grads = super()._retrieve_recv_grads(bwd_chunk_id)
        with torch.no_grad():
            for grad in grads:
                if grad is not None:
                    (grad.to_local() if hasattr(grad, "to_local") else grad).zero_()
        return grads


def rehearsed_inputs(meta_inputs: tuple, device: torch.device) -> tuple:
    """What a rehearsed stage "receives" in a forward-only pass (meshtron.train.pipeline.evaluate.pipeline_forward:
    a reference model, pipeline evaluation), where nothing arrives: tensors of ``meta_inputs``' shapes
    (``stage_shapes``' inputs) filled as ``RehearsalStage`` fills its buffers (activations unit normal, token ids
    zeros)."""
    tensors = []
    for index, meta in enumerate(meta_inputs):
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        tensor.zero_() if index == TOKEN_IDS_INDEX else tensor.normal_()
        tensors.append(tensor)
    return tuple(tensors)


def stage_shapes(
    first: bool,
    last: bool,
    *,
    micro_batch: int,
    seq_len: int,
    local_seq_len: int,
    hidden_size: int,
    dtype: torch.dtype,
    carry_shape: tuple[int, int] | None,
    last_seq_len: int | None = None,
) -> tuple[tuple, tuple]:
    """(inputs, outputs) of one stage as meta tensors, in ``set_stage_forward``'s order: a first stage takes the
    micro-batch's token ids; the others take (hidden shard, token ids as float32[, routing carry]); every stage
    but the last returns the same three, the last its hidden states (the loss applies the head) and carry.
    ``last_seq_len``: the sequence length of the last stage's hidden states, where it differs from the shard the
    stages send (under sequence parallelism the last stage returns a DTensor, whose shape is the whole sequence
    of this context-parallel rank)."""
    meta = torch.device("meta")
    hidden = torch.empty(micro_batch, local_seq_len, hidden_size, dtype=dtype, device=meta, requires_grad=True)
    last_hidden = torch.empty(
        micro_batch, last_seq_len or local_seq_len, hidden_size, dtype=dtype, device=meta, requires_grad=True
    )
    token_ids = torch.empty(micro_batch, seq_len, dtype=torch.float32, device=meta, requires_grad=True)
    carry = (torch.empty(*carry_shape, device=meta, requires_grad=True),) if carry_shape else ()
    inputs = (
        (torch.empty(micro_batch, seq_len, dtype=torch.long, device=meta),) if first else (hidden, token_ids, *carry)
    )
    outputs = (last_hidden, *carry) if last else (hidden, token_ids, *carry)
    return inputs, outputs
