"""Forward-only pipeline passes for evaluation: the stages run in turn, each microbatch handed on with send / recv.

Evaluation does not go through the training schedule (``torch.distributed.pipelining``'s ``eval()``): switching a
schedule between forward-only and training re-initializes its stages' transfer buffers, which torch releases before
2.13 get wrong when evaluation comes first (pytorch/pytorch#162822), and a forward pass needs none of a schedule's
interleaving of backward work. Here every rank walks the (microbatch, stage) pairs in the same order and runs the
stages it holds: a stage's input comes from the rank of the stage before it (or from this rank's own previous
stage, as with the V-shaped schedule's last stage), its output goes to the next stage's rank. Every transfer is
matched by one in the same order on the other rank, so the walk cannot deadlock. The stage modules and their
forwards are those of training (meshtron.distributed.pipeline_parallel.set_stage_forward).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from meshtron.errors import MeshtronError
from meshtron.tensors import local_tensor
from meshtron.train.pipeline.rehearsal import rehearsed_inputs


def _send(tensors: tuple, to_rank: int, group, device: torch.device, known: dict, key) -> None:
    """Each tensor of a stage's output to the next stage's rank; their shapes and dtypes first, once per ``key``
    (the receiver cannot know them: the carry of the router loss comes and goes). ``known``: the metadata sent so
    far on this rank, by key."""
    meta = [(tuple(t.shape), t.dtype) for t in tensors]
    if key not in known:
        dist.send_object_list([meta], group_dst=to_rank, group=group, device=_object_device(device))
        known[key] = meta
    elif known[key] != meta:
        raise MeshtronError(
            f"pipeline evaluation: stage output {meta} differs from the first of its batch shape ({known[key]})"
        )
    for tensor in tensors:
        dist.send(tensor.contiguous(), group_dst=to_rank, group=group)


def _recv(from_rank: int, group, device: torch.device, known: dict, key) -> tuple:
    if key not in known:
        meta = [None]
        dist.recv_object_list(meta, group_src=from_rank, group=group, device=_object_device(device))
        known[key] = meta[0]
    tensors = []
    for shape, dtype in known[key]:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, group_src=from_rank, group=group)
        tensors.append(tensor)
    return tuple(tensors)


def _object_device(device: torch.device):
    """Where send/recv_object_list stage their bytes: the GPU under NCCL, the host under gloo."""
    return device if device.type == "cuda" else None


@torch.no_grad()
def pipeline_eval_loss_sum(runner, input_ids: torch.Tensor | None, labels: torch.Tensor | None) -> torch.Tensor:
    """This rank's summed token loss of one batch (0 off the last stage), forward only.

    ``runner``: the run's meshtron.train.pipeline.runner.PipelineRunner; ``input_ids`` and ``labels`` (already
    cut to this rank's context-parallel shard) are this data-parallel rank's sequences, read on every pipeline rank,
    split into ``runner.microbatches`` microbatches as training splits them (``pipeline_forward``).
    """
    targets = labels.tensor_split(runner.microbatches) if runner.holds_last else None
    device = runner.modules[0].parameters().__next__().device
    total = torch.zeros((), device=device)

    def loss_sum(hidden: torch.Tensor, micro: int) -> None:
        nonlocal total
        total += local_tensor(runner.loss_sum(hidden, targets[micro]))

    pipeline_forward(runner, input_ids, loss_sum)
    return total


@torch.no_grad()
def pipeline_forward(runner, input_ids: torch.Tensor | None, on_last_stage) -> None:
    """Forward only, the stages of ``runner`` in turn over ``runner.microbatches`` microbatches of ``input_ids``;
    ``on_last_stage(hidden, microbatch)`` is called on the last stage's rank with each microbatch's final hidden
    states (inside loss parallel's context when the run uses it).

    ``runner``: a meshtron.train.pipeline.runner.PipelineRunner (its stage modules, ids and ranks; a reference
    model's are laid out like the policy's). A stage's output shapes follow from its microbatch's shape: they go
    to the next stage's rank once per (stage, microbatch shape) in the run (``runner.eval_transfer_meta``), not
    before every transfer.
    """
    group, device = runner.pp_group, runner.modules[0].parameters().__next__().device
    my_rank = dist.get_rank(group)
    last_stage = max(runner.stage_ranks)
    inputs = input_ids.tensor_split(runner.microbatches)
    known = getattr(runner, "eval_transfer_meta", None)  # both ends of a transfer fill theirs alike
    rehearsed = getattr(runner, "rehearsal_inputs", {})  # --rehearse: what a stage would receive, made up
    if known is None:
        known = runner.eval_transfer_meta = {}
    for micro in range(runner.microbatches):
        kept = None  # the output of this rank's previous stage, when the next stage is this rank's too
        for stage_id, module in zip(runner.stage_ids, runner.modules):
            if stage_id == 0:
                args = (inputs[micro],)
            elif kept is not None:
                args = kept
            elif stage_id in rehearsed:  # nothing arrives on a fake process group
                args = rehearsed_inputs(rehearsed[stage_id], device)
            else:
                key = (stage_id - 1, tuple(inputs[micro].shape))
                args = _recv(runner.stage_ranks[stage_id - 1], group, device, known, key)
            output = module(*args)
            kept = None
            if stage_id == last_stage:
                hidden = output[0] if runner.router is not None else output
                with loss_parallel() if runner.loss_parallel else contextlib.nullcontext():
                    on_last_stage(hidden, micro)
            elif runner.stage_ranks[stage_id + 1] == my_rank:
                kept = output
            else:
                key = (stage_id, tuple(inputs[micro].shape))
                _send(output, runner.stage_ranks[stage_id + 1], group, device, known, key)
