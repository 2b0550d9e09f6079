"""The training state as layout-independent tensors, for torch.distributed.checkpoint.

Model entries are named as in the Hugging Face model (``model/<name>``), optimizer entries by
parameter name too (``optim/state.<name>.exp_avg``, ``optim/param_groups.<name>.lr``), whatever
FSDP, TP, CP or PP did to the model. DCP stores every tensor with its global shape and each rank's
shard, so a checkpoint saved under one layout loads under any other.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshtron.models.adapter import canonical_name
from meshtron.models.moe import ROUTER_BIASES

_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def _optimizer_key_names(key: str, pipelined: bool, tied: dict[str, str] | None = None) -> str:
    """A flattened optimizer key with the pipeline container's stage index removed from the parameter name,
    and a tied head's copy (``tied``: {head: embeddings}) named as the embeddings it equals."""
    if not pipelined:
        return key
    kind, rest = key.split(".", 1)  # "state" or "param_groups", then "<index>.<name>.<leaf>"
    rest = rest.split(".", 1)[1]
    for head, embeddings in (tied or {}).items():
        if rest.startswith(head + "."):
            rest = embeddings + rest[len(head) :]
    return f"{kind}.{rest}"


class TrainingState:
    """Get and set the model and optimizer state of this rank's model parts under canonical names.

    ``container`` is the module the optimizer was built over: the model itself, or under pipeline
    parallelism an ``nn.ModuleList`` of the stages (whose names carry a stage index to strip).

    A tied model's pipeline stages hold the head as a copy of the embeddings, kept equal to them with
    the same optimizer state: its optimizer entries are saved and loaded under the embeddings' name, the
    only one a tied model without pipelining has (its model entries keep both names, as there).
    """

    def __init__(
        self, parts: list[nn.Module], container: nn.Module, optimizer: torch.optim.Optimizer, trained_only: bool = False
    ):
        self.parts, self.container, self.optimizer = parts, container, optimizer
        self.trained_only = trained_only
        """LoRA: the model entries are the weights that train (adapters, a trained head or embeddings, routers'
        balancing biases) only; the frozen base comes from where the run took it (``model.name_or_path``, or the
        seed), as at its start."""
        self.pipelined = container is not parts[0]
        self.tied = {
            head: embeddings
            for part in parts
            for head, embeddings in getattr(part, "pipeline_tied_weights", {}).items()
        }

    def _kept(self, part: nn.Module) -> dict:
        """The part's model entries under canonical names (with ``trained_only``, those of trained weights)."""
        entries = {canonical_name(k): v for k, v in get_model_state_dict(part).items()}
        if not self.trained_only:
            return entries
        trained = {canonical_name(name) for name, param in part.named_parameters() if param.requires_grad}
        # Routers' balancing biases change in training without a gradient (moe.router_balance=bias).
        trained |= {canonical_name(name) for name, _ in part.named_buffers() if name.endswith(ROUTER_BIASES)}
        return {k: v for k, v in entries.items() if k in trained}

    def state_dict(self) -> dict:
        model = {}
        for part in self.parts:
            model.update(self._kept(part))
        optim = get_optimizer_state_dict(self.container, self.optimizer, options=_OPTIM)
        return {
            "model": model,
            "optim": {_optimizer_key_names(k, self.pipelined, self.tied): v for k, v in optim.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Put a state loaded in place into ``state_dict()``'s structure back into the model and optimizer."""
        for part in self.parts:
            own = set(self._kept(part))
            options = StateDictOptions(strict=not self.trained_only)
            set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in own}, options=options)
        template = get_optimizer_state_dict(self.container, self.optimizer, options=_OPTIM)
        optim = {key: state["optim"][_optimizer_key_names(key, self.pipelined, self.tied)] for key in template}
        set_optimizer_state_dict(self.container, self.optimizer, optim, options=_OPTIM)
