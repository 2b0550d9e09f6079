"""The layouts ``meshtron check`` runs on N processes, and the one-process runs each is compared with.

Every layout uses all N ranks: its own degrees (tensor, context, pipeline, expert parallel, replicas), the rest of
N as FSDP (``parallel.dp_shard``). The degrees respect the tiny models: 4 query heads and 2 KV heads (tp and
Ulysses' cp x tp divide 4), 32 tokens (ring cp up to 8: 2 x cp chunks), 2 layers (``llama-tiny``) or 8
(``llama-deep``, for pp > 2), 4 experts (ep divides 4). Names follow the parity suite's: ``ddp2``, ``fsdp2``,
``hsdp2x2``, ``tp2``, ``cp2_ring``, ``cp2_ulysses``, ``pp2``, ``ep2``, and joined for combinations
(``pp2_fsdp2_tp2``). One more row trains a preference objective: ``dpo_`` and its layout (DPO with a live reference
model, a frozen copy laid out like the policy, on the check's own pairs: ``write_pairs``), and one distillation:
``distill_`` and its layout (a frozen ``DISTILL_TEACHER`` of another shape teaching ``llama-tiny`` on the corpus).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from meshtron.distributed.mesh import ParallelDims

DENSE = "llama-tiny"
DEEP = "llama-deep"  # 8 layers: pipelines of more than 2 stages
MOE = "qwen3moe-tiny"  # 4 experts, top-2, a sparse block in both layers
LAYERS = {DENSE: 2, DEEP: 8, MOE: 2}
HEADS = 4
EXPERTS = 4
SEQ_LEN = 32
MAX_RING_CP = 8
BATCH = 8
"""Sequences per step (a multiple of N when N does not divide it, so that every data-parallel degree does)."""
DEFAULT_STEPS = 3


@dataclass(frozen=True)
class Run:
    """One training run: ``world`` processes of ``model`` with ``overrides`` on ``device``."""

    key: str
    world: int
    model: str
    device: str
    overrides: tuple[str, ...] = ()
    pairs: bool = False
    """Trains DPO on the check's preference pairs (``write_pairs``, in the run's folder) instead of the corpus."""


@dataclass(frozen=True)
class CheckCase:
    """One case of ``meshtron check``, a row of its table: ``run`` compared with ``reference`` (a one-process run)."""

    name: str
    run: Run
    reference: Run
    what: str = ""
    """What a difference means, for the final line (e.g. the device's kernels)."""


OVERRIDDEN_DEGREES = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
"""The degrees each run sets on its command line, in this order."""


@dataclass(frozen=True)
class Degrees:
    """A layout of the catalogue: its degrees, its context-parallel method and whether it runs the MoE model."""

    dims: ParallelDims = ParallelDims()
    cp_method: str = "ring"
    moe: bool = False

    @property
    def model(self) -> str:
        if self.moe:
            return MOE
        return DEEP if self.dims.pp > LAYERS[DENSE] else DENSE

    def name(self) -> str:
        d = self.dims
        parts = []
        if d.ep > 1:
            parts.append(f"ep{d.ep}")
        if d.pp > 1:
            parts.append(f"pp{d.pp}")
        if d.dp_replicate > 1 and d.dp_shard > 1:
            parts.append(f"hsdp{d.dp_replicate}x{d.dp_shard}")
        elif d.dp_replicate > 1:
            parts.append(f"ddp{d.dp_replicate}")
        elif d.dp_shard > 1 and not (d.ep > 1 and d.dp_shard * d.cp == d.ep):
            parts.append(f"fsdp{d.dp_shard}")
        if d.cp > 1:
            parts.append(f"cp{d.cp}")
        if d.tp > 1:
            parts.append(f"tp{d.tp}")
        name = "_".join(parts) or "fsdp1"
        if d.cp > 1:
            name += f"_{self.cp_method}"
        return name

    def overrides(self) -> tuple[str, ...]:
        settings = [f"parallel.{name}={getattr(self.dims, name)}" for name in OVERRIDDEN_DEGREES]
        if self.dims.cp > 1:
            settings.append(f"parallel.cp_method={self.cp_method}")
        return tuple(settings)

    def valid(self) -> bool:
        d = self.dims
        heads_per_rank = HEADS // d.tp if HEADS % d.tp == 0 else 0
        return (
            heads_per_rank > 0
            and (self.cp_method != "ulysses" or heads_per_rank % d.cp == 0)
            and (self.cp_method != "ring" or (d.cp <= MAX_RING_CP and SEQ_LEN % (2 * d.cp) == 0))
            and LAYERS[self.model] % d.pp == 0
            and EXPERTS % d.ep == 0
            and (d.dp_shard * d.cp) % d.ep == 0
        )


def _largest(n: int, limit: int, *, powers_of_two: bool = False) -> int:
    """The largest divisor of ``n`` that divides ``limit`` (or, with ``powers_of_two``, that is a power of two up to
    ``limit``)."""
    candidates = [d for d in range(1, limit + 1) if limit % d == 0 or (powers_of_two and d & (d - 1) == 0)]
    return max(d for d in candidates if n % d == 0)


def _filled(n: int, *, cp_method: str = "ring", moe: bool = False, **core) -> Degrees | None:
    """``core``'s degrees with the rest of ``n`` as FSDP; None when ``n`` cannot host them."""
    used = core.get("dp_replicate", 1) * core.get("tp", 1) * core.get("cp", 1) * core.get("pp", 1)
    if any(core.get(key, 1) < 1 for key in ("tp", "cp", "pp", "ep", "dp_replicate")) or n % used:
        return None
    degrees = Degrees(ParallelDims(dp_shard=n // used, **core), cp_method, moe)
    return degrees if degrees.valid() else None


def candidate_degrees(n: int) -> list[Degrees]:
    """Every layout of the catalogue ``n`` ranks can host, each once (by name), in the table's order."""
    tp, ulysses = _largest(n, HEADS), _largest(n, HEADS)
    ring = _largest(n, MAX_RING_CP, powers_of_two=True)
    pp, ep = _largest(n, LAYERS[DEEP]), _largest(n, EXPERTS)
    catalogue = [
        Degrees(ParallelDims(dp_replicate=n)),  # DDP
        _filled(n),  # FSDP over all ranks
        _filled(n, dp_replicate=2) if n >= 4 else None,  # HSDP
        _filled(n, tp=tp),
        _filled(n, cp=ring, cp_method="ring"),
        _filled(n, cp=ulysses, cp_method="ulysses"),
        _filled(n, pp=pp),
        _filled(n, ep=ep, moe=True),
        # 2-D
        _filled(n, tp=2),
        _filled(n, tp=2, cp=2, cp_method="ring"),
        _filled(n, tp=2, cp=2, cp_method="ulysses"),
        _filled(n, pp=2, tp=2),
        _filled(n, pp=2),
        _filled(n, ep=2, tp=2, moe=True),
        _filled(n, ep=2, pp=2, moe=True),
        # 3-D and 4-D
        _filled(n, dp_replicate=2, tp=2),
        _filled(n, pp=2, cp=2, tp=2),
        _filled(n, dp_replicate=2, pp=2, tp=2),
        _filled(n, dp_replicate=2, pp=2, cp=2, tp=2),
        _filled(n, ep=2, pp=2, tp=2, moe=True),
    ]
    chosen: dict[str, Degrees] = {}
    for degrees in catalogue:
        if degrees is not None and degrees.valid():
            chosen.setdefault(degrees.name(), degrees)
    return list(chosen.values())


PAIRS = 64
"""Preference pairs the DPO row trains on (``data.max_documents`` of the base settings takes the first of them)."""

DPO_OVERRIDES = ("train.objective=dpo", "data.format=preference", "preference.reference=model")
"""The DPO row's settings besides its layout and ``data.path``: DPO with a frozen copy as the reference model."""


def write_pairs(path: Path) -> Path:
    """The DPO row's pairs at ``path`` (JSON lines; the same on every call): a prompt of letters, the chosen answer
    them sorted, the rejected one reversed, short enough for ``SEQ_LEN`` byte tokens per pair."""
    rng = random.Random(0)
    with open(path, "w") as handle:
        for _ in range(PAIRS):
            letters = rng.sample("abcdefghij", 4)
            record = {"prompt": "".join(letters) + ":", "chosen": "".join(sorted(letters))}
            record["rejected"] = record["chosen"][::-1]
            handle.write(json.dumps(record) + "\n")
    return path


def dpo_degrees(n: int) -> Degrees | None:
    """The DPO row's layout on ``n`` ranks: tensor parallelism over 2 under FSDP over the rest where ``n`` hosts it,
    else FSDP over all; None for one rank."""
    if n == 1:
        return None
    return _filled(n, tp=2) or _filled(n)


DISTILL_TEACHER = "llama-small"
"""The distillation row's teacher: 4 layers, hidden 192, 6 query and 2 KV heads (tp 2 and pp 2 divide it as they
divide the student), so that the teacher's own shards, pipeline split and head differ from the student's."""

DISTILL_OVERRIDES = (
    "train.objective=distill",
    f"distill.teacher={DISTILL_TEACHER}",
    "distill.alpha=0.3",
    "distill.divergence=jsd",
    "distill.temperature=2.0",
)
"""The distillation row's settings besides its layout: the cross-entropy and the divergence both weighted."""


def distill_degrees(n: int) -> Degrees | None:
    """The distillation row's layout on ``n`` ranks: pipeline 2 x FSDP x tensor 2 where ``n`` hosts FSDP over 2 or
    more beside them (the teacher a forward-only pipeline of its own split), else tensor 2 x FSDP over the rest, else
    FSDP over all; None for one rank."""
    if n == 1:
        return None
    return (_filled(n, pp=2, tp=2) if n % 8 == 0 else None) or _filled(n, tp=2) or _filled(n)


def batch_size(n: int) -> int:
    return math.lcm(BATCH, n)


def layouts_for(n: int, device: str) -> list[CheckCase]:
    """The rows of ``meshtron check --nproc n`` on ``device`` (cpu or cuda).

    One process: on a GPU, that GPU's run against the CPU's (the device's kernels); on CPU, a second process against
    the first (determinism). Several: every layout of ``candidate_degrees`` against one process on the same device,
    and on GPUs also one GPU against the CPU."""
    references = {model: Run(f"1proc-{model}-{device}", 1, model, device) for model in (DENSE, DEEP, MOE)}
    on_cpu = Run(f"1proc-{DENSE}-cpu", 1, DENSE, "cpu")
    device_row = (
        CheckCase("1gpu_vs_cpu", Run("1gpu", 1, DENSE, "cuda"), on_cpu, "this GPU's kernels differ from the CPU's")
        if device == "cuda"
        else CheckCase("1proc", Run("1proc-again", 1, DENSE, "cpu"), on_cpu, "one process differs from run to run")
    )
    rows = [device_row] if n == 1 or device == "cuda" else []
    if n > 1:
        for degrees in candidate_degrees(n):
            run = Run(degrees.name(), n, degrees.model, device, degrees.overrides())
            rows.append(CheckCase(degrees.name(), run, references[degrees.model]))
        rows += [dpo_row(n, device), distill_row(n, device)]
    return rows


def dpo_row(n: int, device: str) -> CheckCase:
    """DPO with a live reference under ``dpo_degrees(n)`` against one process training the same."""
    degrees = dpo_degrees(n)
    name = f"dpo_{degrees.name()}"
    run = Run(name, n, DENSE, device, degrees.overrides() + DPO_OVERRIDES, pairs=True)
    reference = Run(f"1proc-dpo-{DENSE}-{device}", 1, DENSE, device, DPO_OVERRIDES, pairs=True)
    return CheckCase(name, run, reference, "the preference loss or the reference model differs")


def distill_row(n: int, device: str) -> CheckCase:
    """Distillation from a frozen ``DISTILL_TEACHER`` under ``distill_degrees(n)`` against one process training the
    same."""
    degrees = distill_degrees(n)
    name = f"distill_{degrees.name()}"
    run = Run(name, n, DENSE, device, degrees.overrides() + DISTILL_OVERRIDES)
    reference = Run(f"1proc-distill-{DENSE}-{device}", 1, DENSE, device, DISTILL_OVERRIDES)
    return CheckCase(name, run, reference, "the distillation loss or the teacher differs")


def base_overrides(n: int, steps: int, cache_dir: str) -> list[str]:
    """The settings every run shares: the built-in corpus (byte tokens), fp32 without compile, ``steps`` steps."""
    return [
        "data.tokenizer=byte",
        f"data.seq_len={SEQ_LEN}",
        "data.max_documents=40",
        f"data.cache_dir={cache_dir}",
        f"train.steps={steps}",
        f"train.global_batch_size={batch_size(n)}",
        "optimizer.lr=1e-3",
        "schedule.warmup_steps=1",
        "train.seed=7",
        "precision.mixed_precision=none",
        "train.compile=false",
        "model.dtype=float32",
        "run.progress=false",
        "run.log_every=1000",
    ]
