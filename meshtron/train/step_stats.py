"""The numbers one optimizer step shares across ranks, with at most one collective per step.

* The global target count (labelled tokens of the global batch), which scales every rank's loss before
  backward, is counted by every rank from the data itself: the global batch is known to all ranks
  (``GlobalBatchSchedule``), so no all-reduce is needed, and it is a Python int (no device sync).
* The global loss and the global gradient norm are summed in one all-reduce of two numbers over all
  ranks, after backward, instead of one each (and, under pipeline parallelism, a second one for the loss).
  The run's per-step flags (a stop signal, an async save not yet written: meshtron.resilience.guard) ride
  in the same all-reduce, so that they cost no collective of their own.
* All reach the host in one transfer (one device sync on GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from meshtron.data.labels import IGNORE_INDEX
from meshtron.distributed.grad_norm import local_grad_square_sum


def global_target_count(dataset, indices: np.ndarray) -> int:
    """Labelled tokens (labels != IGNORE_INDEX) of the sequences ``indices`` of ``dataset``, at least 1.

    Counted the way ``PackedDataset.batch`` cuts labels (each sequence's tokens after the first). Reads
    the label tokens of the sequences (4 bytes a token), no collective: every rank gets the same count. A dataset
    whose labels are not every next token of rows it holds (chat's masked labels; a stream, which holds only this
    rank's lanes) counts them itself with ``target_count(indices)``.
    """
    own_count = getattr(dataset, "target_count", None)
    if own_count is not None:
        return max(1, int(own_count(indices)))
    rows = dataset.rows(np.sort(np.asarray(indices, dtype=np.int64)))
    return max(1, int(np.count_nonzero(rows[:, 1:] != IGNORE_INDEX)))


@torch.no_grad()
def global_loss_and_grad_norm(
    local_loss_sum: torch.Tensor, parameters, targets: int, *, loss_copies: int = 1, pipeline_degree: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient norm) of the whole global batch, identical on every rank, from one all-reduce.

    ``local_loss_sum``: this rank's summed token loss (0 on pipeline stages without the head);
    ``targets``: the global target count; ``loss_copies``: how many ranks hold the same loss sum (the
    tensor-parallel degree); ``pipeline_degree`` as in ``global_grad_norm``.
    """
    loss, grad_norm, _ = global_step_sums(
        local_loss_sum, parameters, targets, loss_copies=loss_copies, pipeline_degree=pipeline_degree
    )
    return loss, grad_norm


@torch.no_grad()
def global_step_sums(
    local_loss_sum: torch.Tensor,
    parameters,
    targets: int,
    *,
    loss_copies: int = 1,
    pipeline_degree: int = 1,
    flags: Sequence[int] = (),
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, gradient norm, ``flags`` then ``extra`` summed over all ranks), identical on every rank, from one
    all-reduce.

    As ``global_loss_and_grad_norm``; ``flags``: small counts of this rank (exact in float32 up to 2**24 over
    the ranks), put on the device without a host-to-device copy (a fill each: no device sync); ``extra``: a vector
    of this rank's sums that, like the loss, ``loss_copies`` ranks hold alike (a preference objective's metrics).
    """
    parameters = list(parameters)
    square_sum = local_grad_square_sum(parameters, pipeline_degree=pipeline_degree)
    loss_share = local_loss_sum.detach().float()
    if loss_copies > 1:
        loss_share = loss_share / loss_copies
    if square_sum is None:
        square_sum = torch.zeros((), device=loss_share.device)
    flag_values = [loss_share.new_full((), float(flag)) for flag in flags]
    extra_values = [] if extra is None else list((extra.detach().float() / loss_copies).to(loss_share.device))
    both = torch.stack([loss_share, square_sum.to(loss_share.device), *flag_values, *extra_values])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(both)
    return both[0] / targets, both[1].sqrt(), both[2:]


@torch.no_grad()
def global_loss_sum(local_loss_sum: torch.Tensor, targets: int, *, loss_copies: int = 1) -> torch.Tensor:
    """The global batch's loss (summed over every rank, / ``targets``) without a gradient norm (evaluation)."""
    loss_share = local_loss_sum.detach().float() / loss_copies
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loss_share)
    return loss_share / targets


def host_values(*tensors: torch.Tensor) -> list[float]:
    """The values of scalar tensors as Python floats, in one device-to-host transfer."""
    return torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()
