"""Tensor-parallel styles meshtron adds to PyTorch's for what its model families need (meshtron.distributed.
tensor_parallel maps each adapter role to a style; the roles are listed in meshtron.models.adapter).

* ``ReplicatedKVProjection``: k / v projections kept whole when tp exceeds the KV heads (GQA);
* ``GatheredNormParallel``: a norm over all heads' features (OLMo 2's q / k norms) on the gathered heads;
* ``ReplicateParallel``: a module computed whole on every tp rank (norms without sequence parallel, MLA's latents);
* ``LatentRopeParallel``: MLA's key-value latent projection, whose shared rope key's gradient is summed over tp;
* ``ReplicatedBlockParallel``: a sparse MoE block computed whole on every tp rank, on plain tensors;
* ``AttentionSinksParallel``: an attention module with per-head parameters (gpt-oss's sinks) split with the heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.nn.utils.stateless import _reparametrize_module

from meshtron.tensors import local_tensor


class ReplicatedKVProjection(ParallelStyle):
    """A k or v projection kept whole on every tp rank; each rank keeps the one KV head its query heads use.

    Used when tp exceeds the number of KV heads. The gradient that reaches the (replicated) weight on a
    rank covers only its own query heads, so it is marked partial and summed over the tp ranks.
    """

    def __init__(self, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def _input_fn(self, module, inputs, mesh):
        (hidden,) = inputs
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        return hidden.redistribute(mesh, [Replicate()])

    def _output_fn(self, module, output: DTensor, mesh):
        ranks_per_head = mesh.size() // self.num_kv_heads
        head = mesh.get_local_rank() // ranks_per_head
        full = output.to_local(grad_placements=[Partial()])
        return full[..., head * self.head_dim : (head + 1) * self.head_dim]

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # No partition function: distribute_module replicates the parameters over the tp mesh.
        return distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)


class GatheredNormParallel(ParallelStyle):
    """A norm over all heads' features of a column-parallel projection (OLMo 2's q_norm / k_norm).

    The local heads' features are all-gathered, the norm runs on the whole (replicated) features with its
    replicated weight, and each rank keeps its own heads' slice; autograd's collectives (reduce-scatter
    the input gradient) make the result and every gradient exact.
    """

    @staticmethod
    def _input_fn(module, inputs, mesh):
        (hidden,) = inputs
        return DTensor.from_local(hidden, mesh, [Shard(-1)], run_check=False).redistribute(mesh, [Replicate()])

    @staticmethod
    def _output_fn(module, output, mesh):
        return output.redistribute(mesh, [Shard(-1)]).to_local()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)


class ReplicateParallel(ParallelStyle):
    """A module computed whole on every tp rank (a norm without sequence parallel).

    Its parameters become replicated DTensors so that every parameter of a tensor-parallel model is a
    DTensor (optimizers cannot mix DTensors and plain tensors in one foreach update). Input and output
    stay plain tensors.
    """

    @staticmethod
    def _input_fn(module, inputs, mesh):
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def _output_fn(self, module, output, mesh):  # a method: LatentRopeParallel's reads its own settings
        return local_tensor(output)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)


class _SumGradientColumns(torch.autograd.Function):
    """Identity forward; backward sums the gradient's last-dim columns ``start:`` over ``group`` (the rest is
    already whole on every rank)."""

    @staticmethod
    def forward(ctx, tensor, group, start: int):
        ctx.group, ctx.start = group, start
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        columns = grad[..., ctx.start :].contiguous()
        dist.all_reduce(columns, group=ctx.group)
        grad[..., ctx.start :] = columns
        return grad, None, None


class LatentRopeParallel(ReplicateParallel):
    """MLA's ``kv_a_proj_with_mqa`` (meshtron.models.deepseek), computed whole on every tp rank: its output is the
    key-value latent, whose gradient arrives whole (the column-parallel ``kv_b_proj`` after it sums its input
    gradient over the tp ranks), then the rope key shared by all heads, whose gradient each rank has from its own
    heads only: summed over the tp ranks in backward, so the weight's gradient is whole and the same on every rank."""

    def __init__(self, rope_columns: int):
        super().__init__()
        self.rope_columns = rope_columns

    def _output_fn(self, module, output, mesh):
        output = local_tensor(output)
        return _SumGradientColumns.apply(output, mesh.get_group(), output.shape[-1] - self.rope_columns)


class ReplicatedBlockParallel(ParallelStyle):
    """A module computed whole on every tp rank on the full sequence (a sparse MoE block: router, experts,
    shared expert), on plain tensors.

    Its input is gathered from the residual-stream layout to the full sequence (``Replicate``), its
    parameters are replicated DTensors that its forward sees as local tensors (the experts index their 3-D
    parameters, which DTensor does not support), and its output goes back to the residual-stream layout
    (``Shard(1)`` under sequence parallel: a local slice, whose backward all-gathers the output gradient).
    Every tp rank so computes the same output and the same whole gradients: they are ``Replicate``, not
    partial, and the input gradient is the same on every rank (its ``Shard(1)`` slice needs no reduction).
    """

    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.stream = Shard(1) if sequence_parallel else Replicate()

    def _input_fn(self, module, inputs, mesh):
        hidden, *rest = inputs
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, mesh, [self.stream], run_check=False)
        return (hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Replicate()]), *rest)

    def _output_fn(self, module, output, mesh):
        if isinstance(output, tuple):  # (hidden, router scores): gpt-oss's block; the scores stay local
            return (self._output_fn(module, output[0], mesh), *output[1:])
        output = DTensor.from_local(output, mesh, [Replicate()], run_check=False)
        if isinstance(self.stream, Shard):
            return output.redistribute(mesh, [self.stream])  # the residual stream is a DTensor here
        return output.to_local(grad_placements=[Replicate()])

    @staticmethod
    def _local_forward(module: nn.Module, device_mesh):
        forward = module.forward

        def local_forward(*args, **kwargs):
            # Only the parameters replicated over the tp mesh. Others (expert-parallel experts, sharded over ep and
            # gathered by their own FSDP in their own pre-forward, inside this forward) are left to their module,
            # which takes their local piece itself: swapped here, they would be restored after the forward as the
            # sharded parameter FSDP had replaced by the gathered one, and a later forward while FSDP still holds
            # them gathered (pipelining, reshard_after_forward=false) would compute with the sharded parameter,
            # whose gradient then bypasses FSDP's reduction and division (efsdp = 1: same shape, no error).
            params = {
                name: param.to_local(grad_placements=param.placements)
                for name, param in module.named_parameters()
                if isinstance(param, DTensor) and param.device_mesh == device_mesh
            }
            # Replicated buffers too (DeepSeek-V3's router bias): the same tensor's local value, updated in place.
            params.update(
                (name, buffer.to_local()) for name, buffer in module.named_buffers() if isinstance(buffer, DTensor)
            )
            with _reparametrize_module(module, params):
                return forward(*args, **kwargs)

        module.forward = local_forward

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # No partition function: distribute_module replicates the parameters over the tp mesh.
        module = distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)
        self._local_forward(module, device_mesh)
        return module


class AttentionSinksParallel(ParallelStyle):
    """An attention module (role ``attention``: its input gathered by ``prepare``) that also holds per-head
    parameters (role ``attention_sinks``: gpt-oss's ``sinks`` [H]). They are split with the heads, ``Shard(0)``,
    as the column-parallel q_proj splits its rows (rank r: heads [r H/tp, (r+1) H/tp)), and the module's forward
    sees this rank's slice as a plain tensor (transformers' attention reshapes it against the local heads); its
    gradient is that slice's, complete on its rank."""

    def __init__(self, prepare: ParallelStyle, names: tuple[str, ...] = ("sinks",)):
        super().__init__()
        self.prepare = prepare
        self.names = names

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name)
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module = self.prepare._apply(module, device_mesh)
        forward, names = module.forward, self.names

        def local_forward(*args, **kwargs):
            # Read at call time: FSDP puts its unsharded (still tp-sharded) parameter in place before forward.
            params = {name: _local_parameter(getattr(module, name)) for name in names}
            with _reparametrize_module(module, params, strict=False):
                return forward(*args, **kwargs)

        module.forward = local_forward
        return module


def _local_parameter(param: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local piece whose gradient keeps the parameter's placements; plain ones as they are."""
    return param.to_local(grad_placements=param.placements) if isinstance(param, DTensor) else param
