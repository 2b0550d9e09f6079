"""Preference data (data.format=preference): each pair's sequences and completion masks equal TRL 1.16's
(DPOTrainer's ``_prepare_dataset`` and DataCollatorForPreference) for plain strings, conversations and the implicit
prompt, under keep_start and keep_end; the row contract (two label runs, separators, positions restarting for the
rejected sequence); each bad input's one-line error; chosen == rejected counted; the held-out split and eval.path."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from preference_fixture import preference_records, write_preference_dataset, write_preference_jsonl
from tiny_llama_fixture import CHARACTERS, save_tiny_llama

from meshtron.config import DataConfig, EvalConfig, PreferenceConfig, load_config
from meshtron.data.labels import IGNORE_INDEX
from meshtron.data.preference import build_preference_datasets, resolved_max_length
from meshtron.data.tokenizer import ByteTokenizer, load_tokenizer
from meshtron.data.training_data import build_training_data
from meshtron.errors import ConfigError
from meshtron.models.attention import document_ids, document_positions

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A character-level tokenizer that puts BOS first and merges "ab" (so a prompt ending in "a" and an answer
    starting with "b" merge across the boundary: TRL's common-prefix rule), with a chat template, and a tiny Llama."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("preference-tokenizer")
    vocab = {token: i for i, token in enumerate(CHARACTERS + ["<s>", "ab"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", bos_token="<s>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    save_tiny_llama(folder, 0, vocab_size=len(vocab))
    return folder


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


PLAIN = [
    {"prompt": "count: a", "chosen": "b c d", "rejected": "x y"},  # "ab" merges across the boundary
    {"prompt": "shout: cat", "chosen": " CAT", "rejected": " cat</s>"},  # one answer ends with EOS already
    {"prompt": "a much longer prompt that fills the whole of a short max_length", "chosen": " yes", "rejected": " no"},
    {"prompt": "same", "chosen": " twice", "rejected": " twice"},  # chosen == rejected: skipped
    {"prompt": "", "chosen": "an answer with no prompt at all", "rejected": "another"},
]
CONVERSATIONS = [
    {"prompt": [user("count: a")], "chosen": [assistant("b c d")], "rejected": [assistant("x")]},
    {
        "prompt": [{"role": "system", "content": "be brief"}, user("hi"), assistant("hello"), user("again?")],
        "chosen": [assistant("yes, once more and at length")],
        "rejected": [assistant("no")],
    },
    {"prompt": [user("q")], "chosen": [assistant("same")], "rejected": [assistant("same")]},
]
IMPLICIT = [
    {"chosen": [user("count: a"), assistant("b c")], "rejected": [user("count: a"), assistant("z")]},
    {
        "chosen": [user("hi"), assistant("hello"), user("more"), assistant("sure thing")],
        "rejected": [user("hi"), assistant("hello"), user("more"), assistant("never")],
    },
    # one a beginning of the other: TRL's extract_prompt keeps the last shared message in the answers
    {"chosen": [user("x"), assistant("y")], "rejected": [user("x"), assistant("y"), user("z"), assistant("w")]},
]


def trl_sequences(records, tokenizer_dir, max_length, mode):
    """Per pair TRL keeps, [(ids, completion mask) of prompt + chosen, of prompt + rejected], from TRL's own code."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode=mode)
    kept = [r for r in records if r["chosen"] != r["rejected"]]  # meshtron skips these (TRL would train on them)
    prepared = DPOTrainer._prepare_dataset(
        SimpleNamespace(_tokenizer=tokenizer), Dataset.from_list(kept), tokenizer, args, "train"
    )
    collator = DataCollatorForPreference(
        pad_token_id=tokenizer.eos_token_id, max_length=max_length, truncation_mode=mode
    )
    pairs = []
    for example in prepared:
        batch = collator([{key: example[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")}])
        lengths = batch["attention_mask"].sum(1).tolist()
        pairs.append(
            [
                (batch["input_ids"][i, :n].tolist(), batch["completion_mask"][i, :n].tolist())
                for i, n in enumerate(lengths)
            ]
        )
    return pairs


def expected_row(pair, separator, seq_len):
    """The row contract: (tokens, labels) of a pair's row from its two (ids, completion mask)."""
    tokens = np.full(seq_len + 1, separator, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    start = 0
    for ids, mask in pair:
        tokens[start : start + len(ids)] = ids
        for k in range(1, len(ids)):  # the first token of a sequence is never a target
            if mask[k]:
                labels[start + k - 1] = ids[k]
        start += len(ids) + 1
    return tokens, labels


def meshtron_dataset(tmp_path, records, tokenizer, seq_len=80, max_length=None, mode="keep_start", **data):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    config = DataConfig(path=str(path), format="preference", seq_len=seq_len, **data)
    return build_preference_datasets(config, PreferenceConfig(max_length=max_length, truncation_mode=mode), tokenizer)


@pytest.mark.parametrize(
    "form,max_length,mode",
    [
        ("plain", None, "keep_start"),
        ("plain", 14, "keep_start"),
        ("plain", 14, "keep_end"),
        ("conversational", None, "keep_start"),
        ("conversational", 80, "keep_start"),
        ("conversational", 80, "keep_end"),
        ("implicit", None, "keep_start"),
        ("implicit", 20, "keep_end"),
    ],
)
def test_each_pairs_sequences_and_completion_masks_equal_trls(tmp_path, tokenizer_dir, form, max_length, mode):
    records = {"plain": PLAIN, "conversational": CONVERSATIONS, "implicit": IMPLICIT}[form]
    seq_len = 199
    dataset, _ = meshtron_dataset(tmp_path, records, load_tokenizer(str(tokenizer_dir)), seq_len, max_length, mode)
    expected = trl_sequences(records, tokenizer_dir, resolved_max_length(seq_len, max_length), mode)
    assert len(dataset) == len(expected) >= 2
    inputs, labels = dataset.batch(np.arange(len(dataset)))
    for row, pair in enumerate(expected):
        tokens, row_labels = expected_row(pair, dataset.separator, seq_len)
        assert dataset.rows([row])[0].tolist() == tokens.tolist(), (form, row)
        assert inputs[row].tolist() == tokens[:-1].tolist()
        assert labels[row].tolist() == row_labels.tolist(), (form, row)
    if form == "plain":  # the prompt filling max_length is dropped under keep_start only, as TRL drops it
        assert dataset.identical == 1
        assert dataset.prompt_too_long == (1 if max_length and mode == "keep_start" else 0)
    for ids, mask in (s for pair in expected for s in pair):  # the separator is in no sequence
        assert dataset.separator not in ids


def test_the_merge_across_the_prompts_end_starts_the_answer_where_the_tokens_diverge(tmp_path, tokenizer_dir):
    """The contract's common-prefix rule, seen by hand: "count: a" + "b c d" tokenizes "ab" as one token, which is
    the answer's first (the prompt loses its "a"); BOS leads both sequences and is never a target."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    dataset, _ = meshtron_dataset(tmp_path, PLAIN[:1], tokenizer)
    tok = tokenizer.tok
    row = dataset.rows([0])[0].tolist()
    assert row[0] == tok.bos_token_id
    chosen_end = int(dataset.chosen_end[0])
    assert tok.decode(row[: chosen_end - 1]) == "<s>count: ab c d</s>"
    _, labels = dataset.batch([0])
    targets = [t for t in labels[0].tolist() if t != IGNORE_INDEX]
    assert targets[0] == tok.convert_tokens_to_ids("ab")
    # the prompt's ids are the part both sequences share: "<s>count: ", so the rejected answer begins with "a"
    assert tok.decode(targets) == "ab c d</s>ax y</s>"


def label_runs(labels: torch.Tensor) -> list[tuple[int, int]]:
    """(start, stop) of each run of labelled positions."""
    labelled = (labels != IGNORE_INDEX).tolist()
    runs, start = [], None
    for position, on in enumerate(labelled + [False]):
        if on and start is None:
            start = position
        elif not on and start is not None:
            runs.append((start, position))
            start = None
    return runs


def test_each_row_holds_one_pair_two_label_runs_and_the_rejected_sequence_restarts_at_position_zero(tmp_path):
    path = write_preference_jsonl(tmp_path / "pairs.jsonl", 20, "alphabet")
    config = DataConfig(path=str(path), format="preference", seq_len=64)
    dataset, _ = build_preference_datasets(config, PreferenceConfig(), ByteTokenizer())
    assert len(dataset) == 20
    assert dataset.separator == 255  # EOS (256) ends every plain answer; 255 is in no UTF-8 text
    inputs, labels = dataset.batch(np.arange(20))
    rows = torch.from_numpy(dataset.rows(np.arange(20)))
    documents = document_ids(rows, dataset.separator)
    positions = document_positions(documents)
    records = preference_records(20, "alphabet")
    for row in range(20):
        chosen_end = int(dataset.chosen_end[row])
        runs = label_runs(labels[row])
        assert len(runs) == 2 and runs[0][1] < runs[1][0]  # the chosen answer's, then the rejected's, a gap between
        assert runs[0][1] < chosen_end <= runs[1][0]
        assert documents[row, chosen_end - 1] == 0 and documents[row, chosen_end] == 1  # the separator ends doc 0
        assert positions[row, chosen_end] == 0  # the rejected sequence starts again at position 0
        tokens = rows[row].tolist()
        chosen_answer = ByteTokenizer().decode(labels[row, runs[0][0] : runs[0][1]])
        assert chosen_answer == records[row]["chosen"] and tokens[chosen_end - 2] == 256  # EOS appended
        assert ByteTokenizer().decode(labels[row, runs[1][0] : runs[1][1]]) == records[row]["rejected"]
        assert set(tokens[runs[1][1] + 2 :]) == {255}  # separator padding
    chosen = sum(len(r["chosen"]) + 1 for r in records)
    rejected = sum(len(r["rejected"]) + 1 for r in records)
    assert dataset.chosen_token_count(np.arange(20)) == chosen
    assert dataset.target_count(np.arange(20)) == chosen + rejected == int((labels != IGNORE_INDEX).sum())
    assert dataset.chosen_token_count([3]) == len(records[3]["chosen"]) + 1


def test_a_saved_dataset_reads_as_the_same_jsonl_and_max_documents_limits_pairs(tmp_path, tokenizer_dir):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    for conversational in (False, True):
        jsonl = write_preference_jsonl(tmp_path / f"p{conversational}.jsonl", 12, "upper", conversational, seed=3)
        folder = write_preference_dataset(tmp_path / f"p{conversational}", 12, "upper", conversational, seed=3)
        built = [
            build_preference_datasets(
                DataConfig(path=str(path), format="preference", seq_len=64, max_documents=10), PreferenceConfig(), tok
            )[0]
            for path, tok in ((jsonl, tokenizer), (folder, tokenizer))
        ]
        assert len(built[0]) == 10
        assert np.array_equal(built[0].tokens, built[1].tokens)
        assert np.array_equal(built[0].trained, built[1].trained)


def one_line_error(tmp_path, records, tokenizer=None, **settings) -> str:
    with pytest.raises(ConfigError) as caught:
        meshtron_dataset(tmp_path, records, tokenizer or ByteTokenizer(), **settings)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "record,expected",
    [
        ({"prompt": "p", "rejected": "r"}, r"pairs.jsonl:2 has no 'chosen'"),
        ({"prompt": "p", "chosen": "c"}, r"pairs.jsonl:2 has no 'rejected'"),
        ({"chosen": "c", "rejected": "r"}, r"pairs.jsonl:2 has no 'prompt'; plain-string"),
        ({"prompt": "p", "chosen": "", "rejected": "r"}, r"pairs.jsonl:2: 'chosen' is empty"),
        ({"prompt": "p", "chosen": "c", "rejected": 3}, r"pairs.jsonl:2: 'rejected' is a int"),
        ({"prompt": [user("p")], "chosen": "c", "rejected": "r"}, r"pairs.jsonl:2: 'prompt' is a list"),
        ({"prompt": [user("p")], "chosen": [{"role": "assistant"}], "rejected": [assistant("r")]}, "'chosen' must be"),
        ({"prompt": [user("p")], "chosen": [assistant("c")], "rejected": []}, "'rejected' must be a non-empty"),
        ({"prompt": [user("p")], "chosen": [{"role": "bot", "content": "c"}], "rejected": [assistant("r")]}, "'bot'"),
    ],
)
def test_each_bad_record_is_refused_in_one_line_naming_its_line(tmp_path, tokenizer_dir, record, expected):
    good = {"prompt": "p", "chosen": " c", "rejected": " r"}
    tokenizer = load_tokenizer(str(tokenizer_dir))
    assert expected in one_line_error(tmp_path, [good, record], tokenizer)


def test_a_completion_with_no_token_of_its_own_and_bad_files_are_refused(tmp_path, tokenizer_dir):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    # a template that renders no assistant message: prompt + answer tokenizes as a beginning of the prompt alone
    tokenizer.tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    message = one_line_error(tmp_path, CONVERSATIONS[:1], tokenizer)
    assert "pairs.jsonl:1: 'chosen' has no token of its own after tokenization" in message
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "p", "chosen": "c", "rejected": "r"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 is not valid JSON"):
        build_preference_datasets(
            DataConfig(path=str(bad_json), format="preference"), PreferenceConfig(), ByteTokenizer()
        )
    with pytest.raises(ConfigError, match="is not a .jsonl file or a saved dataset"):
        build_preference_datasets(
            DataConfig(path=str(tmp_path), format="preference"), PreferenceConfig(), ByteTokenizer()
        )
    with pytest.raises(ConfigError, match="chat template"):
        meshtron_dataset(tmp_path, CONVERSATIONS, ByteTokenizer())


def test_chosen_equal_to_rejected_is_counted_skipped_and_said_at_start(tmp_path):
    records = preference_records(6, "upper") + [{"prompt": "p", "chosen": " same", "rejected": " same"}] * 2
    dataset, _ = meshtron_dataset(tmp_path, records, ByteTokenizer(), seq_len=64)
    assert len(dataset) == 6 and dataset.identical == 2
    assert "2 with chosen == rejected skipped" in dataset.describe()
    assert "6 preference pairs" in dataset.describe()
    with pytest.raises(Exception, match="no usable preference pairs"):
        meshtron_dataset(tmp_path, records[-2:], ByteTokenizer())


def test_the_prompt_filling_max_length_is_left_out_under_keep_start_and_counted(tmp_path):
    records = [{"prompt": "x" * 20, "chosen": " c", "rejected": " r"}] + preference_records(4, "upper")
    dataset, _ = meshtron_dataset(tmp_path, records, ByteTokenizer(), seq_len=64, max_length=20)
    assert (len(dataset), dataset.prompt_too_long) == (4, 1)
    assert "1 whose prompt fills preference.max_length=20 left out" in dataset.describe()
    kept_end, _ = meshtron_dataset(tmp_path, records, ByteTokenizer(), seq_len=64, max_length=20, mode="keep_end")
    assert (len(kept_end), kept_end.prompt_too_long, kept_end.truncated) == (5, 0, 2)
    assert kept_end.rows([0])[0, 19] == 256  # keep_end keeps the answer's end: its EOS ends the 20 tokens


def test_holdout_keeps_the_last_pairs_apart_and_eval_path_reads_the_same_format(tmp_path):
    path = write_preference_jsonl(tmp_path / "pairs.jsonl", 30, "alphabet")
    other = write_preference_jsonl(tmp_path / "eval.jsonl", 8, "upper", seed=1)
    data = DataConfig(path=str(path), format="preference", seq_len=64, shuffle=False)
    whole, _ = build_preference_datasets(data, PreferenceConfig(), ByteTokenizer())
    run = build_training_data(
        data,
        ByteTokenizer(),
        4,
        is_builder=True,
        evaluation=EvalConfig(holdout_documents=6),
        preference=PreferenceConfig(),
    )
    assert (len(run.dataset), len(run.eval_dataset)) == (24, 6)
    assert np.array_equal(run.eval_dataset.tokens, whole.tokens[24:])
    assert np.array_equal(run.dataset.tokens, whole.tokens[:24])
    assert run.schedule.global_batch(0).size == 4
    run = build_training_data(data, ByteTokenizer(), 4, is_builder=True, evaluation=EvalConfig(path=str(other)))
    assert len(run.eval_dataset) == 8 and run.eval_dataset.separator == run.dataset.separator
    with pytest.raises(ConfigError, match="eval.holdout_documents=30 leaves nothing"):
        build_training_data(data, ByteTokenizer(), 4, is_builder=True, evaluation=EvalConfig(holdout_documents=30))


def test_preflight_refuses_what_preference_data_cannot_work_with(tmp_path):
    from meshtron.train.setup.preflight import preflight

    path = write_preference_jsonl(tmp_path / "pairs.jsonl", 8, "upper")

    def check(*extra):
        overrides = [
            "train.objective=dpo",
            "data.format=preference",
            f"data.path={path}",
            "data.tokenizer=byte",
            "model.preset=llama-tiny",
            "data.seq_len=64",
            f"run.output_dir={tmp_path / 'run'}",
            *extra,
        ]
        preflight(load_config(None, overrides, env={}), 1, "cpu")

    check()
    for extra, expected in (
        (["data.mask_documents=false"], "needs data.mask_documents=true"),
        (["preference.max_length=40"], "preference.max_length=40 does not fit data.seq_len=64"),
        (["data.streaming=true"], "data.format=preference does not work with data.streaming yet"),
        ([f"data.sources={path}:1"], "data.format=preference does not work with data.sources yet"),
    ):
        with pytest.raises(ConfigError, match=expected) as caught:
            check(*extra)
        assert "\n" not in str(caught.value)
    check("preference.max_length=31")  # two sequences of 31 and two separators: 64 = data.seq_len + 1 - 1
    assert resolved_max_length(64, None) == 31 and resolved_max_length(63, None) == 31


def test_a_prepared_text_directory_is_refused(tmp_path):
    from meshtron.data.shards import FORMAT, MANIFEST
    from meshtron.train.setup.preflight import check_data_sources

    folder = tmp_path / "prepared"
    folder.mkdir()
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT}))
    with pytest.raises(ConfigError, match="data.format=preference reads preference pairs"):
        check_data_sources(replace(DataConfig(format="preference"), path=str(folder)))


def test_a_preference_checkpoint_resumes_only_with_its_seq_len(tmp_path):
    """The rows of pairs cannot be recut to another length: as for chat, a resume keeps data.seq_len."""
    from transformers import LlamaConfig

    from meshtron.checkpoint.manager import DATA_POSITION, check_compatible, model_signature

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    meta = {"model": model_signature(config), DATA_POSITION: {}, "data.seq_len": 64, "train.global_batch_size": 4}
    check_compatible(meta, tmp_path, config, DataConfig(format="preference", seq_len=64), 8)  # another batch: fine
    with pytest.raises(ConfigError, match=r"data.seq_len=64 but this run has 32.*\(not with data.format=preference\)"):
        check_compatible(meta, tmp_path, config, DataConfig(format="preference", seq_len=32), 4)


def test_with_prompt_nll_the_chosen_prompts_targets_are_marked_for_the_nll_and_counted(tmp_path):
    """ORPO's NLL (TRL's ORPOTrainer) covers the chosen sequence's prompt tokens too: with prompt_nll each row's chosen
    prompt targets carry NLL_ONLY_LABELS_BELOW marks (their tokens, recoverable), the answers' labels are unchanged,
    and chosen_token_count counts every target of the chosen sequence."""
    from meshtron.train.loss.preference import PROMPT_RUN, preference_runs, target_tokens

    path = write_preference_jsonl(tmp_path / "pairs.jsonl", 6, "upper")
    config = DataConfig(path=str(path), format="preference", seq_len=64)
    plain, _ = build_preference_datasets(config, PreferenceConfig(), ByteTokenizer())
    marked, _ = build_preference_datasets(config, PreferenceConfig(), ByteTokenizer(), prompt_nll=True)
    rows = np.arange(6)
    _, labels = plain.batch(rows)
    _, marks = marked.batch(rows)
    assert torch.equal(torch.where(marks < IGNORE_INDEX, IGNORE_INDEX, marks), labels)  # the answers' as before
    runs = preference_runs(marks)
    tokens = torch.from_numpy(marked.rows(rows))
    for row, record in enumerate(preference_records(6, "upper")):
        chosen_length = int(marked.chosen_end[row]) - 1  # the chosen sequence's tokens
        prompt = (runs[row] == PROMPT_RUN).nonzero().flatten().tolist()
        assert prompt == list(range(len(record["prompt"]) - 1))  # targets 1.. of the prompt: positions 0..
        assert torch.equal(target_tokens(marks[row, prompt]), tokens[row, 1 : len(prompt) + 1])
        assert marked.chosen_token_count([row]) == chosen_length - 1 == plain.chosen_token_count([row]) + len(prompt)
    assert marked.target_count(rows) == plain.target_count(rows)


def test_a_pair_that_keeps_no_token_of_an_answer_is_refused_while_the_data_is_built():
    """Every rank builds every row, so the refusal comes before any collective (a row of one label run would
    otherwise stop only the rank that holds it, mid-step)."""
    from meshtron.data.preference import Pair, pack_pairs
    from meshtron.errors import MeshtronError

    assert len(pack_pairs([Pair([1, 2], [5], [6, 7])], 0, 33, 15, "keep_start")) == 1
    with pytest.raises(MeshtronError, match="pair 1 .* no token of its chosen answer"):
        pack_pairs([Pair([], [5], [6, 7])], 0, 33, 15, "keep_start")
