"""Pipeline parallelism: the decoder split into stages over the ``pp`` ranks, run by torch's schedules.

The model is cut into ``pp * stages_per_rank`` stages: embeddings on the first, the final norm and
head (and the loss) on the last, decoder blocks spread over all of them (evenly by default, or as
``parallel.pp_first_stage_layers`` / ``pp_last_stage_layers`` / ``pp_stage_layers`` say). Each stage
is the Hugging Face model itself with the parts it does not hold removed, so parameter names,
initialization and checkpoints are the same as without pipelining. Schedules, microbatching and the
stage-to-stage transfers are ``torch.distributed.pipelining``'s. A model that ties its head to its
embeddings gets the head as a parameter of its own on the last stage, initialized as the embeddings and
kept equal to them by summing the two gradients (``meshtron.distributed.tied_embeddings``).

Between stages travel the hidden states and the micro-batch's full token ids, from which every stage
derives the position ids, document layout and context-parallel shard it needs. The token ids travel
as float32 (exact below 2**24): torch < 2.13 makes every received tensor require grad and expects a
gradient back for it, which an integer tensor cannot have.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshtron.config import PP_SCHEDULES as SCHEDULES
from meshtron.config import ParallelConfig
from meshtron.distributed.devices import torch_release
from meshtron.errors import ConfigError
from meshtron.models.adapter import DecoderAdapter
from meshtron.tensors import local_tensor

MAX_EXACT_TOKEN_ID = 2**24
"""Token ids travel between stages as float32, which holds integers exactly up to here."""
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
V_SHAPED_SCHEDULES = ("ZBVZeroBubble",)


def stages_per_rank(cfg: ParallelConfig) -> int:
    """How many stages each pipeline rank holds (1 for GPipe/1F1B, 2 by default for the others)."""
    if cfg.pp_schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule: '{cfg.pp_schedule}' is not one of {', '.join(SCHEDULES)}")
    multi = cfg.pp_schedule in MULTI_STAGE_SCHEDULES
    count = cfg.pp_stages_per_rank or (2 if multi else 1)
    if not multi and count != 1:
        raise ConfigError(
            f"parallel.pp_schedule={cfg.pp_schedule} runs one stage per rank; set parallel.pp_stages_per_rank=1 "
            f"or use one of {', '.join(MULTI_STAGE_SCHEDULES)}"
        )
    if multi and count < 2:
        raise ConfigError(f"parallel.pp_schedule={cfg.pp_schedule} needs parallel.pp_stages_per_rank >= 2")
    if cfg.pp_schedule in V_SHAPED_SCHEDULES and count != 2:
        raise ConfigError(f"parallel.pp_schedule={cfg.pp_schedule} needs parallel.pp_stages_per_rank=2")
    return count


def split_layers(num_layers: int, cfg: ParallelConfig) -> list[range]:
    """The decoder blocks of each stage, in stage order."""
    num_stages = cfg.pp * stages_per_rank(cfg)
    if cfg.pp_stage_layers:
        try:
            counts = [int(part) for part in cfg.pp_stage_layers.split(",")]
        except ValueError:
            raise ConfigError(
                f"parallel.pp_stage_layers '{cfg.pp_stage_layers}': write layer counts like 3,4,4,3"
            ) from None
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 0:
            raise ConfigError(
                f"parallel.pp_stage_layers '{cfg.pp_stage_layers}' must give {num_stages} non-negative layer counts "
                f"(one per stage) that add up to the model's {num_layers} layers"
            )
    else:
        if num_layers < num_stages:
            raise ConfigError(
                f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages "
                f"(parallel.pp={cfg.pp} x {stages_per_rank(cfg)} stages per rank); lower parallel.pp or the stages "
                "per rank"
            )
        counts = _even_counts(num_layers, num_stages, cfg.pp_first_stage_layers, cfg.pp_last_stage_layers)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _even_counts(num_layers: int, num_stages: int, first: int | None, last: int | None) -> list[int]:
    fixed = {0: first, num_stages - 1: last} if num_stages > 1 else {0: first}
    fixed = {stage: count for stage, count in fixed.items() if count is not None}
    free = [stage for stage in range(num_stages) if stage not in fixed]
    left = num_layers - sum(fixed.values())
    if any(count < 0 for count in fixed.values()) or left < 0 or (left > 0 and not free):
        raise ConfigError(
            f"parallel.pp_first_stage_layers / pp_last_stage_layers ({first} / {last}) do not fit the model's "
            f"{num_layers} layers over {num_stages} stages"
        )
    counts = [0] * num_stages
    for stage, count in fixed.items():
        counts[stage] = count
    base, extra = divmod(left, len(free)) if free else (0, 0)
    # Remainder layers go to the middle stages: the first and last also hold embeddings and the head.
    by_middle = sorted(free, key=lambda stage: abs(stage - (num_stages - 1) / 2))
    for stage in free:
        counts[stage] = base + (1 if stage in by_middle[:extra] else 0)
    return counts


def local_stage_ids(pp_rank: int, cfg: ParallelConfig) -> list[int]:
    """The stages this pipeline rank holds: looped (r, r+pp, ...) or V-shaped (r, 2pp-1-r) for ZBV."""
    count = stages_per_rank(cfg)
    if cfg.pp_schedule in V_SHAPED_SCHEDULES:
        return [pp_rank, 2 * cfg.pp - 1 - pp_rank]
    return [pp_rank + i * cfg.pp for i in range(count)]


def pipeline_microbatches(cfg: ParallelConfig, local_batch: int, micro_batch_size: int | None = None) -> int:
    """Microbatches each data-parallel rank's ``local_batch`` sequences are split into per step: ``local_batch /
    train.micro_batch_size``, else ``parallel.pp_microbatches``, else ``parallel.pp``. Both settings must agree."""
    if not micro_batch_size:
        return cfg.pp_microbatches or cfg.pp
    if local_batch % micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size={micro_batch_size} does not divide the {local_batch} sequences each data-parallel "
            f"rank gets per step; use a divisor of {local_batch} or change train.global_batch_size"
        )
    microbatches = local_batch // micro_batch_size
    if cfg.pp_microbatches is not None and cfg.pp_microbatches != microbatches:
        raise ConfigError(
            f"train.micro_batch_size={micro_batch_size} and parallel.pp_microbatches={cfg.pp_microbatches} disagree: "
            f"{local_batch} sequences per data-parallel rank in microbatches of {micro_batch_size} make {microbatches} "
            "microbatches; set only one of the two"
        )
    return microbatches


def check_pipeline(
    cfg: ParallelConfig,
    hf_config,
    local_batch: int,
    micro_batch_size: int | None = None,
    device_type: str = "cuda",
    torch_version: str = torch.__version__,
) -> int:
    """Refuse pipeline settings that cannot work; returns the number of microbatches.

    ``local_batch``: sequences per data-parallel rank per step; ``micro_batch_size``: ``train.micro_batch_size``
    (sequences per pipeline microbatch), or None.
    """
    if cfg.pp == 1:
        return 1
    if cfg.pp_schedule in V_SHAPED_SCHEDULES and device_type != "cuda" and torch_release(torch_version) < (2, 13):
        raise ConfigError(
            f"parallel.pp_schedule={cfg.pp_schedule} needs torch >= 2.13 on CPU (torch {torch_version} sends between "
            "a rank's own two stages, which gloo cannot do); use parallel.pp_schedule=InterleavedZeroBubble"
        )
    split_layers(hf_config.num_hidden_layers, cfg)
    microbatches = pipeline_microbatches(cfg, local_batch, micro_batch_size)
    if local_batch % microbatches:
        raise ConfigError(
            f"parallel.pp_microbatches={microbatches} does not divide the {local_batch} sequences each data-parallel "
            f"rank gets per step; use a divisor of {local_batch} or change train.global_batch_size"
        )
    # Name the setting the count came from in the errors below.
    setting = f"{microbatches} (parallel.pp_microbatches)"
    if micro_batch_size:
        per_rank = f"{local_batch} sequences per data-parallel rank"
        setting = f"{microbatches} (train.micro_batch_size={micro_batch_size} of {per_rank})"
    if cfg.pp_schedule == "1F1B" and microbatches < cfg.pp:
        raise ConfigError(
            f"parallel.pp_schedule=1F1B needs at least parallel.pp={cfg.pp} microbatches, got {setting}; "
            "use more, smaller microbatches or parallel.pp_schedule=GPipe"
        )
    if cfg.pp_schedule in MULTI_STAGE_SCHEDULES and cfg.pp_schedule != "Interleaved1F1B" and microbatches % cfg.pp:
        raise ConfigError(
            f"parallel.pp_schedule={cfg.pp_schedule} needs the number of microbatches to be a multiple of "
            f"parallel.pp={cfg.pp}, got {setting}"
        )
    if cfg.pp_schedule == "Interleaved1F1B":
        rounds = max(1, microbatches // cfg.pp)
        if microbatches % rounds:
            raise ConfigError(
                f"parallel.pp_schedule=Interleaved1F1B needs the number of microbatches divisible by "
                f"max(1, microbatches // pp) = {rounds}, got {setting}; use a multiple of parallel.pp={cfg.pp}"
            )
    if hf_config.vocab_size > MAX_EXACT_TOKEN_ID:
        raise ConfigError(
            f"the model's vocab_size {hf_config.vocab_size} is over {MAX_EXACT_TOKEN_ID}, the largest token id "
            "pipeline stages pass exactly; use parallel.pp=1"
        )
    return microbatches


TIED_WEIGHTS = "pipeline_tied_weights"
"""Attribute of each pipeline stage of a tied model: {head weight name: embedding weight name}. The last
stage's head is then a parameter of its own that starts as, and is kept equal to, the first stage's
embeddings (see meshtron.distributed.tied_embeddings)."""


def tied_weight_names(model: nn.Module, adapter: DecoderAdapter) -> dict[str, str]:
    """{head weight name: embedding weight name} of a whole model that ties them, else {}."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    head, embeddings = adapter.lm_head(model), adapter.embeddings(model)
    if head is None or embeddings is None or id(head) not in names or id(embeddings) not in names:
        return {}
    return {f"{names[id(head)]}.weight": f"{names[id(embeddings)]}.weight"}


def split_pipeline(
    model: nn.Module, adapter: DecoderAdapter, cfg: ParallelConfig, pp_rank: int
) -> list[tuple[int, nn.Module]]:
    """(stage id, stage model) for every stage pipeline rank ``pp_rank`` holds, cut from the meta-device ``model``.

    With tied embeddings no stage holds both the embeddings (first stage) and the head (last): each stage's
    own config says untied (so nothing ties a head to absent embeddings) and ``TIED_WEIGHTS`` names the pair.
    """
    ranges = split_layers(model.config.num_hidden_layers, cfg)
    last_stage = len(ranges) - 1
    tied = tied_weight_names(model, adapter)
    stages = []
    for stage_id in local_stage_ids(pp_rank, cfg):
        stage = copy.deepcopy(model)  # meta tensors: no memory
        adapter.keep_stage(stage, ranges[stage_id], first=stage_id == 0, last=stage_id == last_stage)
        if tied and last_stage > 0:
            # The stage's own copy of the config: adapter.tie_weights (materialize, TP) must not tie the
            # last stage's head to embeddings it does not hold.
            stage.config.tie_word_embeddings = False
            setattr(stage, TIED_WEIGHTS, dict(tied))
        stages.append((stage_id, stage))
    return stages


def set_stage_forward(
    model: nn.Module, adapter: DecoderAdapter, first: bool, last: bool, inputs_for, tp_mesh=None, routing=None
):
    """Give the stage model the forward its pipeline stage calls.

    ``inputs_for(input_ids)`` turns the micro-batch's full token ids into this rank's model inputs.
    A first stage takes ``(input_ids,)``, the others ``(hidden, token_ids)`` with the token ids as
    float32; every stage but the last returns ``(hidden, token_ids)``, the last its output. Under
    sequence parallel the hidden states are a sequence-sharded DTensor; they travel as their local
    shard and are rewrapped on arrival. ``routing`` (a ``meshtron.train.moe.pipeline_router_loss.StageRouting``,
    with the router load-balancing loss on): every stage also takes (but the first) and returns the routing
    carry, last in its inputs and outputs.
    """

    def forward(self, *args):
        carry = None
        if first:
            hidden, input_ids = None, args[0]
        else:
            hidden, token_ids, *rest = args
            carry = rest[0] if rest else None
            input_ids = token_ids.detach().long()
            # A zero that depends on the received ids gives them the (zero) gradient torch < 2.13 sends back.
            hidden = hidden + (token_ids.sum() * 0).to(hidden.dtype)
        if tp_mesh is not None and hidden is not None and not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, tp_mesh, [Shard(1)], run_check=False)

        def run():
            return adapter.run_stage(self, hidden, inputs_for(input_ids), first, last)

        extra: tuple = ()
        if routing is None:
            out = run()
        else:
            out, carry = routing.run(run, carry, input_ids.device)
            extra = (carry,)
        if last:
            return (out, *extra) if extra else out
        return (local_tensor(out), input_ids.to(torch.float32), *extra)

    model.forward = types.MethodType(forward, model)


KEPT_NODES = "meshtron_kept_nodes"
"""Key of each parameter group (a zero-bubble stage's, between its input and weight passes) that holds the graph
nodes keeping its custom autograd Function intermediates alive (``keep_custom_function_nodes``)."""


def _is_custom_function_node(node) -> bool:
    return isinstance(node, torch.autograd.function.BackwardCFunction)


def _parents_in(roots: list) -> dict[int, list]:
    """{id of a node: the nodes whose next functions include it} over the graph below ``roots``; every node is
    held by the lists (so each id stays its node's)."""
    parents: dict[int, list] = {id(node): [] for node in roots}
    queue = list(roots)
    while queue:
        node = queue.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if id(child) not in parents:
                parents[id(child)] = []
                queue.append(child)
            parents[id(child)].append(node)
    return parents


def _holders_of(parents: dict[int, list], targets: list) -> list:
    """The built-in nodes (each owned by its Python object) nearest above each of ``targets``: while they live,
    so do the targets."""
    holders, climbed, climbing = {}, {id(node) for node in targets}, list(targets)
    while climbing:
        for parent in parents.get(id(climbing.pop()), []):
            if not _is_custom_function_node(parent):
                holders[id(parent)] = parent
            elif id(parent) not in climbed:
                climbed.add(id(parent))
                climbing.append(parent)
    return list(holders.values())


def keep_custom_function_nodes(stage) -> None:
    """Keep, from a zero-bubble schedule's input pass of a micro-batch to its weight pass, the custom autograd
    Function nodes (the fused loss's, a tiled MLP's) where the weight pass starts (its "intermediates").

    torch's input pass (``stage_backward_input``) detaches the stage outputs, which frees the graph above the
    intermediates; it keeps each intermediate by its Python object, which owns a built-in node but only refers
    weakly to a custom Function's (torch 2.11): the weight pass then met a freed node ("Attribute
    '_input_metadata' is invalid for this instance of _C._FunctionBase", found on an H200). torch 2.13's object
    keeps it. The nodes just above them (a scaling, a residual addition: little or nothing saved) stay in the
    micro-batch's parameter groups instead, which the weight pass drops."""
    backward = stage.backward_maybe_with_nosync

    def backward_keeping_nodes(backward_type, bwd_kwargs, *args, **kwargs):
        if backward_type != "input":
            return backward(backward_type, bwd_kwargs, *args, **kwargs)
        outputs = bwd_kwargs["stage_output"]
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        # walked before the input pass frees the graph above its intermediates
        parents = _parents_in([t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None])
        grads, param_groups = backward(backward_type, bwd_kwargs, *args, **kwargs)
        groups = param_groups or []
        targets = [n for group in groups for n in group.get("intermediates", ()) if _is_custom_function_node(n)]
        if targets:
            holders = _holders_of(parents, targets)
            for group in groups:
                group[KEPT_NODES] = holders
        return grads, param_groups

    stage.backward_maybe_with_nosync = backward_keeping_nodes


def pipeline_schedule(stages: list, cfg: ParallelConfig, microbatches: int, loss_fn):
    """torch's schedule for this rank's stages; gradients are not rescaled (the loss is already normalized). The
    stages keep their custom autograd Function nodes through a zero-bubble weight pass (keep_custom_function_nodes)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    for stage in stages:
        keep_custom_function_nodes(stage)
    schedule_class = get_schedule_class(cfg.pp_schedule)
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
