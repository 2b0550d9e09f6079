"""This rank's model, built for the run: on the meta device, parallelized (pipeline split first), materialized, and
under pipeline parallelism wrapped in the pipeline runner (``build_model``); and how a batch's sequences are cut
over the context-parallel ranks (``sequence_split``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import nn

from meshtron.config import Config, LoraConfig, reference_kind
from meshtron.data.hub import model_folder
from meshtron.distributed.context_parallel import hybrid_groups
from meshtron.distributed.data_parallel import parameter_device
from meshtron.distributed.mesh import Meshes
from meshtron.distributed.parallelize import parallelize
from meshtron.distributed.precision import PrecisionPolicy
from meshtron.distributed.runtime import Runtime
from meshtron.distributed.tied_embeddings import attach_tied_embedding_sync
from meshtron.models.adapter import DecoderAdapter
from meshtron.models.attention import attention_windows
from meshtron.models.build import build_meta_model, materialize
from meshtron.models.lora import add_lora
from meshtron.models.moe import moe_layer_indices
from meshtron.train.batch import SequenceSplit
from meshtron.train.distill.head import DistillHead
from meshtron.train.distill.teacher import TeacherModel
from meshtron.train.loss.distill import DistillOptions
from meshtron.train.loss.preference import preference_objective
from meshtron.train.pipeline.runner import PipelineRunner, build_pipeline_runner
from meshtron.train.preference.head import HeadOptions, PreferenceHead
from meshtron.train.preference.reference import ReferenceModel, freeze
from meshtron.train.setup.run_setup import RunSetup, parallelize_options


@dataclass
class BuiltModel:
    """The parallelized, materialized model of this rank and what drives it."""

    model: nn.Module
    """The model; under pipeline parallelism an ``nn.ModuleList`` of this rank's stages."""
    parts: list[nn.Module]
    """The Hugging Face model (or, under pipeline parallelism, this rank's stages of it)."""
    adapter: DecoderAdapter
    runner: PipelineRunner | None
    """The pipeline schedule's runner (pp > 1), else None."""
    pp_group: dist.ProcessGroup | None
    """The pipeline-parallel process group (pp > 1), else None."""


def sequence_split(meshes: Meshes | None, setup: RunSetup, cfg: Config, eos_token_id: int | None) -> SequenceSplit:
    dims = setup.dims
    cp_rank, cp_group, hybrid = 0, None, None
    if dims.cp > 1:
        cp_mesh = meshes.cp
        cp_rank, cp_group = cp_mesh.get_local_rank(), cp_mesh.get_group()
        if cfg.parallel.cp_method == "hybrid":  # its Ulysses and ring groups, made on every rank alike
            hybrid = hybrid_groups(cp_mesh, cfg.parallel.cp_ulysses)
    return SequenceSplit(
        dims.cp,
        cp_rank,
        cp_group,
        cfg.parallel.cp_method,
        hybrid,
        cfg.data.mask_documents,
        eos_token_id,
        attention_windows=attention_windows(setup.hf_config),
        attention_kernel=setup.attention_kernel,
    )


def build_model(
    cfg: Config,
    runtime: Runtime,
    setup: RunSetup,
    meshes: Meshes | None,
    split: SequenceSplit,
    policy: PrecisionPolicy,
    frozen: bool = False,
) -> BuiltModel:
    """Build on the meta device, parallelize (pipeline split first), materialize; the pipeline runner when pp > 1.
    Under ``precision.float8`` a run that does not resume computes its float8 weight scales from the initial weights
    (a resume does from the restored ones: meshtron.train.run.resumable). ``frozen``: no parameter takes a gradient
    (a reference model), from before the parallelisms apply."""
    dims = setup.dims
    model, adapter = build_meta_model(setup.hf_config, cfg.model)
    if frozen:
        model.requires_grad_(False)
    if cfg.lora.enabled:  # before the pipeline split and every parallelism: the adapters are the blocks' own
        add_lora(model, adapter, cfg.lora)
    if dims.pp == 1:
        adapter.return_hidden_states(model)  # the loss applies the head (pipeline stages do the same)
    moe_layers = moe_layer_indices(model)  # before the pipeline split: the whole model's
    stages = parallelize(model, adapter, dims, meshes, parallelize_options(cfg, setup), runtime.device.type)
    for _, stage in stages:
        materialize(
            stage,
            adapter,
            parameter_device(cfg.fsdp, runtime.device),
            seed=cfg.train.seed,
            pretrained_dir=model_folder(cfg.model),
            buffer_device=runtime.device,
        )
        stage.train()
    parts = [stage for _, stage in stages]
    built = BuiltModel(parts[0], parts, adapter, None, None)
    if dims.pp > 1:
        model, runner = build_pipeline_runner(
            stages,
            adapter,
            cfg,
            setup,
            meshes,
            runtime.device,
            split,
            policy.compute_dtype,
            moe_layers,
            rehearsal=runtime.rehearsal,
        )
        # Tied embeddings: the last stage's head copy gets the first stage's gradient added after backward.
        attach_tied_embedding_sync(runner, parts, [stage_id for stage_id, _ in stages], cfg.parallel, meshes)
        built = BuiltModel(model, parts, adapter, runner, meshes.pp.get_group())
    if cfg.precision.float8 and (frozen or not setup.resume_from):  # a reference's weights are its initial ones
        from meshtron.distributed.float8 import refresh_float8_scales

        refresh_float8_scales(parts)  # FSDP's float8 all-gather: weight scales from the initial weights
    return built


def build_preference_head(
    cfg: Config, setup: RunSetup, split: SequenceSplit, built: BuiltModel
) -> PreferenceHead | None:
    """A preference objective's loss on the head (None for ``train.objective=causal_lm``); under pipeline
    parallelism the runner's loss function uses it too."""
    objective = preference_objective(cfg.train.objective, cfg.dpo, cfg.ipo, cfg.simpo, cfg.orpo)
    if objective is None:
        return None
    preference = PreferenceHead(objective, _head_options(cfg, setup, built), split.cp_group, setup.dims.cp)
    if built.runner is not None:
        built.runner.preference = preference
    return preference


def build_reference(
    cfg: Config,
    runtime: Runtime,
    setup: RunSetup,
    meshes: Meshes | None,
    split: SequenceSplit,
    policy: PrecisionPolicy,
    built: BuiltModel,
    preference: PreferenceHead | None,
) -> ReferenceModel | None:
    """The live reference model of ``dpo`` / ``ipo`` (meshtron.train.preference.reference): the policy with its
    adapters off (``lora_base``), or a frozen copy of the starting weights built under the run's own layout
    (``model``, with ``preference.reference_dtype``); None without one (reference-free objectives, ``precomputed``)."""
    kind = reference_kind(cfg)
    if preference is None or kind not in ("model", "lora_base"):
        return None
    if kind == "lora_base":
        modules = built.runner.modules if built.runner is not None else built.parts
        return ReferenceModel(kind, modules, built.adapter, preference.head, split, built.runner)
    model = replace(cfg.model, dtype=cfg.preference.reference_dtype or cfg.model.dtype)
    copy = build_model(replace(cfg, model=model, lora=LoraConfig()), runtime, setup, meshes, split, policy, True)
    freeze(copy.parts)
    modules = copy.runner.modules if copy.runner is not None else copy.parts
    return ReferenceModel(kind, modules, copy.adapter, preference.head, split, copy.runner)


def build_distill(
    cfg: Config,
    runtime: Runtime,
    setup: RunSetup,
    meshes: Meshes | None,
    split: SequenceSplit,
    policy: PrecisionPolicy,
    built: BuiltModel,
) -> DistillHead | None:
    """``train.objective=distill``'s loss with its teacher (meshtron.train.distill.teacher) built under the run's own
    layout: its own shape (``setup.teacher_config``), no LoRA, no router loss, an even split of its layers over the
    pipeline stages, ``distill.teacher_dtype``; None for other objectives. Under pipeline parallelism the student's
    runner's loss function uses it too."""
    if cfg.train.objective != "distill":
        return None
    teacher_cfg = replace(
        cfg,
        model=setup.teacher_model,
        lora=LoraConfig(),
        moe=replace(cfg.moe, router_aux_loss="false"),  # forward only: no load-balancing loss
        parallel=replace(cfg.parallel, pp_first_stage_layers=None, pp_last_stage_layers=None, pp_stage_layers=None),
        train=replace(
            cfg.train, seed=cfg.train.seed + 1
        ),  # a preset teacher's random weights differ from the student's
    )
    teacher_setup = replace(setup, hf_config=setup.teacher_config, model=setup.teacher_model)
    # The student's sequence cut, with the teacher's own attention windows (sliding layers the student may lack).
    teacher_split = replace(split, attention_windows=attention_windows(setup.teacher_config))
    copy = build_model(teacher_cfg, runtime, teacher_setup, meshes, teacher_split, policy, frozen=True)
    freeze(copy.parts)  # as a reference copy: no gradients, eval mode
    modules = copy.runner.modules if copy.runner is not None else copy.parts
    teacher = TeacherModel(cfg.distill.teacher or "", modules, copy.adapter, teacher_split, copy.runner)
    teacher_softcap = copy.runner.softcap if copy.runner is not None else copy.adapter.logit_softcap(copy.model)
    distill = cfg.distill
    options = DistillOptions(distill.divergence, distill.beta, distill.temperature, distill.alpha)
    head = _head_options(cfg, setup, built)
    result = DistillHead(options, head, teacher, teacher_softcap)
    if built.runner is not None:
        built.runner.distill = result
    return result


def _head_options(cfg: Config, setup: RunSetup, built: BuiltModel) -> HeadOptions:
    """How the student's head computes in a loss of its own (preference, distillation)."""
    softcap = built.runner.softcap if built.runner is not None else built.adapter.logit_softcap(built.model)
    return HeadOptions(
        compute_dtype=setup.precision.compute_dtype,
        chunk_size=cfg.train.loss_chunk_size,
        loss_parallel=setup.dims.tp > 1 and cfg.parallel.loss_parallel,
        softcap=softcap,
        compiled=setup.compiled,
    )
