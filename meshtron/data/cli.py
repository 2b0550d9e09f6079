"""``meshtron data prepare``: tokenize a corpus into a prepared directory (meshtron.data.prepare)."""

from __future__ import annotations

import math
import resource
from pathlib import Path

from meshtron.errors import ConfigError

DATA_USAGE = (
    "meshtron data prepare [--config FILE] --data.path=SOURCE [--data.tokenizer=TOK | --model.name_or_path=DIR] "
    "--out DIR "
    "[--workers N] [--shard-mb M] [--part I/N]"
)


def add_data_parser(sub) -> None:
    data = sub.add_parser("data", help="prepare training data", usage=DATA_USAGE)
    actions = data.add_subparsers(dest="data_command", required=True, prog="meshtron data")
    prepare = actions.add_parser("prepare", help="tokenize a corpus into sharded token files", usage=DATA_USAGE)
    prepare.add_argument("--config", help="TOML config file (its [data] section, and [model] for data.tokenizer=auto)")
    prepare.add_argument("--out", required=True, help="the prepared directory (new, or an unfinished prepare's)")
    prepare.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    prepare.add_argument(
        "--shard-mb",
        type=float,
        default=64.0,
        help="millions of characters of text per shard (default 64); sets the memory bound",
    )
    prepare.add_argument(
        "--part",
        default="0/1",
        help="I/N: this machine writes shards k with k %% N == I into a shared --out (default 0/1)",
    )


def _part(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--part must look like I/N (e.g. 0/4), got {text!r}") from None
    return index, count


def _own_peak_mb() -> float:
    """This process's peak resident memory. /proc's VmHWM starts again at exec; ``ru_maxrss`` would also count
    the parent's memory at the fork that started this process."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_data(args, extra: list[str]) -> int:
    from meshtron.config import load_config, parse_overrides
    from meshtron.data.hub import model_folder
    from meshtron.data.prepare import prepare_corpus
    from meshtron.data.shards import is_prepared
    from meshtron.data.sources import check_data_path
    from meshtron.data.tokenizer import check_byte_fallback, load_tokenizer, tokenizer_notice

    overrides = parse_overrides(extra, DATA_USAGE)
    if any(
        not item.startswith(("data.", "model.trust_remote_code", "model.name_or_path", "model.revision"))
        for item in overrides
    ):
        raise ConfigError(
            "data prepare takes data.* settings (and model.name_or_path, model.revision, model.trust_remote_code) "
            f"only, got {overrides}; usage: {DATA_USAGE}"
        )
    if not (math.isfinite(args.shard_mb) and args.shard_mb > 0):
        raise ConfigError(f"--shard-mb must be positive, got {args.shard_mb}")
    cfg = load_config(args.config, overrides, env={})
    if is_prepared(cfg.data.path):
        raise ConfigError(
            f"data.path '{cfg.data.path}' is already prepared; train on it with --data.path={cfg.data.path}"
        )
    check_data_path(cfg.data.path)
    # data.tokenizer=auto: model.name_or_path's tokenizer, when that folder has one, as training resolves it.
    model_dir = model_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.trust_remote_code, model_dir)
    check_byte_fallback(cfg.data.tokenizer, model_dir)
    notice = tokenizer_notice(cfg.data.tokenizer, model_dir)
    if notice:
        print(notice, flush=True)
    manifest = prepare_corpus(
        cfg.data,
        args.out,
        tokenizer=tokenizer,
        workers=args.workers,
        shard_chars=int(args.shard_mb * 1e6),
        part=_part(args.part),
        trust_remote_code=cfg.model.trust_remote_code,
        log=lambda line: print(line, flush=True),
    )
    own_mb = _own_peak_mb()
    worker_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # workers started from this process
    if manifest is not None:
        print(
            f"meshtron: {args.out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
            f"({manifest['dtype']}) in {len(manifest['shards'])} shard(s); train with --data.path={args.out} "
            f"--data.tokenizer={tokenizer.name}",
            flush=True,
        )
    print(
        f"meshtron: peak memory {own_mb:.0f} MB in this process, {worker_mb:.0f} MB in the largest worker", flush=True
    )
    return 0
