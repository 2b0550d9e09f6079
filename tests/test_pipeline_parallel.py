"""Pipeline stages: layer split, stage placement, and that chained stages compute the whole model."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ParallelConfig, ParallelOptions, load_config
from meshtron.distributed.pipeline_parallel import local_stage_ids, split_layers, split_pipeline
from meshtron.errors import ConfigError


def layer_counts(num_layers, **settings) -> list[int]:
    return [len(r) for r in split_layers(num_layers, ParallelConfig(**settings))]


def test_layers_spread_evenly_with_the_remainder_in_the_middle():
    assert layer_counts(8, pp=4) == [2, 2, 2, 2]
    assert layer_counts(10, pp=4) == [2, 3, 3, 2]
    assert layer_counts(8, pp=2, pp_schedule="Interleaved1F1B") == [2, 2, 2, 2]
    ranges = split_layers(10, ParallelConfig(pp=4))
    assert [i for r in ranges for i in r] == list(range(10))  # contiguous, in order, each layer once


def test_lighter_first_and_last_stages_and_explicit_counts():
    assert layer_counts(10, pp=4, pp_first_stage_layers=1, pp_last_stage_layers=1) == [1, 4, 4, 1]
    assert layer_counts(8, pp=2, pp_first_stage_layers=3) == [3, 5]
    assert layer_counts(8, pp=4, pp_stage_layers="1,3,3,1") == [1, 3, 3, 1]
    with pytest.raises(ConfigError, match="add up to the model's 8 layers"):
        split_layers(8, ParallelConfig(pp=4, pp_stage_layers="1,3,3,2"))
    with pytest.raises(ConfigError, match="fewer than the 8 pipeline stages"):
        split_layers(4, ParallelConfig(pp=4, pp_schedule="Interleaved1F1B"))


def test_stage_placement_looped_and_v_shaped():
    assert local_stage_ids(1, ParallelConfig(pp=4)) == [1]
    assert local_stage_ids(1, ParallelConfig(pp=4, pp_schedule="Interleaved1F1B")) == [1, 5]
    assert local_stage_ids(0, ParallelConfig(pp=4, pp_schedule="ZBVZeroBubble")) == [0, 7]
    assert local_stage_ids(3, ParallelConfig(pp=4, pp_schedule="ZBVZeroBubble")) == [3, 4]


def test_chained_stages_compute_the_whole_model():
    """Every stage of pp=2 x 2 stages per rank, materialized on its own, chained by hand, gives the
    full model's logits: names, initialization and the stage forward all match the unsplit model."""
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.distributed.context_parallel import register_attention
    from meshtron.distributed.pipeline_parallel import set_stage_forward
    from meshtron.models.build import build_meta_model, load_hf_config, materialize
    from meshtron.train.batch import SequenceSplit, sequence_inputs

    cfg = load_config(
        None, ["model.preset=llama-deep", "parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"], env={}
    )
    tokenizer = load_tokenizer("byte")
    hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    cpu = torch.device("cpu")
    full, adapter = build_meta_model(hf_config, cfg.model)
    materialize(full, adapter, cpu, seed=3)
    input_ids = torch.randint(0, 200, (2, 24))
    input_ids[0, 5] = tokenizer.eos_token_id
    split = SequenceSplit(mask_documents=True, eos_token_id=tokenizer.eos_token_id)
    inputs = sequence_inputs(input_ids, split)
    adapter.use_attention(full, register_attention())
    expected = full(**inputs).logits

    stages = {}
    for pp_rank in range(2):
        meta, _ = build_meta_model(hf_config, cfg.model)
        for stage_id, stage in split_pipeline(meta, adapter, cfg.parallel, pp_rank):
            materialize(stage, adapter, cpu, seed=3)
            stages[stage_id] = stage
    assert sorted(stages) == [0, 1, 2, 3]
    names = {name for stage in stages.values() for name, _ in stage.named_parameters()}
    assert names == {name for name, _ in full.named_parameters()}
    out = (input_ids,)
    for stage_id in range(4):
        stage = stages[stage_id]
        adapter.use_attention(stage, register_attention())
        set_stage_forward(stage, adapter, stage_id == 0, stage_id == 3, lambda ids: sequence_inputs(ids, split))
        out = stage(*out)
    # The last stage ends with the final norm; the loss applies the head (meshtron.train.loss.head).
    logits = stages[3].lm_head(out)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_torch_2_11_token_ids_travel_as_float_and_zbv_is_refused_on_cpu():
    """torch < 2.13 makes every tensor a stage receives require grad: the token ids cross stages as
    float32 (exact below 2**24); its V-shaped schedule sends between a rank's own stages, which gloo
    cannot, so ZBV is refused on CPU there (with the schedule that works named)."""
    from types import SimpleNamespace

    from meshtron.distributed.pipeline_parallel import MAX_EXACT_TOKEN_ID, check_pipeline
    from meshtron.errors import ConfigError

    assert float(torch.tensor(MAX_EXACT_TOKEN_ID - 1, dtype=torch.float32)) == MAX_EXACT_TOKEN_ID - 1
    config = SimpleNamespace(num_hidden_layers=8, vocab_size=257, tie_word_embeddings=False)
    zbv = ParallelConfig(pp=2, pp_schedule="ZBVZeroBubble")
    with pytest.raises(ConfigError, match="needs torch >= 2.13 on CPU.*use parallel.pp_schedule=InterleavedZeroBubble"):
        check_pipeline(zbv, config, 4, False, device_type="cpu", torch_version="2.11.0+cu128")
    assert check_pipeline(zbv, config, 4, False, device_type="cpu", torch_version="2.13.0+cpu") == 2
    assert check_pipeline(zbv, config, 4, False, device_type="cuda", torch_version="2.11.0") == 2
    with pytest.raises(ConfigError, match="vocab_size 16777217 is over 16777216"):
        check_pipeline(ParallelConfig(pp=2), SimpleNamespace(num_hidden_layers=8, vocab_size=2**24 + 1), 4, False)


def test_micro_batch_size_is_the_pipeline_microbatch():
    """Under pp, train.micro_batch_size is sequences per pipeline microbatch: the count follows as
    local batch / micro; parallel.pp_microbatches may say the same, and saying otherwise is an error."""
    from types import SimpleNamespace

    from meshtron.distributed.pipeline_parallel import check_pipeline

    config = SimpleNamespace(num_hidden_layers=8, vocab_size=257, tie_word_embeddings=False)
    assert check_pipeline(ParallelConfig(pp=2), config, 8, 2) == 4
    assert check_pipeline(ParallelConfig(pp=2, pp_microbatches=4), config, 8, 2) == 4  # both, agreeing
    assert check_pipeline(ParallelConfig(pp=2, pp_microbatches=8), config, 8) == 8
    disagree = r"^train.micro_batch_size=2 and parallel.pp_microbatches=2 disagree: .* make 4"
    with pytest.raises(ConfigError, match=disagree):
        check_pipeline(ParallelConfig(pp=2, pp_microbatches=2), config, 8, 2)
    with pytest.raises(ConfigError, match="train.micro_batch_size=3 does not divide the 8 sequences"):
        check_pipeline(ParallelConfig(pp=2), config, 8, 3)
    # The schedules' own constraints, naming the setting the count came from.
    too_few = r"1F1B needs at least parallel.pp=4 microbatches, got 2 \(train.micro_batch_size=4"
    with pytest.raises(ConfigError, match=too_few):
        check_pipeline(ParallelConfig(pp=4), config, 8, 4)
    assert check_pipeline(ParallelConfig(pp=4, pp_schedule="GPipe"), config, 8, 4) == 2
    with pytest.raises(ConfigError, match=r"multiple of parallel.pp=2, got 1 \(train.micro_batch_size=8"):
        check_pipeline(ParallelConfig(pp=2, pp_schedule="InterleavedZeroBubble"), config, 8, 8)


def test_micro_batch_size_under_pp_splits_the_global_batch_before_any_process_group():
    """preflight: each rank steps its global / dp sequences at once (no accumulation) in global / (micro x dp)
    microbatches; micro x dp must divide the global batch; the settings' disagreement is one line naming both."""
    from meshtron.train.setup.preflight import preflight

    def setup(*overrides, world=2):
        cfg = load_config(None, ["model.preset=llama-deep", "train.global_batch_size=8", *overrides], env={})
        return preflight(cfg, world, "cpu")

    got = setup("parallel.pp=2", "train.micro_batch_size=2").batch
    assert (got.rank_batch, got.accumulation_steps, got.pp_microbatches, got.micro_batch_size) == (8, 1, 4, 2)
    got = setup("parallel.pp=2", "parallel.dp_shard=2", "train.micro_batch_size=2", world=4).batch
    assert (got.rank_batch, got.accumulation_steps, got.pp_microbatches, got.micro_batch_size) == (4, 1, 2, 2)
    assert setup("parallel.pp=2", "train.micro_batch_size=4", "parallel.pp_microbatches=2").batch.pp_microbatches == 2
    with pytest.raises(
        ConfigError,
        match="train.global_batch_size 8 is not divisible by data-parallel degree 2 x "
        "train.micro_batch_size 3 = 6; make the global batch a multiple of 6",
    ):
        setup("parallel.pp=2", "parallel.dp_shard=2", "train.micro_batch_size=3", world=4)
    with pytest.raises(ConfigError) as error:
        setup("parallel.pp=2", "train.micro_batch_size=2", "parallel.pp_microbatches=8")
    assert "\n" not in str(error.value) and "train.micro_batch_size=2" in str(error.value)
    assert "parallel.pp_microbatches=8" in str(error.value)


def test_planner_pipeline_layouts_round_trip_through_train_micro_batch_size():
    """A planned pipeline layout is emitted with train.micro_batch_size (its microbatch), not
    parallel.pp_microbatches, and reads back as the same layout."""
    from meshtron.config import ModelConfig
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.report import train_config

    hf_config = make_preset_config("llama-deep", 259)
    workload = Workload(seq_len=256, global_batch=32)
    for layout in (
        Layout(ParallelDims(dp_shard=2, pp=2), micro_batch=2),
        Layout(
            ParallelDims(pp=4),
            micro_batch=4,
            parallel=ParallelOptions(pp_schedule="Interleaved1F1B", pp_stages_per_rank=2),
        ),
    ):
        cfg = train_config(layout, workload, ModelConfig(preset="llama-deep"))
        assert cfg.train.micro_batch_size == layout.micro_batch and cfg.parallel.pp_microbatches is None
        assert Layout.from_config(cfg, layout.dims.world_size, hf_config) == layout


def test_pipeline_x_tensor_parallel_dropout_makes_the_dtensor_rng_tracker_at_start_up_without_a_broadcast(
    tmp_path, cache_dir, monkeypatch
):
    """PP x TP with LoRA dropout (issue 43, finding 1): on CUDA, DTensor makes its RNG tracker at the first random op
    on a DTensor unless one exists, and that tracker broadcasts rank 0's RNG state over the world: stage 0 blocks in
    it before sending its activations while stage 1 waits for them. Here DTensor's CUDA-only RNG path is switched on
    for the CPU (a stand-in tracker that broadcasts as torch's does when asked to sync): rank 0 of a pp=2 x tp=2
    rehearsal makes the tracker once, at start-up, without syncing, and its dropout on DTensors draws through it."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.tensor import _dispatch, _random

    from meshtron.plan.rehearsal import rehearse

    made, drawn, broadcasts = [], [], []

    class Tracker:  # torch's OffsetBasedRNGTracker minus the CUDA generator
        def __init__(self, device_mesh, run_state_sync=True):
            made.append(run_state_sync)
            if run_state_sync:
                dist.broadcast(torch.zeros(16, dtype=torch.uint8), 0)  # what torch's does: the hang under PP
            self.distribute_region_enabled = True

        @contextlib.contextmanager
        def _distribute_region(self, spec, generator=None):
            drawn.append(spec.mesh.mesh_dim_names)
            yield

        def _manual_seed(self, seed):  # torch < 2.10 keeps the tracker's own state
            pass

    broadcast = dist.broadcast

    def counting_broadcast(*args, **kwargs):
        broadcasts.append(len(drawn))
        return broadcast(*args, **kwargs)

    monkeypatch.setattr(_random, "_rng_tracker", None)
    monkeypatch.setattr(_random, "OffsetBasedRNGTracker", Tracker)
    monkeypatch.setattr(_random, "is_rng_supported_mesh", lambda mesh: True)
    monkeypatch.setattr(_dispatch, "is_rng_supported_mesh", lambda mesh: True)
    monkeypatch.setattr(dist, "broadcast", counting_broadcast)
    cfg = load_config(
        None,
        [
            "model.preset=llama-tiny",
            "parallel.pp=2",
            "parallel.tp=2",
            "lora.rank=4",
            "lora.dropout=0.5",
            "data.seq_len=32",
            "data.max_documents=40",
            f"data.cache_dir={cache_dir}",
            "train.global_batch_size=4",
            f"run.output_dir={tmp_path / 'run'}",
            "run.device=cpu",
            "run.progress=false",
        ],
        env={},
    )
    rehearse(cfg, world_size=4, rank=0, steps=2)
    assert made == [False], "the tracker is made once, at start-up, with no state sync"
    assert drawn, "the adapters' dropout drew through the tracker"
    assert not broadcasts


def test_rank_seeds_are_shared_by_a_tensor_parallel_group_and_distinct_elsewhere():
    """Dropout seeds (meshtron.distributed.rng): the ranks of one tp group share a seed (the same masks for
    replicated activations), every other coordinate (pp, dp_replicate, dp_shard, cp) has its own, and a single
    process or a tp-only layout keeps train.seed."""
    import itertools

    from meshtron.distributed.mesh import MESH_DIMS
    from meshtron.distributed.rng import rank_seed

    assert MESH_DIMS[-1] == "tp"
    shape = (2, 2, 2, 2, 2)
    groups: dict[tuple, set] = {}
    for coordinate in itertools.product(*(range(size) for size in shape)):
        groups.setdefault(coordinate[:-1], set()).add(rank_seed(7, list(coordinate), shape))
    assert all(len(seeds) == 1 for seeds in groups.values())
    assert len(set().union(*groups.values())) == len(groups) == 16
    assert rank_seed(7, [0, 0, 0, 0, 1], (1, 1, 1, 1, 2)) == rank_seed(7, [0] * 5, (1,) * 5) == 7


def test_a_zero_bubble_weight_pass_finds_its_custom_function_nodes_held(tmp_path, cache_dir, monkeypatch):
    """Rank 0 of a ZBV pipeline (stages 0 and 3) with the fused loss and tiled MLPs, whose custom autograd Function
    nodes are where weight passes start. The input pass detaches the stage outputs; on torch 2.11 a custom Function's
    node is then owned only by the nodes above it (its Python object refers to it weakly), and the weight pass met
    it freed ("'_input_metadata' is invalid for this instance of _C._FunctionBase", found on an H200). So at each
    weight pass every custom Function node of the micro-batch's parameter groups must lie below a built-in node that
    the groups hold (torch 2.13 keeps it alive regardless, so this checks the ownership, not the crash)."""
    from torch.autograd.function import BackwardCFunction
    from torch.distributed.pipelining import stage as pipelining_stage

    from meshtron.plan.rehearsal import rehearse

    checked = []
    weight_pass = pipelining_stage.stage_backward_weight

    def checking_weight_pass(weights, param_groups, *args, **kwargs):
        held = [n for g in param_groups for value in g.values() if isinstance(value, (list, tuple, set)) for n in value]
        roots = [n for n in held if isinstance(n, torch.autograd.graph.Node) and not isinstance(n, BackwardCFunction)]
        below, queue = set(), list(roots)
        while queue:
            for child, _ in queue.pop().next_functions:
                if child is not None and id(child) not in below:
                    below.add(id(child))
                    queue.append(child)
        custom = [n for g in param_groups for n in g["intermediates"] if isinstance(n, BackwardCFunction)]
        checked.extend(type(n).__name__ for n in custom)
        assert all(id(n) in below for n in custom), f"not held through the weight pass: {custom}"
        return weight_pass(weights, param_groups, *args, **kwargs)

    monkeypatch.setattr(pipelining_stage, "stage_backward_weight", checking_weight_pass)
    settings = ["model.preset=llama-deep", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "train.mlp_tiles=2"]
    settings += ["data.seq_len=32", "data.max_documents=40", f"data.cache_dir={cache_dir}", "train.global_batch_size=4"]
    settings += [
        "train.micro_batch_size=1",
        f"run.output_dir={tmp_path / 'run'}",
        "run.device=cpu",
        "run.progress=false",
    ]
    rehearse(load_config(None, settings, env={}), world_size=2, rank=0, steps=2)
    assert {"_FusedLinearCrossEntropyBackward", "_TiledMLPFunctionBackward"} <= set(checked), checked
