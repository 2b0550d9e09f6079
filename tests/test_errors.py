"""Every bad input gives one clear line naming the setting, a non-zero exit, and no hang."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import run_cli, run_torchrun

from meshtron.cli import main

FAST = ["--model.preset=tiny", "--data.max_documents=5", "--data.seq_len=16", "--train.steps=1", "--run.progress=false"]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("meshtron: error")]


def run_main(capsys, args: list[str]) -> tuple[int, str]:
    code = main(["train", *args])
    err = capsys.readouterr().err
    return code, err


@pytest.fixture
def causal_lm_dir(tmp_path):
    path = tmp_path / "bert"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    return path


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nproc", "3", "--parallel.dp_shard=2"], "world size 3 != product of the parallel degrees"),
        (["--nproc", "2", "--train.global_batch_size=3"], "train.global_batch_size 3 is not divisible"),
        (["--nproc", "2", "--train.global_batch_size=8", "--train.micro_batch_size=3"], "train.micro_batch_size 3"),
        (["--train.stepz=3"], "unknown config key 'train.stepz'; did you mean train.steps?"),
        (["--train.steps=three"], "train.steps: expected int, got 'three'"),
        (
            ["--model.name_or_path=/no/such/model", "--model.preset=none"],
            "model.name_or_path: '/no/such/model' is not an existing directory",
        ),
        (["--data.path=/no/such/file.txt"], "data.path"),
        (["--data.seq_len=100000"], "data.seq_len 100000 is larger than the model's max_position_embeddings"),
        (["--parallel.dp_shard=2"], "need 2 processes but meshtron was started as 1; add --nproc 2"),
        (["--data.tokenizer=/no/such/tokenizer"], "data.tokenizer"),
        (["--parallel.pp=4", "--nproc", "4"], "the model has 2 layers, fewer than the 4 pipeline stages"),
        (
            ["--parallel.pp=2", "--nproc", "2", "--parallel.pp_microbatches=3"],
            "parallel.pp_microbatches=3 does not divide the 8 sequences",
        ),
        (
            ["--parallel.pp_schedule=Foo"],
            "parallel.pp_schedule: 'Foo' is not one of GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, "
            "ZBVZeroBubble",
        ),
        (
            ["--parallel.pp=2", "--nproc", "2", "--train.micro_batch_size=2", "--parallel.pp_microbatches=2"],
            "train.micro_batch_size=2 and parallel.pp_microbatches=2 disagree",
        ),
        (
            ["--parallel.pp=2", "--nproc", "2", "--parallel.pp_stage_layers=1,2"],
            "parallel.pp_stage_layers '1,2' must give 2 non-negative layer counts",
        ),
        (
            ["--parallel.pp=2", "--nproc", "2", "--parallel.pp_schedule=GPipe", "--parallel.pp_stages_per_rank=2"],
            "parallel.pp_schedule=GPipe runs one stage per rank",
        ),
        (
            ["--parallel.cp=2", "--nproc", "2", "--data.seq_len=30"],
            "data.seq_len 30 is not divisible by 2 x parallel.cp = 4",
        ),
        (
            ["--parallel.cp=2", "--nproc", "2", "--model.attn_implementation=eager"],
            "model.attn_implementation=eager cannot be combined with parallel.cp > 1",
        ),
        (["--model.attn_implementation=eager"], "or set data.mask_documents=false"),
        (["--parallel.cp_method=flash"], "parallel.cp_method: 'flash' is not one of ring, allgather, ulysses, hybrid"),
        (
            ["--model.preset=llama-small", "--parallel.cp=4", "--parallel.cp_method=ulysses", "--nproc", "4"],
            "parallel.cp_method=ulysses splits attention heads over parallel.cp=4, but this rank's 6 query heads",
        ),
        (
            ["--parallel.cp=4", "--parallel.cp_method=hybrid", "--nproc", "4"],
            "parallel.cp_method=hybrid needs parallel.cp_ulysses (the Ulysses degree inside each group of consecutive "
            "cp ranks), got 0; set it to a divisor of parallel.cp=4",
        ),
        (
            ["--parallel.cp=4", "--parallel.cp_method=hybrid", "--parallel.cp_ulysses=3", "--nproc", "4"],
            "parallel.cp_ulysses=3 does not divide parallel.cp=4",
        ),
        (
            ["--parallel.cp=4", "--parallel.cp_ulysses=2", "--nproc", "4"],
            "parallel.cp_ulysses=2 is only used by parallel.cp_method=hybrid, not ring",
        ),
        (
            ["--model.preset=llama-small", "--parallel.cp=4", "--parallel.cp_method=hybrid", "--parallel.cp_ulysses=4"]
            + ["--nproc", "4"],
            "parallel.cp_method=hybrid splits attention heads over parallel.cp_ulysses=4, but this rank's 6 query",
        ),
        (
            ["--model.preset=llama-small", "--parallel.cp=6", "--parallel.cp_method=hybrid", "--parallel.cp_ulysses=3"]
            + ["--data.seq_len=24", "--nproc", "6"],
            "parallel.cp_method=hybrid needs key/value heads (2 per tp rank) divisible by parallel.cp_ulysses=3 or "
            "dividing it",
        ),
        (
            ["--data.seq_len=36", "--parallel.cp=2", "--parallel.tp=4", "--nproc", "8"],
            "data.seq_len 36 / parallel.cp=2 = 18 is not divisible by parallel.tp=4",
        ),
        (["--parallel.tp=3", "--nproc", "3"], "parallel.tp=3 does not divide the model's 4 attention heads"),
        (
            ["--model.preset=llama-small", "--parallel.tp=3", "--nproc", "3"],
            "parallel.tp=3 and the model's 2 KV heads: one must divide the other",
        ),
        (["--data.seq_len=18", "--parallel.tp=4", "--nproc", "4"], "data.seq_len 18 is not divisible by parallel.tp=4"),
        (["--run.collective_timeout_s=0"], "run.collective_timeout_s: must be > 0 seconds, got 0.0"),
        (["--schedule.kind=step"], "schedule.kind: 'step' is not one of cosine, linear, constant, wsd"),
        (["--schedule.decay_shape=exp"], "schedule.decay_shape: 'exp' is not one of linear, cosine, 1-sqrt"),
        (
            ["--schedule.kind=wsd", "--schedule.decay_fraction=0"],
            "schedule.decay_fraction: must be in (0, 1] (the share of train.steps that WSD spends decaying), got 0.0",
        ),
        (
            ["--eval.path=x.txt", "--eval.holdout_documents=2"],
            "set only one of eval.path and eval.holdout_documents",
        ),
        (["--eval.interval=5"], "eval.interval=5 needs evaluation data: set eval.path or eval.holdout_documents"),
        (["--eval.batches=0"], "eval.batches: must be a positive integer, got 0"),
        (
            ["--eval.holdout_documents=1", "--data.streaming=true"],
            "eval.holdout_documents holds out documents of one data.path, not of data.streaming",
        ),
        (["--eval.holdout_documents=5"], "eval.holdout_documents=5 leaves nothing to train on: data.path"),
        (
            ["--eval.path=/no/such/file.jsonl"],  # said as data.path says it, not as a hub dataset that did not load
            "eval.path: '/no/such/file.jsonl' does not exist (nor is it a hub dataset name like org/name); set "
            "eval.path to an existing text file",
        ),
        (["--optimizer.name=sgd"], "optimizer.name: 'sgd' is not one of adamw, muon"),
        (
            ["--optimizer.name=muon", "--optimizer.muon.momentum=1"],
            "optimizer.muon.momentum: must be in [0, 1), got 1.0",
        ),
        (["--train.batch_rampup=abc"], "train.batch_rampup: 'abc' is not START:STEPS"),
        (["--train.batch_rampup=3:10"], "START 3 must be smaller than train.global_batch_size 8 and divide it"),
        (
            ["--train.batch_rampup=2:4", "--parallel.pp=2", "--nproc", "2"],
            "train.batch_rampup with parallel.pp > 1 is not supported",
        ),
        (
            ["--train.batch_rampup=2:4", "--nproc", "4", "--parallel.dp_shard=4"],
            "train.batch_rampup: START 2 is not divisible by data-parallel degree 4",
        ),
        (["--train.batch_rampup=2:4", "--data.streaming=true"], "train.batch_rampup needs indexed data"),
        (["--rehearse"], "--rehearse needs --nproc N"),
        (
            ["--rehearse", "--nproc", "2", "--rank", "2", "--parallel.dp_shard=2"],
            "--rank 2 is not a rank of a world of 2",
        ),
        (
            ["--rehearse", "--nproc", "2", "--rehearse-steps", "1", "--parallel.dp_shard=2"],
            "--rehearse-steps must be at least 2",
        ),
        (["--rehearse", "--nproc", "3", "--parallel.dp_shard=2"], "world size 3 != product of the parallel degrees"),
        (["--nproc", "2", "--rank", "1", "--parallel.dp_shard=2"], "--rank and --rehearse-steps go with --rehearse"),
        (["--rehearse", "--dry-run", "--nproc", "2", "--parallel.dp_shard=2"], "give one of them"),
    ],
)
def test_error_is_one_clear_line(capsys, args, expected):
    code, err = run_main(capsys, [*FAST, *args])
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]


def test_not_a_causal_lm(capsys, causal_lm_dir):
    code, err = run_main(capsys, [*FAST, "--model.preset=none", f"--model.name_or_path={causal_lm_dir}"])
    assert code != 0 and "is not a decoder-only causal language model" in error_lines(err)[0]


def test_empty_dataset(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = run_main(capsys, [*FAST, f"--data.path={empty}"])
    assert code != 0 and "data.path" in error_lines(err)[0]


def test_evaluation_data_smaller_than_a_global_batch(capsys, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("a few words, not eight sequences of sixteen tokens\n")
    code, err = run_main(capsys, [*FAST, f"--eval.path={small}", f"--data.cache_dir={tmp_path}"])
    assert code != 0 and "fewer than one global batch (train.global_batch_size=8)" in error_lines(err)[0]


@pytest.mark.parametrize("setting", ["data.path", "eval.path"])
@pytest.mark.parametrize("name", ["weights.bin", "rows.jsonl"])
def test_a_binary_data_file_is_one_line(capsys, tmp_path, setting, name):
    """A file that is not text (as a text document, or as JSON lines), given as data.path or eval.path: one line
    naming the setting and the file, instead of a UnicodeDecodeError (or, for text, training on its bytes)."""
    binary = tmp_path / name
    binary.write_bytes(bytes(range(256)) * 64)  # NUL bytes, and bytes that are not UTF-8
    code, err = run_main(capsys, [*FAST, f"--{setting}={binary}", f"--data.cache_dir={tmp_path / 'cache'}"])
    lines = error_lines(err)
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{setting}: {binary} is not UTF-8 text (a binary file?); point {setting} at" in lines[0], lines[0]


def test_a_source_whose_extra_is_not_installed_is_one_line(capsys, tmp_path, monkeypatch):
    """datasets (and pyarrow) come with `pip install 'meshtron[data]'`: a saved dataset without them is one line
    naming that extra, exit 2, no traceback."""
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    code, err = run_main(capsys, [*FAST, f"--data.path={saved}", f"--data.cache_dir={tmp_path / 'cache'}"])
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "data.path: a saved dataset" in lines[0] and "pip install 'meshtron[data]'" in lines[0], lines[0]


def test_generate_on_a_peft_adapter_without_peft_names_the_extra(tmp_path, monkeypatch):
    from meshtron.checkpoint.generate import _merge_peft_adapter
    from meshtron.errors import ConfigError

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"meshtron generate: the peft adapter .* pip install 'meshtron\[peft\]'"):
        _merge_peft_adapter(tmp_path / "adapter", tmp_path / "base", tmp_path / "out", trust_remote_code=False)


def test_text_with_a_few_bytes_that_are_not_utf8_still_trains(tmp_path):
    """The binary check leaves text alone: a Latin-1 file (a few bytes that are not UTF-8) reads as before."""
    from meshtron.data.sources import iter_documents

    latin = tmp_path / "latin.txt"
    latin.write_bytes("Caf\u00e9 cr\u00e8me, na\u00efve fa\u00e7ade: some words of text\n".encode("latin-1") * 20)
    (document,) = iter_documents(str(latin))
    assert document.count("\ufffd") == 4 * 20 and document.startswith("Caf\ufffd cr\ufffdme")


def test_output_dir_with_a_run_is_not_overwritten(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text("precious\n")
    code, err = run_main(capsys, [*FAST, f"--run.output_dir={tmp_path}"])
    assert code != 0 and "already holds a run" in error_lines(err)[0]
    assert (tmp_path / "metrics.jsonl").read_text() == "precious\n"


@pytest.mark.parametrize(
    "flag, expected",
    [
        (["--nproc", "2"], "--nproc cannot be used under torchrun"),
        (["--max-restarts", "1"], "--max-restarts is for --nproc"),
        (["--rank-start", "fresh"], "--rank-start is for --nproc"),
    ],
)
def test_launcher_options_under_torchrun_are_refused(capsys, monkeypatch, flag, expected):
    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)
    code, err = run_main(capsys, [*FAST, *flag])
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and expected in lines[0], err


def test_checkpoints_under_torchrun_need_a_fixed_directory(capsys, monkeypatch, tmp_path, cache_dir):
    """Under torchrun a restart runs the same command: without run.output_dir or checkpoint.dir it would write to
    a new runs/<timestamp> each time and never resume, so saving checkpoints there is refused before any work."""
    from meshtron.config import load_config
    from meshtron.train.setup.preflight import preflight

    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(capsys, [*FAST, f"--data.cache_dir={cache_dir}", "--checkpoint.interval=10"])
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert "checkpoint.interval > 0 under torchrun" in lines[0] and "set run.output_dir (or checkpoint.dir)" in lines[0]
    assert not (tmp_path / "runs").exists()
    for fixed in (f"run.output_dir={tmp_path / 'a'}", f"checkpoint.dir={tmp_path / 'b'}", "checkpoint.interval=0"):
        cfg = load_config(None, [o[2:] for o in FAST] + ["checkpoint.interval=10", fixed], env={})
        preflight(cfg, 1, "cpu")  # accepted


@pytest.mark.slow
def test_torchrun_world_size_mismatch_fails_on_every_rank_without_hang():
    proc = run_torchrun(
        2, ["-m", "meshtron", "train", *FAST, "--parallel.dp_replicate=2", "--parallel.dp_shard=2"], timeout=120
    )
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "world size 2 != product of the parallel degrees" in lines[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_self_launch_reports_worker_error_once(tmp_path):
    """A data error found inside the workers (after the launcher's checks pass) still ends cleanly: its one line
    only, without torch's lines about the failed worker and stopping the other."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    proc = run_cli(
        [
            "train",
            "--nproc",
            "2",
            *FAST,
            f"--data.path={tiny}",
            "--data.seq_len=64",
            f"--data.cache_dir={tmp_path / 'cache'}",
            f"--run.output_dir={tmp_path / 'run'}",
        ],
        timeout=180,
    )
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "data.seq_len" in lines[0], proc.stderr[-3000:]
    assert proc.stderr.splitlines() == lines, proc.stderr[-3000:]  # torch's report of the failure is left out


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"intermediate_size": 162}, "does not divide the model's intermediate_size 162"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 16},
            "does not divide the model's 6 attention heads",
        ),
    ],
)
def test_tensor_parallel_divisibility(changes, expected):
    from types import SimpleNamespace

    from meshtron.distributed.tensor_parallel import check_tensor_parallel
    from meshtron.errors import ConfigError
    from meshtron.models.adapter import adapter_for

    good = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=160,
        vocab_size=320,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    adapter = adapter_for(SimpleNamespace(**good))
    check_tensor_parallel(SimpleNamespace(**good), adapter, 4, 32, True)  # the unchanged config passes
    bad = SimpleNamespace(**{**good, **changes})
    with pytest.raises(ConfigError, match=expected):
        check_tensor_parallel(bad, adapter, 4, 32, True)
    check_tensor_parallel(bad, adapter, 1, 32, True)  # tp=1 never complains


def test_checkpoint_of_another_model_or_batch_or_missing(capsys, tmp_path, cache_dir):
    """Resuming refuses, before any work, a missing checkpoint, another model, or another sequence length of a
    mixture."""
    common = [*FAST, f"--data.cache_dir={cache_dir}"]
    code, err = run_main(capsys, [*common, "--checkpoint.interval=1", f"--run.output_dir={tmp_path / 'a'}"])
    assert code == 0, err
    saved = tmp_path / "a" / "checkpoints" / "step-00000001"
    cases = [
        (["--checkpoint.resume=/no/such/checkpoint"], "checkpoint '/no/such/checkpoint' is missing or incomplete"),
        (
            [f"--checkpoint.resume={saved}", "--model.preset=llama-deep"],
            "is of another model: num_hidden_layers 2 (checkpoint) vs 8 (this run)",
        ),
        (  # another global batch or sequence length resumes (docs/data.md), but not another length of a mixture
            [f"--checkpoint.resume={saved}", "--data.seq_len=8", "--data.sources=builtin:python-stdlib:1"],
            "was saved with data.seq_len=16 but this run has 8; the data position would not carry over (not with "
            "data.sources)",
        ),
    ]
    for index, (args, expected) in enumerate(cases):
        code, err = run_main(capsys, [*common, *args, f"--run.output_dir={tmp_path / f'b{index}'}"])
        lines = error_lines(err)
        assert code != 0 and len(lines) == 1 and expected in lines[0], err
    meta = json.loads((saved / "meshtron.json").read_text())
    (saved / "meshtron.json").write_text(json.dumps({**meta, "data.seq_len_changes": [[4, 8, 16]]}))
    mixed = ["--data.sources=builtin:python-stdlib:1", f"--run.output_dir={tmp_path / 'mixed'}"]
    code, err = run_main(capsys, [*common, f"--checkpoint.resume={saved}", *mixed])
    assert code != 0 and "goes on from a change of data.seq_len" in error_lines(err)[0], err
    (saved / "meshtron.json").write_text("{ broken")
    code, err = run_main(capsys, [*common, f"--checkpoint.resume={saved}", f"--run.output_dir={tmp_path / 'c'}"])
    assert code != 0 and "meshtron.json is unreadable" in error_lines(err)[0], err


@pytest.mark.parametrize(
    "command, expected",
    [
        (
            ["data", "prepare", "--data.path={missing}", "--out", "{tmp}/prepared"],
            "data.path: '{missing}' does not exist",
        ),
        (["generate", "{missing}", "--prompt", "hi"], "'{missing}' is not a folder"),
        (
            ["generate", "{tmp}", "--prompt", "hi"],
            "is neither a meshtron checkpoint (step-N), a Hugging Face model folder (config.json) nor a peft adapter",
        ),
        (["generate", "{adapter}", "--prompt", "hi"], "names base model None (base_model_name_or_path in"),
        (["generate", "{not_a_model}", "--prompt", "hi"], "cannot load a causal LM from"),
        (["generate", "{not_a_model}", "--chat"], "meshtron generate --chat: the byte tokenizer (used for"),
        (["export", "{tmp}", "{tmp}/out"], "meshtron export: '{tmp}' is not a whole meshtron checkpoint"),
        (["plot", "{tmp}"], "'{tmp}' has no metrics.jsonl"),
        (["compare", "{tmp}", "{missing}"], "has no metrics.jsonl"),
        (
            ["plan", "--model", "nope", "--gpus", "8", "--seq-len", "128", "--global-batch", "8"],
            "--model: 'nope' is neither",
        ),
        (["plan", "--model", "llama-1b", "--gpus", "0", "--seq-len", "128", "--global-batch", "8"], "--gpus must be"),
        (["plan", "--model", "llama-1b", "--gpus", "1", "--float8-recipe", "rowwise"], "add --float8"),
    ],
)
def test_every_command_ends_bad_input_with_one_line(capsys, tmp_path, command, expected):
    """Each command other than train, given a path or value that cannot work: one error line naming it, exit 2,
    no traceback."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"foo": 1}))  # no model_type
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    paths = {
        "missing": str(tmp_path / "no-such"),
        "tmp": str(tmp_path),
        "not_a_model": str(tmp_path / "model"),
        "adapter": str(tmp_path / "adapter"),
    }
    args = [arg.format(**paths) for arg in command]
    if command[0] == "generate" and "{not_a_model}" in command:
        args += ["--tokenizer", "byte"]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected.format(**paths) in lines[0], lines[0]


def assert_one_error(capsys, args: list[str], expected: str) -> None:
    """``meshtron ARGS`` exits 2 with one meshtron error line on stderr, no traceback, that contains ``expected``."""
    code = main(args)
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (args, code, err)
    assert expected in lines[0], (args, lines[0])


def test_data_prepare_bad_input(capsys, tmp_path):
    """An --out that is a file (kept as it was) or lies under one, a shard size that is not a number, a corrupt
    Parquet file, a saved dataset that does not load, and a missing tokenizer: one line each."""
    text = tmp_path / "docs.txt"
    text.write_text("some text to tokenize\n")
    (tmp_path / "bad.parquet").write_text("not parquet")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_info.json").write_text("{}")
    prepare = ["data", "prepare", f"--data.path={text}"]
    cases = [
        ([*prepare, "--out", str(text)], f"--out {text} is a file, not a folder"),
        ([*prepare, "--out", str(text / "sub")], f"--out {text / 'sub'}: cannot create the folder"),
        ([*prepare, "--out", str(tmp_path / "o"), "--shard-mb", "nan"], "--shard-mb must be positive"),
        ([*prepare, "--out", str(tmp_path / "o"), "--shard-mb", "inf"], "--shard-mb must be positive"),
        (
            ["data", "prepare", f"--data.path={tmp_path / 'bad.parquet'}", "--out", str(tmp_path / "o")],
            "bad.parquet is not a readable Parquet file",
        ),
        (
            ["data", "prepare", f"--data.path={tmp_path / 'saved'}", "--out", str(tmp_path / "o")],
            "looks like a saved dataset but does not load",
        ),
        ([*prepare, "--data.tokenizer=/no/such/tokenizer", "--out", str(tmp_path / "o")], "data.tokenizer"),
    ]
    for args, expected in cases:
        assert_one_error(capsys, args, expected)
    assert text.read_text() == "some text to tokenize\n"
    assert not (tmp_path / "o").exists()  # a prepare that failed on its input leaves no unfinished --out behind


@pytest.fixture
def bad_runs(tmp_path):
    """A good run directory and broken ones: rows that are not numbers, an unreadable run.json, a binary file."""
    rows = [{"step": 1, "loss": 2.0, "tokens_per_s": 100.0}, {"step": 2, "loss": 1.5, "tokens_per_s": 110.0}]
    contents = {
        "good": "".join(json.dumps(row) + "\n" for row in rows),
        "text-step": json.dumps({"step": "one", "loss": 2.0}) + "\n",
        "text-loss": json.dumps({"step": 1, "loss": "2.0"}) + "\n",
        "text-throughput": json.dumps({"step": 1, "loss": 2.0, "tokens_per_s": "fast"}) + "\n",
    }
    for name, text in contents.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(text)
    for name, info in (("broken-info", "{ broken"), ("list-info", "[1, 2]"), ("bad-segments", '{"segments": [{}]}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(contents["good"])
        (tmp_path / name / "run.json").write_text(info)
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "metrics.jsonl").write_bytes(b"\xce\xff\x00\x81" * 16)
    return tmp_path


def test_plot_bad_input(capsys, bad_runs):
    """Metrics that are not numbers, a broken run.json or metrics file, a bad --dpi, and an -o that cannot be
    written (a file in its way, kept as it was): one line each."""
    good = str(bad_runs / "good")
    picture = bad_runs / "mine.png"
    picture.write_text("precious")
    cases = [
        (["plot", str(bad_runs / "text-step")], "text-step/metrics.jsonl:1: its step is 'one', not a whole number"),
        (["plot", str(bad_runs / "text-loss")], "text-loss/metrics.jsonl:1: its loss is '2.0', not a number"),
        (["plot", str(bad_runs / "text-throughput")], "its tokens_per_s is 'fast', not a number"),
        (["plot", str(bad_runs / "broken-info")], "broken-info/run.json is unreadable"),
        (["plot", str(bad_runs / "list-info")], "list-info/run.json is not a JSON object"),
        (["plot", str(bad_runs / "bad-segments")], "bad-segments/run.json: segments is not a list of {first_step"),
        (["plot", str(bad_runs / "binary")], "binary/metrics.jsonl is unreadable"),
        (["plot", good, "--dpi", "0"], "--dpi must be a positive integer, got 0"),
        (["plot", good, "-o", str(picture / "x.png")], f"cannot write '{picture / 'x.png'}'"),
    ]
    for args, expected in cases:
        assert_one_error(capsys, args, expected)
    assert picture.read_text() == "precious"


def test_compare_bad_input(capsys, bad_runs):
    """A tolerance that is negative or not a number, a missing run, rows that are not numbers, a broken run.json."""
    good = str(bad_runs / "good")
    cases = [
        (["compare", good, good, "--tol", "-1"], "--tol must be a number >= 0"),
        (["compare", good, good, "--tol", "nan"], "--tol must be a number >= 0"),
        (["compare", good, str(bad_runs / "missing")], "'" + str(bad_runs / "missing") + "' has no metrics.jsonl"),
        (["compare", good, str(bad_runs / "text-loss")], "its loss is '2.0', not a number"),
        (["compare", str(bad_runs / "text-throughput"), good], "its tokens_per_s is 'fast', not a number"),
        (["compare", str(bad_runs / "list-info"), good], "list-info/run.json is not a JSON object"),
    ]
    for args, expected in cases:
        assert_one_error(capsys, args, expected)


def test_plan_bad_input(capsys, tmp_path):
    """Hardware numbers that are not finite, model paths that are missing or not a causal LM's config, and an
    --emit-config that cannot be written: one line each."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-type.json").write_text(json.dumps({"hidden_size": 64}))
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    blocker = tmp_path / "file.txt"
    blocker.write_text("kept")
    shape = ["--gpus", "8", "--seq-len", "128", "--global-batch", "8"]
    plan = ["plan", "--model", "llama-1b", *shape]
    cases = [
        ([*plan, "--peak-tflops", "nan"], "--peak-tflops must be positive, got nan"),
        ([*plan, "--reserved-gb", "inf"], "--reserved-gb must be positive, got inf"),
        ([*plan, "--gpu-memory", "inf"], "--gpu-memory: must be positive, got 'inf'"),
        ([*plan, "--gpu", "v100"], "--gpu: unknown GPU 'v100'"),
        (["plan", "--model", str(tmp_path / "empty"), *shape], f"--model: '{tmp_path / 'empty'}' has no config.json"),
        (["plan", "--model", str(tmp_path / "no-type.json"), *shape], "names no model_type"),
        (["plan", "--model", str(tmp_path / "bert.json"), *shape], "is not a decoder-only causal language model"),
        (["plan", "--model", str(tmp_path / "no" / "such"), *shape], "does not exist; give a meshtron preset"),
        ([*plan, "--emit-config", str(blocker / "x.toml")], f"'{blocker}' is a file, not a folder"),
    ]
    for args, expected in cases:
        assert_one_error(capsys, args, expected)
    assert blocker.read_text() == "kept"
