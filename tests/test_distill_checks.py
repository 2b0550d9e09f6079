"""train.objective=distill's start-up checks: each wrong teacher or ``[distill]`` setting is one line naming the
setting and the fix, before any process group (``preflight`` takes the world size), and the teacher's weights load at
the student's vocabulary (a larger padded vocabulary's first rows, exactly)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file, save_file
from tiny_llama_fixture import CHARACTERS

from meshtron.cli import main
from meshtron.config import DistillConfig, ModelConfig, load_config
from meshtron.data import hub
from meshtron.errors import ConfigError, MeshtronError
from meshtron.models.build import build_meta_model, load_hf_config, materialize
from meshtron.models.teacher import load_teacher_config, teacher_model_config
from meshtron.train.setup.preflight import preflight

EMBEDDING = "model.embed_tokens.weight"
SHUFFLED = CHARACTERS[:2] + CHARACTERS[2:][::-1]
"""The character tokenizer's tokens with other ids: a tokenizer of the same size that is not the student's."""


def save_tokenizer(folder: Path, tokens: list[str]) -> None:
    """A fast Hugging Face tokenizer of ``tokens`` (id = position), ``</s>`` its EOS."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)


def save_llama(
    folder: Path,
    *,
    vocab_size: int = 128,
    heads: int = 2,
    layers: int = 2,
    positions: int = 256,
    tied: bool = False,
    tokens: list[str] | None = CHARACTERS,
    seed: int = 0,
) -> Path:
    """A tiny Llama (16 dimensions a head) saved with ``save_pretrained``, with the tokenizer of ``tokens`` (None:
    none)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=16 * heads,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=positions,
        vocab_size=vocab_size,
        tie_word_embeddings=tied,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if tokens is not None:
        save_tokenizer(folder, tokens)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The student (a two-head, two-layer Llama of the character tokenizer's 97 ids in 128) and teachers beside it,
    each wrong in one way, or not."""
    root = tmp_path_factory.mktemp("distill")
    save_llama(root / "student")
    save_llama(root / "teacher", heads=4, seed=1)
    save_llama(root / "padded", vocab_size=192, heads=4, tokens=None, seed=2)
    save_llama(root / "small-vocab", vocab_size=64, tokens=None)
    save_llama(root / "mid-vocab", vocab_size=112, tokens=None)
    save_llama(root / "other-tokenizer", tokens=SHUFFLED)
    save_llama(root / "three-heads", heads=3)
    save_llama(root / "one-layer", layers=1)
    save_llama(root / "short", positions=16)
    save_llama(root / "byte-sized", vocab_size=320)  # fits a byte-tokenizer student's vocabulary, not its tokens
    save_llama(root / "wide-vocab-student", vocab_size=192)
    save_llama(root / "bare-wide", vocab_size=448, tokens=None)  # no tokenizer, more ids than a model made for bytes
    save_llama(root / "bare-bytes", vocab_size=320, tokens=None)  # as meshtron exports a run on bytes
    (root / "empty").mkdir()
    (root / "no-weights").mkdir()
    (root / "no-weights" / "config.json").write_text((root / "teacher" / "config.json").read_text())
    (root / "bert").mkdir()
    (root / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    return root


def distill_config(student: Path | None, teacher: str | Path, *extra: str):
    model = [f"model.name_or_path={student}", "model.preset=none"] if student else ["model.preset=tiny"]
    overrides = [*model, "train.objective=distill", f"distill.teacher={teacher}", "data.seq_len=32", *extra]
    return load_config(None, overrides, env={})


def refusal(models: Path, teacher: str | Path, *extra: str, world_size: int = 1, student="student") -> str:
    """preflight's one-line ConfigError for ``teacher`` (a name under ``models``, or a path)."""
    student_folder = models / student if student else None
    cfg = distill_config(student_folder, models / teacher if isinstance(teacher, str) else teacher, *extra)
    with pytest.raises(ConfigError) as refused:
        preflight(cfg, world_size, "cpu")
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def test_a_teacher_folder_that_does_not_exist(models):
    message = refusal(models, Path("/no/such/teacher"))
    assert message.startswith("distill.teacher: '/no/such/teacher' is not an existing directory"), message
    assert "give a local Hugging Face model directory" in message, message


def test_a_teacher_folder_without_config_json(models):
    message = refusal(models, "empty")
    assert message.startswith(f"distill.teacher: '{models / 'empty'}' has no config.json"), message


def test_a_teacher_folder_without_weights(models):
    message = refusal(models, "no-weights")
    assert message.startswith(
        f"distill.teacher: '{models / 'no-weights'}' has no model.safetensors or pytorch_model.bin"
    )
    assert "a teacher needs its trained weights" in message, message


def test_a_teacher_that_is_no_causal_lm(models):
    message = refusal(models, "bert")
    assert message.startswith(f"distill.teacher: '{models / 'bert'}' (model_type 'bert') is not a decoder-only"), (
        message
    )


@pytest.mark.parametrize("teacher, size", [("small-vocab", 64), ("mid-vocab", 112)])
def test_a_teacher_of_a_smaller_vocabulary(models, teacher, size):
    """Smaller than the tokenizer's 97 ids or only than the student's 128: the teacher's words, both sizes."""
    message = refusal(models, teacher)
    assert message.startswith(f"distill.teacher: the teacher's vocabulary has {size} ids but the student's has 128;")
    assert "use a teacher of the student's tokenizer" in message, message


def test_a_teacher_of_another_tokenizer(models):
    message = refusal(models, "other-tokenizer")
    assert message.startswith("distill.teacher: its tokenizer (97 ids) is not the student's data.tokenizer (97 ids)")
    assert "use a teacher of the same tokenizer" in message, message


def test_a_teacher_with_a_tokenizer_for_a_student_on_bytes(models):
    """A student on the byte tokenizer (257 ids in 320) and a teacher of 320 ids with its own tokenizer: the ids mean
    other tokens, refused rather than distilled."""
    message = refusal(models, "byte-sized", "data.tokenizer=byte", student=None)
    assert message.startswith("distill.teacher: its tokenizer (97 ids) is not the student's data.tokenizer (257 ids)")


def test_a_teacher_without_a_tokenizer_made_for_another_than_bytes(models):
    """No tokenizer to compare, but more ids than a model made for bytes (320) for a student on bytes: refused; a
    bare teacher of 320 ids (as meshtron exports a run on bytes) is taken."""
    message = refusal(models, "bare-wide", "data.tokenizer=byte", student=None)
    assert message.startswith(f"distill.teacher: {models / 'bare-wide'} has no tokenizer and its model has 448 ids")
    assert "student's byte tokenizer (257 ids); use a teacher of the student's tokenizer" in message, message
    setup = preflight(distill_config(None, models / "bare-bytes", "data.tokenizer=byte"), 1, "cpu")
    assert setup.teacher_config.vocab_size == 320


def test_a_teacher_whose_heads_tp_does_not_divide(models):
    preflight(distill_config(models / "student", models / "teacher", "parallel.tp=2"), 2, "cpu")  # 4 heads: fine
    message = refusal(models, "three-heads", "parallel.tp=2", world_size=2)
    assert message.startswith("distill.teacher: parallel.tp=2 does not divide the model's 3 attention heads"), message


def test_a_teacher_of_fewer_layers_than_the_pipeline_stages(models):
    message = refusal(models, "one-layer", "parallel.pp=2", world_size=2)
    assert message.startswith("distill.teacher: the model has 1 layers, fewer than the 2 pipeline stages"), message


def test_a_teacher_of_fewer_positions_than_data_seq_len(models):
    """The student's model.rope_scaling does not extend the teacher: the fix named is the teacher's own."""
    message = refusal(models, "short")
    assert message.startswith(
        "distill.teacher: data.seq_len 32 is longer than the teacher's max_position_embeddings 16"
    ), message
    assert "use data.seq_len <= 16, or a teacher of a longer context" in message, message


def test_a_teacher_that_fits_is_resolved(models):
    setup = preflight(distill_config(models / "student", models / "teacher"), 1, "cpu")
    assert setup.teacher_model.name_or_path == str(models / "teacher")
    assert setup.teacher_config.num_attention_heads == 4 and setup.teacher_config.vocab_size == 128


def test_a_relative_teacher_folder_is_made_absolute(models, monkeypatch):
    monkeypatch.chdir(models)
    setup = preflight(distill_config(models / "student", "teacher"), 1, "cpu")
    assert setup.teacher_model.name_or_path == str(models / "teacher")


def test_a_preset_teacher_takes_the_student_vocabulary(models):
    """A student folder of 192 ids for the tokenizer's 97: a preset teacher is made at 192, not refused as smaller."""
    setup = preflight(distill_config(models / "wide-vocab-student", "tiny"), 1, "cpu")
    assert setup.teacher_model.preset == "tiny" and setup.teacher_config.vocab_size == 192


COMMIT = "c" * 40


@pytest.fixture
def offline_cache(models, tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache holding the teacher as ``org/teacher`` (main at COMMIT), read offline."""
    cache = tmp_path / "cache"
    repo = cache / "models--org--teacher"
    shutil.copytree(models / "teacher", repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.hub_snapshot.cache_clear()
    yield cache
    hub.hub_snapshot.cache_clear()


def test_a_teacher_hub_id_is_pinned_to_its_snapshot(models, offline_cache):
    """Every later load (each rank's build) reads the commit preflight resolved, as the student's hub id does."""
    setup = preflight(distill_config(models / "student", "org/teacher"), 1, "cpu")
    assert (setup.teacher_model.name_or_path, setup.teacher_model.revision) == ("org/teacher", COMMIT)
    assert setup.teacher_config.num_attention_heads == 4


def test_a_teacher_hub_id_not_in_the_cache_is_one_line(models, offline_cache):
    message = refusal(models, Path("org/no-such-teacher"))  # a Path: as given, not under models
    assert message.startswith("distill.teacher: 'org/no-such-teacher' (revision main) is neither a local folder nor")


CONFIG_REFUSALS = [
    (["distill.alpha=1.5"], "distill.alpha: the cross-entropy's weight must be in [0, 1], got 1.5"),
    (["distill.alpha=-0.1"], "distill.alpha: the cross-entropy's weight must be in [0, 1], got -0.1"),
    (["distill.temperature=0"], "distill.temperature: must be > 0, got 0"),
    (["distill.temperature=-1"], "distill.temperature: must be > 0, got -1"),
    (
        ["distill.divergence=jsd", "distill.beta=1.0"],
        "distill.beta: the jsd mixture's teacher weight must be in (0, 1)",
    ),
    (["distill.divergence=jsd", "distill.beta=0"], "use divergence=forward_kl (beta 0) or reverse_kl (beta 1)"),
    (["distill.beta=0.3"], "distill.beta is the weight of divergence=jsd, but distill.divergence=forward_kl; set"),
    (
        ["distill.divergence=reverse_kl", "distill.beta=0.3"],
        "but distill.divergence=reverse_kl; set distill.divergence=jsd or remove distill.beta",
    ),
    (["data.format=preference"], "not for train.objective=distill; set train.objective=dpo"),
]


@pytest.mark.parametrize("extra, expected", CONFIG_REFUSALS)
def test_distill_settings_out_of_range_on_the_command_line(capsys, tmp_path, extra, expected):
    """Each one line on stderr from ``meshtron train``, exit 2, no traceback."""
    args = ["--model.preset=tiny", "--train.objective=distill", "--distill.teacher=tiny", *(f"--{e}" for e in extra)]
    assert_one_line(capsys, [*args, f"--run.output_dir={tmp_path / 'run'}"], expected)


def test_distill_settings_without_the_objective(capsys, tmp_path):
    assert_one_line(
        capsys,
        ["--model.preset=tiny", "--distill.alpha=0.5", f"--run.output_dir={tmp_path / 'run'}"],
        "distill.alpha is a setting of train.objective=distill, but train.objective=causal_lm; set "
        "train.objective=distill or remove the [distill] settings",
    )


def test_the_objective_without_a_teacher(capsys, tmp_path):
    assert_one_line(
        capsys,
        ["--model.preset=tiny", "--train.objective=distill", f"--run.output_dir={tmp_path / 'run'}"],
        "train.objective=distill needs its teacher: set distill.teacher=FOLDER",
    )


@pytest.mark.parametrize(
    "teacher, expected",
    [
        ("/no/such/teacher", "distill.teacher: '/no/such/teacher' is not an existing directory"),
        ("small-vocab", "distill.teacher: the teacher's vocabulary has 64 ids but the student's has 128"),
    ],
)
def test_a_wrong_teacher_on_the_command_line(capsys, models, tmp_path, teacher, expected):
    """preflight's refusal of a teacher is one line from ``meshtron train`` too, before any training."""
    folder = models / teacher if not teacher.startswith("/") else teacher
    args = [
        f"--model.name_or_path={models / 'student'}",
        "--model.preset=none",
        "--train.objective=distill",
        f"--distill.teacher={folder}",
        "--data.seq_len=32",
        f"--run.output_dir={tmp_path / 'run'}",
    ]
    assert_one_line(capsys, args, expected)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def assert_one_line(capsys, args: list[str], expected: str) -> None:
    code = main(["train", *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("meshtron: error")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert expected in lines[0], lines[0]


def test_a_teacher_is_a_preset_unless_a_folder_of_that_name_exists(tmp_path, monkeypatch):
    student = ModelConfig(trust_remote_code=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    for name in ("llama-small", "small"):
        preset = teacher_model_config(DistillConfig(teacher=name), student)
        assert (preset.preset, preset.name_or_path) == (name, None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama-small").mkdir()
    folder = teacher_model_config(DistillConfig(teacher="llama-small", teacher_dtype="bfloat16"), student)
    assert (folder.preset, folder.name_or_path, folder.dtype) == (None, "llama-small", "bfloat16")
    # model.trust_remote_code is the student's; its context extension is not (the teacher's own positions apply)
    assert folder.trust_remote_code and not folder.rope_scaling and folder.max_position_embeddings is None


def built_teacher(folder: Path, student_vocab: int) -> torch.nn.Module:
    """The teacher as the run builds it (meta model, then materialized from its folder), on one process."""
    teacher = ModelConfig(name_or_path=str(folder), preset=None)
    student_config = load_hf_config(ModelConfig(preset="tiny"), student_vocab)
    assert student_config.vocab_size == student_vocab
    config = load_teacher_config(teacher, student_vocab, student_config)
    model, adapter = build_meta_model(config, teacher)
    materialize(model, adapter, torch.device("cpu"), seed=0, pretrained_dir=str(folder))
    return model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("teacher_vocab", [320, 384])
def test_a_teacher_of_a_larger_padded_vocabulary_loads_its_first_rows(tmp_path, teacher_vocab, tied):
    """Student 320 ids; a teacher saved with 320 (loads as it is) or 384 (its first 320 embedding and head rows,
    exactly), tied or not."""
    folder = save_llama(tmp_path / "teacher", vocab_size=teacher_vocab, tied=tied, tokens=None)
    saved = load_file(folder / "model.safetensors")
    model = built_teacher(folder, 320)
    embedding = saved[EMBEDDING]
    assert embedding.shape[0] == teacher_vocab
    assert torch.equal(model.get_input_embeddings().weight, embedding[:320])
    head = embedding if tied else saved["lm_head.weight"]
    assert torch.equal(model.get_output_embeddings().weight, head[:320])
    weights = dict(model.named_parameters())
    assert torch.equal(
        weights["model.layers.0.self_attn.q_proj.weight"], saved["model.layers.0.self_attn.q_proj.weight"]
    )


def test_a_padded_teacher_whose_padding_id_is_beyond_the_student_vocabulary(tmp_path):
    """A padding id among the rows left unread (say a [PAD] added at the end) would be out of the embedding's
    range: the teacher builds without it, its rows as saved."""
    folder = save_llama(tmp_path / "teacher", vocab_size=384, tokens=None)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": 383}))
    model = built_teacher(folder, 320)
    assert model.config.pad_token_id is None
    assert torch.equal(model.get_input_embeddings().weight, load_file(folder / "model.safetensors")[EMBEDDING][:320])


@pytest.mark.parametrize(
    "tensor, shape",
    [("model.norm.weight", (40,)), (EMBEDDING, (384, 40)), ("lm_head.weight", (352, 32))],
)
def test_a_padded_teacher_of_another_shape_is_still_refused(tmp_path, tensor, shape):
    """Only rows beyond the student's, at the checkpoint's own vocabulary, are left unread: another hidden size, or
    a head of another vocabulary than config.json's, is the usual refusal."""
    folder = save_llama(tmp_path / "teacher", vocab_size=384, tokens=None)
    saved = load_file(folder / "model.safetensors")
    saved[tensor] = torch.zeros(shape)
    save_file(saved, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MeshtronError, match=r"weight '.*' has shape .* but the config asks for .*do not belong"):
        built_teacher(folder, 320)
