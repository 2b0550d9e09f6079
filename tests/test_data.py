"""The data package: tokenizers, sources, packing, the cached dataset and the global batch order."""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import pytest
import torch

from meshtron.config import BUILTIN_CORPUS, DataConfig
from meshtron.data import dataset as dataset_mod
from meshtron.data.dataset import PackedDataset, build_packed_dataset, cache_path
from meshtron.data.prepare import write_shard
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.data.shards import MANIFEST, TokenCorpus
from meshtron.data.sources import check_data_path, iter_documents, source_fingerprint
from meshtron.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from meshtron.errors import ConfigError, MeshtronError

EOS = 99


# ---------------------------------------------------------------- packing


def pack_documents(docs, eos: int, seq_len: int) -> np.ndarray:
    """The packing a prepared corpus must give: documents joined with EOS after each, cut into sequences of
    seq_len + 1, the remainder dropped (the in-memory definition meshtron used before prepared corpora)."""
    stream = np.concatenate([np.append(np.asarray(d, dtype=np.int64), eos) for d in docs])
    return stream[: stream.size // (seq_len + 1) * (seq_len + 1)].reshape(-1, seq_len + 1)


class ListTokenizer:
    """Documents given as token lists (``encode_batch`` returns them as they are)."""

    name, vocab_size = "list", 100

    def __init__(self, eos: int = EOS):
        self.eos_token_id = eos

    def encode_batch(self, docs):
        return [np.asarray(d, dtype=np.int32) for d in docs]


def corpus_of(tmp_path, docs, shard_sizes) -> TokenCorpus:
    """A prepared directory whose shards hold ``shard_sizes`` documents each, with a minimal manifest."""
    shards, start = [], 0
    for index, size in enumerate(shard_sizes):
        shards.append(write_shard(tmp_path, index, start, docs[start : start + size], ListTokenizer()))
        start += size
    (tmp_path / MANIFEST).write_text(json.dumps({"dtype": "uint16", "shards": shards}))
    return TokenCorpus(tmp_path)


def test_sequences_cut_from_a_prepared_corpus_place_eos_and_drop_the_remainder(tmp_path):
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    corpus = corpus_of(tmp_path, docs, [2, 1])
    # stream: 1 2 3 E 4 5 E 6 7 8 9 E (12 tokens) -> 3 sequences of 4, nothing left
    sequences = PackedDataset.from_corpus(corpus, seq_len=3)
    assert len(sequences) == 3
    assert sequences.rows([0, 1, 2]).tolist() == [[1, 2, 3, EOS], [4, 5, EOS, 6], [7, 8, 9, EOS]]
    # 12 tokens -> 2 sequences of 5, remainder of 2 dropped; sequence 1 crosses from shard 0 into shard 1
    sequences = PackedDataset.from_corpus(corpus, seq_len=4)
    assert len(sequences) == 2 and sequences.rows([1, 0]).tolist() == [[5, EOS, 6, 7, 8], [1, 2, 3, EOS, 4]]
    assert corpus.document_ends().tolist() == [4, 7, 12]
    with pytest.raises(IndexError):
        sequences.rows([2])


def test_corpus_sequences_equal_in_memory_packing_for_any_sharding_and_seq_len(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, size=rng.integers(0, 40)).tolist() for _ in range(200)]
    for case, shard_sizes in enumerate(([200], [1, 50, 49, 100], [7] * 28 + [4])):
        (tmp_path / str(case)).mkdir()
        corpus = corpus_of(tmp_path / str(case), docs, shard_sizes)
        for seq_len in (1, 16, 63):
            expected = pack_documents(docs, EOS, seq_len)
            dataset = PackedDataset.from_corpus(corpus, seq_len)
            assert len(dataset) == len(expected)
            np.testing.assert_array_equal(dataset.rows(np.arange(len(dataset))), expected)
    assert len(PackedDataset.from_corpus(corpus_of(tmp_path, [[1, 2]], [1]), 8)) == 0


def test_packed_dataset_batch_shifts_labels():
    sequences = np.arange(30, dtype=np.int32).reshape(3, 10)
    ds = PackedDataset(sequences)
    assert len(ds) == 3 and ds.seq_len == 9 and ds.num_tokens == 30
    x, y = ds.batch(np.array([2, 0]))
    assert x.dtype == torch.int64 and y.dtype == torch.int64 and x.shape == y.shape == (2, 9)
    assert x[0].tolist() == list(range(20, 29)) and y[0].tolist() == list(range(21, 30))
    assert torch.equal(x[:, 1:], y[:, :-1])


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_token_id, tok.name) == (257, 256, "byte")
    text = "héllo wörld — 日本語 🙂\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.size == len(text.encode("utf-8")) and ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode(np.append(ids, tok.eos_token_id)) == text
    assert [a.tolist() for a in tok.encode_batch(["ab", ""])] == [[97, 98], []]


def test_missing_tokenizer_dir(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))


def _save_hf_tokenizer(path, eos_token: str | None = "</s>"):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran to the cat"], trainer)
    extra = {"eos_token": eos_token} if eos_token else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **extra).save_pretrained(path)


def test_hf_tokenizer_from_local_dir(tmp_path):
    _save_hf_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.name == str(tmp_path.resolve())
    assert tok.vocab_size == 11  # 2 specials + 9 distinct words
    assert tok.eos_token_id == 1
    ids = tok.encode("the cat sat")
    assert ids.dtype == np.int32 and ids.size == 3 and tok.eos_token_id not in ids.tolist()
    assert tok.decode(ids) == "the cat sat"
    batch = tok.encode_batch(["the cat sat", "a dog"])
    assert [b.tolist() for b in batch] == [ids.tolist(), tok.encode("a dog").tolist()]


def test_hf_tokenizer_without_eos(tmp_path):
    _save_hf_tokenizer(tmp_path, eos_token=None)
    with pytest.raises(ConfigError, match="data.tokenizer.*EOS"):
        load_tokenizer(str(tmp_path))


# ---------------------------------------------------------------- sources


def test_text_file_is_one_document(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("line one\nline two\n")
    check_data_path(str(f))
    assert list(iter_documents(str(f))) == ["line one\nline two\n"]


def test_folder_nested_sorted(tmp_path):
    (tmp_path / "b" / "c").mkdir(parents=True)
    (tmp_path / "b" / "c" / "z.md").write_text("deep")
    (tmp_path / "b" / "a.py").write_text("print(1)")
    (tmp_path / "a.txt").write_text("top")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "row"}) + "\n")
    check_data_path(str(tmp_path))
    assert list(iter_documents(str(tmp_path))) == ["top", "print(1)", "deep", "row"]
    assert list(iter_documents(str(tmp_path), max_documents=2)) == ["top", "print(1)"]


def test_jsonl_and_missing_field(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"content": "first", "id": 1}, {"content": "", "id": 2}, {"content": "third", "id": 3}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(iter_documents(str(f), text_field="content")) == ["first", "third"]
    with pytest.raises(ConfigError, match=r"data.text_field.*content, id"):
        list(iter_documents(str(f)))


def test_chat_data_read_as_text_says_set_data_format_chat(tmp_path):
    """Records with a ``messages`` (or ``conversations``) list, read as text documents: the error says it is chat
    data and names data.format=chat (and data.messages_field where the field is not the default)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for field, fix in [("messages", ""), ("conversations", " and data.messages_field=conversations")]:
        f = tmp_path / f"{field}.jsonl"
        f.write_text(json.dumps({"id": 1, field: turns}) + "\n")
        with pytest.raises(ConfigError) as err:
            list(iter_documents(str(f)))
        assert str(err.value) == (
            f"data.text_field: 'text' is not in {f}:1; it looks like chat data ({field}): set data.format=chat{fix}"
        )
        with pytest.raises(ConfigError, match=rf"'{field}' in {f}:1 is list, not text; it looks like chat data"):
            list(iter_documents(str(f), text_field=field))
    pq.write_table(pa.table({"messages": [turns]}), tmp_path / "chat.parquet")
    with pytest.raises(ConfigError, match=r"it looks like chat data \(messages\): set data.format=chat$"):
        list(iter_documents(str(tmp_path / "chat.parquet")))
    (tmp_path / "plain.jsonl").write_text(json.dumps({"messages": "not a list", "id": 1}) + "\n")
    with pytest.raises(ConfigError, match=r"available fields: id, messages; set data.text_field$"):
        list(iter_documents(str(tmp_path / "plain.jsonl")))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": ["x", "yy", "zzz"], "n": [1, 2, 3]}), f)
    check_data_path(str(f))
    assert list(iter_documents(str(f), text_field="body")) == ["x", "yy", "zzz"]
    with pytest.raises(ConfigError, match=r"data.text_field.*body, n"):
        list(iter_documents(str(f)))


def test_saved_datasets_dir(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["one", "two", "three"], "label": [0, 1, 0]})
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds.select([2, 1])}).save_to_disk(str(tmp_path / "dd"))
    check_data_path(str(tmp_path / "ds"))
    assert list(iter_documents(str(tmp_path / "ds"))) == ["one", "two", "three"]
    assert list(iter_documents(str(tmp_path / "dd"))) == ["three", "two"]
    with pytest.raises(ConfigError, match=r"data.text_field.*label, text"):
        list(iter_documents(str(tmp_path / "ds"), text_field="body"))


@pytest.mark.parametrize("spec", ["missing.txt", "./missing", "/no/such/dir", "~/no-such-meshtron-file.jsonl"])
def test_missing_path(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="data.path.*does not exist"):
        check_data_path(spec)


def test_hub_names_accepted():
    for name in ("org/name", "wikitext", BUILTIN_CORPUS):
        check_data_path(name)
    assert source_fingerprint("org/name") == "hub:org/name"


def test_empty_file_and_folder(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="data.path.*empty file"):
        check_data_path(str(tmp_path / "empty.txt"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "data.bin").write_bytes(b"123")
    (tmp_path / "folder" / "blank.txt").write_text("")
    with pytest.raises(ConfigError, match="data.path.*no non-empty"):
        check_data_path(str(tmp_path / "folder"))


def test_builtin_corpus_deterministic():
    docs = list(iter_documents(BUILTIN_CORPUS))
    assert len(docs) > 100 and all(docs)
    assert list(iter_documents(BUILTIN_CORPUS, max_documents=50)) == docs[:50]
    assert BUILTIN_CORPUS in source_fingerprint(BUILTIN_CORPUS)


def test_fingerprint_changes_with_data(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("abc")
    before = source_fingerprint(str(tmp_path))
    assert source_fingerprint(str(tmp_path)) == before
    f.write_text("abcd")
    assert source_fingerprint(str(tmp_path)) != before


# ---------------------------------------------------------------- schedule


def test_schedule_slices_match_global_batch():
    """Every layout trains on exactly the global batch's sequences, each once."""
    sched = GlobalBatchSchedule(num_samples=37, global_batch_size=8, shuffle=True, seed=3)
    for step in (0, 1, 4, 9):
        full = sched.global_batch(step)
        assert full.shape == (8,)
        for dp in (1, 2, 4):
            for micro in [m for m in range(1, 8 // dp + 1) if (8 // dp) % m == 0]:
                parts = [mb for rank in range(dp) for mb in sched.local_micro_batches(step, rank, dp, micro)]
                assert all(len(mb) == micro for mb in parts)
                assert len(parts) == 8 // micro
                np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.sort(full))
    with pytest.raises(ValueError):
        sched.local_micro_batches(0, 0, 2, 3)


def test_schedule_global_micro_batches_do_not_depend_on_the_layout():
    """Accumulation step i of every rank covers the i-th A-th of the global batch (the router loss's global
    micro-batch): the same sequences as a one-process run with the same accumulation A, rank r taking the
    r-th slice of them."""
    sched = GlobalBatchSchedule(num_samples=37, global_batch_size=16, shuffle=True, seed=5)
    for step in (0, 3):
        full = sched.global_batch(step)
        for accumulation in (1, 2, 4, 8):
            one_process = sched.local_micro_batches(step, 0, 1, 16 // accumulation)
            assert len(one_process) == accumulation
            for dp in (2, 4, 8, 16):
                if 16 % (dp * accumulation):
                    continue
                micro = 16 // (dp * accumulation)
                per_rank = [sched.local_micro_batches(step, rank, dp, micro) for rank in range(dp)]
                assert all(len(batches) == accumulation for batches in per_rank)
                for i in range(accumulation):
                    together = np.concatenate([per_rank[rank][i] for rank in range(dp)])
                    np.testing.assert_array_equal(together, one_process[i])
                    np.testing.assert_array_equal(together, full[i * dp * micro : (i + 1) * dp * micro])
    # Without accumulation rank r's micro-batch is its contiguous r-th slice, as before.
    np.testing.assert_array_equal(sched.local_micro_batches(0, 1, 4, 4)[0], sched.global_batch(0)[4:8])
    # With it, rank 1 of 2 with micro-batches of 2 takes positions 2-3, 6-7, 10-11, 14-15.
    np.testing.assert_array_equal(
        np.concatenate(sched.local_micro_batches(0, 1, 2, 2)), sched.global_batch(0)[[2, 3, 6, 7, 10, 11, 14, 15]]
    )


def test_schedule_seeds_and_epochs():
    a = GlobalBatchSchedule(10, 4, shuffle=True, seed=0)
    b = GlobalBatchSchedule(10, 4, shuffle=True, seed=0)
    c = GlobalBatchSchedule(10, 4, shuffle=True, seed=1)
    first = a.indices(0, 30)
    np.testing.assert_array_equal(first, b.indices(0, 30))
    assert not np.array_equal(first, c.indices(0, 30))
    for e in range(3):  # each epoch is a permutation, and the epochs differ
        assert sorted(first[e * 10 : (e + 1) * 10].tolist()) == list(range(10))
    assert not np.array_equal(first[:10], first[10:20])
    # step 2 covers positions 8..11: the end of epoch 0 and the start of epoch 1
    np.testing.assert_array_equal(a.global_batch(2), np.concatenate([first[8:10], first[10:12]]))
    np.testing.assert_array_equal(a.indices(5, 17), first[5:22])
    plain = GlobalBatchSchedule(10, 4, shuffle=False, seed=0)
    assert plain.indices(8, 4).tolist() == [8, 9, 0, 1]


# ---------------------------------------------------------------- cached dataset


def _corpus(tmp_path, n_chars: int):
    f = tmp_path / "corpus.txt"
    f.write_text("x" * n_chars)
    return f


def test_build_packed_dataset_caches(tmp_path, monkeypatch):
    f = _corpus(tmp_path, 999)  # 999 bytes + EOS = 1000 tokens -> 15 sequences of 65
    cfg = DataConfig(path=str(f), seq_len=64, cache_dir=str(tmp_path / "cache"))
    tok = ByteTokenizer()
    calls = []
    ds = build_packed_dataset(cfg, tok, is_builder=True, barrier=lambda: calls.append(1))
    assert calls == [1] and len(ds) == 15 and ds.seq_len == 64
    assert ds.path == cache_path(cfg, tok) and (ds.path / MANIFEST).is_file()
    assert ds.rows([0])[0, 0] == ord("x") and ds.rows([14])[0, -1] == ord("x")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [ds.path.name]  # nothing half-built left
    manifest = json.loads((ds.path / MANIFEST).read_text())
    assert manifest["dtype"] == "uint16" and manifest["tokens"] == 1000 and manifest["documents"] == 1

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt although the cache exists")

    monkeypatch.setattr(dataset_mod, "_build", no_build)
    mtime = (ds.path / MANIFEST).stat().st_mtime_ns
    again = build_packed_dataset(cfg, tok, is_builder=True)
    assert again.path == ds.path and (ds.path / MANIFEST).stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.rows(range(15)), ds.rows(range(15)))
    # a non-builder only loads
    assert len(build_packed_dataset(cfg, tok, is_builder=False)) == 15
    # another seq_len reuses the same tokens (no new build: _build would raise)
    shorter = build_packed_dataset(DataConfig(path=str(f), seq_len=31, cache_dir=cfg.cache_dir), tok, is_builder=True)
    assert shorter.path == ds.path and len(shorter) == 31


def test_cache_dir_default_respects_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = cache_path(DataConfig(path=str(_corpus(tmp_path, 10))), ByteTokenizer())
    assert path.parent == tmp_path / "xdg" / "meshtron" and len(path.name) == 16


def test_zero_sequences_error_on_every_rank(tmp_path):
    f = _corpus(tmp_path, 20)
    cfg = DataConfig(path=str(f), seq_len=64, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(MeshtronError, match=r"data.path.*21 tokens.*data.seq_len") as err:
        build_packed_dataset(cfg, ByteTokenizer(), is_builder=True)
    assert "lower data.seq_len" in str(err.value)
    with pytest.raises(MeshtronError, match=r"21 tokens"):
        build_packed_dataset(cfg, ByteTokenizer(), is_builder=False)
    assert (cache_path(cfg, ByteTokenizer()) / MANIFEST).is_file()


def _slow_build(monkeypatch, seconds: float) -> threading.Event:
    """Make the cache build take ``seconds`` longer; the event is set when a build starts."""
    started, real_build = threading.Event(), dataset_mod._build

    def slow(*args):
        started.set()
        time.sleep(seconds)
        real_build(*args)

    monkeypatch.setattr(dataset_mod, "_build", slow)
    return started


def test_non_builders_wait_for_the_file_outside_any_collective(tmp_path, monkeypatch):
    """The other processes poll for the file the builder renames into place (no barrier, no collective
    timeout); two builders of one file (machines sharing data.cache_dir) both succeed."""
    cfg = DataConfig(path=str(_corpus(tmp_path, 999)), seq_len=64, cache_dir=str(tmp_path / "cache"))
    started = _slow_build(monkeypatch, 0.5)
    built = []
    builders = [
        threading.Thread(
            target=lambda: built.append(
                len(build_packed_dataset(cfg, ByteTokenizer(), is_builder=True, run_id="run-1"))
            ),
            daemon=True,
        )
        for _ in range(2)
    ]
    for builder in builders:
        builder.start()
    assert started.wait(10)
    waiting = build_packed_dataset(cfg, ByteTokenizer(), is_builder=False, run_id="run-1")
    for builder in builders:
        builder.join(30)
    assert len(waiting) == 15 and built == [15, 15]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cache_path(cfg, ByteTokenizer()).name]


def test_non_builders_stop_with_the_builders_error(tmp_path, monkeypatch):
    """A failed build is reported to the waiting processes of the same run; an earlier run's is ignored."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"content": "x" * 200}) + "\n")
    cfg = DataConfig(path=str(data), seq_len=16, cache_dir=str(tmp_path / "cache"))
    marker = cache_path(cfg, ByteTokenizer()).with_suffix(".failed")
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"run": "an-earlier-run", "kind": "ConfigError", "error": "stale"}))
    waited = []

    def waiter():
        try:
            build_packed_dataset(cfg, ByteTokenizer(), is_builder=False, run_id="run-2")
        except ConfigError as err:
            waited.append(str(err))

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.3)  # the waiter sees the earlier run's report and goes on waiting
    assert thread.is_alive() and not waited
    with pytest.raises(ConfigError, match=r"data.text_field.*content") as err:
        build_packed_dataset(cfg, ByteTokenizer(), is_builder=True, run_id="run-2")
    thread.join(30)
    assert waited == [str(err.value)]


# ---------------------------------------------------------------- prefetch


def test_step_reader_gives_the_same_inputs_with_and_without_read_ahead(tmp_path):
    """Step by step, through a batch skipped after its read ahead (as a rollback does) and a jump back to an
    earlier step: the read-ahead inputs equal those read on the spot, and a stale read ahead is not used."""
    from meshtron.data.prefetch import StepReader, StepSequences
    from meshtron.train.step_stats import global_target_count

    dataset = PackedDataset(np.arange(40 * 9, dtype=np.int32).reshape(40, 9))
    schedules = [GlobalBatchSchedule(40, 4, shuffle=True, seed=3) for _ in range(2)]

    def reader(schedule, prefetch):
        def sequences(step):
            return StepSequences(tuple(schedule.local_micro_batches(step, 1, 2, 1)), schedule.global_batch(step))

        return StepReader(dataset, sequences, global_target_count, prefetch=prefetch)

    ahead, plain = reader(schedules[0], True), reader(schedules[1], False)
    on_the_spot = []  # reads in the caller's thread: a step whose sequences were not read ahead
    original = ahead.read
    ahead.read = lambda sequences: (
        threading.current_thread() is threading.main_thread() and on_the_spot.append(1) or original(sequences)
    )
    for step in (0, 1, 2, "skip", 3, 4, 1, 2):
        if step == "skip":  # after step 3's sequences were read ahead, batch 4 leaves the order
            for schedule in schedules:
                schedule.skip([4])
            continue
        got, want = ahead.get(step), plain.get(step)
        assert got.global_targets == want.global_targets == 4 * 8
        assert len(got.micro_batches) == len(want.micro_batches) == 2
        for (ids, labels), (want_ids, want_labels) in zip(got.micro_batches, want.micro_batches):
            assert torch.equal(ids, want_ids) and torch.equal(labels, want_labels)
    # the first step, and the re-reads after the skip and after the jump back; every other step was read ahead
    assert len(on_the_spot) == 3
    ahead.close()
    plain.close()


# ---------------------------------------------------------------- mixtures


def test_mixture_order_holds_the_weights_and_any_window_is_a_slice_of_it():
    """Over 1,000 global batches of 8 each source gives its weight's share (within one sample, far inside 2%);
    any window of positions (a step, a resumed step) is the same slice of the one order; within a source the
    samples follow its own shuffled epochs."""
    from meshtron.data.mixture import MixtureSchedule

    sizes, weights = [1000, 300, 50], [0.7, 0.2, 0.1]
    schedule = MixtureSchedule(sizes, weights, 8, shuffle=True, seed=5)
    order = np.concatenate([schedule.global_batch(step) for step in range(1000)])
    source = np.searchsorted(np.cumsum([0] + sizes), order, side="right") - 1
    counts = np.bincount(source, minlength=3)
    assert np.all(np.abs(counts - 8000 * np.array(weights)) <= 1), counts
    for start in (0, 1, 7, 777, 4321):
        np.testing.assert_array_equal(schedule.indices(start, 40), order[start : start + 40])
    math_samples = order[source == 2] - 1300  # source 2's 50 sequences: each epoch a permutation of them
    assert sorted(math_samples[:50]) == list(range(50)) and sorted(math_samples[50:100]) == list(range(50))
    assert not np.array_equal(math_samples[:50], math_samples[50:100])
    again = MixtureSchedule(sizes, weights, 8, shuffle=True, seed=5)
    np.testing.assert_array_equal(again.global_batch(999), schedule.global_batch(999))
    assert not np.array_equal(MixtureSchedule(sizes, weights, 8, True, seed=6).global_batch(0), order[:8])
    counts = schedule.counts_before(10**9)  # a far step: found without walking the order
    assert counts.sum() == 10**9 and np.all(np.abs(counts - 10**9 * np.array(weights)) <= 1)


def test_mixture_settings_are_checked(tmp_path):
    from meshtron.config import load_config
    from meshtron.data.mixture import MixedDataset, parse_sources
    from meshtron.train.setup.preflight import check_data_sources

    assert parse_sources(["/data/web:7", "/data/code:3"]) == [("/data/web", 0.7), ("/data/code", 0.3)]
    for bad in ("/data/web", "/data/web:0", "/data/web:lots"):
        with pytest.raises(ConfigError, match="is not PATH:WEIGHT with a positive weight"):
            parse_sources([bad])
    corpus = _corpus(tmp_path, 50)
    both = load_config(None, [f"data.path={corpus}", f"data.sources={corpus}:1"], env={}).data
    with pytest.raises(ConfigError, match="data.path and data.sources are both set"):
        check_data_sources(both)
    missing = load_config(None, [f"data.sources={corpus}:1,{tmp_path / 'nowhere.jsonl'}:1"], env={}).data
    with pytest.raises(ConfigError, match="nowhere.jsonl' does not exist"):
        check_data_sources(missing)
    mixed = MixedDataset(
        [PackedDataset(np.zeros((2, 5), dtype=np.int32)), PackedDataset(np.ones((3, 5), dtype=np.int32))]
    )
    assert len(mixed) == 5 and mixed.rows([4, 0, 2]).tolist() == [[1] * 5, [0] * 5, [1] * 5]


def test_batch_sizes_ramp_up_in_steps_of_start_and_follow_on_after_a_rebase():
    """train.batch_rampup=2:3 to 8: batches of 2, 4, 6, then 8, back to back in the data order; a checkpoint after
    batch 3 (position 12) resumed with batches of 4 goes on at 12."""
    from meshtron.data.sampler import BatchSizes

    ramp = BatchSizes(8, (2, 3))
    assert [ramp.size(b) for b in range(1, 7)] == [2, 4, 6, 8, 8, 8]
    assert [ramp.start(b) for b in range(1, 7)] == [0, 2, 6, 12, 20, 28]
    slow = BatchSizes(8, (2, 6))  # more steps than sizes: each size held for two steps
    assert [slow.size(b) for b in range(1, 9)] == [2, 2, 4, 4, 6, 6, 8, 8]
    plain = BatchSizes(4)
    plain.rebase(3, ramp.start(4))
    assert [plain.start(b) for b in (4, 5, 6)] == [12, 16, 20] and plain.size(4) == 4
    with pytest.raises(ValueError, match="before the resumed position"):
        plain.start(3)
    schedule = GlobalBatchSchedule(100, 8, True, 0, BatchSizes(8, (2, 3)))
    batches = [schedule.global_batch(step) for step in range(5)]
    assert [len(b) for b in batches] == [2, 4, 6, 8, 8]
    assert np.array_equal(np.concatenate(batches), schedule.indices(0, 28))
    assert [len(m) for m in schedule.local_micro_batches(1, 0, 2, 1)] == [1, 1]  # 4 sequences over 2 ranks
    assert schedule.position_after(3) == (3, 12)


def _stream_positions(dataset: PackedDataset, indices) -> np.ndarray:
    """Every stream position the sequences ``indices`` hold, in reading order."""
    return np.concatenate(
        [np.arange(a, b) for index in indices for a, b in dataset.sequence_ranges(int(index))] or [np.zeros(0, int)]
    )


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_resume_with_another_seq_len_trains_the_rest_of_the_epoch_once(tmp_path, shuffle):
    """Sequences of 16 + 1 tokens, 13 of them trained (epoch 1 of a seed-3 order), then data.seq_len=25: the carry
    holds every stream token the first 13 did not, each once, but its last incomplete sequence; its sequences read
    those tokens; the order goes on with whole epochs of 25 + 1. A second change (to 7) inside the carry
    carries what the first carry had not trained, and so on to the end of the epoch."""
    from meshtron.data.carry import replay_changes, resume_with_changes, stream_ranges

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 90, size=rng.integers(1, 30)).tolist() for _ in range(60)]
    corpus = corpus_of(tmp_path, docs, [25, 35])
    stream = corpus.read(0, corpus.num_tokens)
    old = PackedDataset.from_corpus(corpus, 16)
    old_order = GlobalBatchSchedule(len(old), 4, shuffle, 3)
    epoch_start = len(old)  # positions [len, len + 13) of the data order: epoch 1
    trained = _stream_positions(old, old_order.indices(epoch_start, 13))

    changes = [[epoch_start + 13, 16, 25]]
    new = PackedDataset.from_corpus(corpus, 25)
    order = GlobalBatchSchedule(len(new), 4, shuffle, 3)
    resume_with_changes(new, order, changes, shuffle, 3)
    carry = order.carry
    assert carry is new.carry and carry.start == epoch_start + 13 and carry.next_epoch == 2
    carried = _stream_positions(new, order.indices(carry.start, carry.count))
    assert len(np.intersect1d(carried, trained)) == 0 and len(np.unique(carried)) == len(carried)
    left_out = np.setdiff1d(np.arange(corpus.num_tokens), np.concatenate([trained, carried]))
    assert len(left_out) < 26 and len(carried) == carry.count * 26
    for number in range(carry.count):  # the look-up a read uses = the general mapping of stream ranges
        window = np.array([[number * 26, (number + 1) * 26]])
        assert np.array_equal(carry.sequence_ranges(number), stream_ranges(carry.intervals, window))
    rows = new.rows(order.indices(carry.start, carry.count))
    assert np.array_equal(rows.ravel(), stream[carried])  # each carried sequence reads its stream positions
    assert carry.count > 0 and (order.indices(carry.start, carry.count) >= len(new)).all()
    after = order.indices(carry.end, len(new))  # epoch 2 of the new length, whole
    assert np.array_equal(after, GlobalBatchSchedule(len(new), 4, shuffle, 3).epoch_order(2))
    with pytest.raises(ValueError, match="before the resumed position"):
        order.indices(carry.start - 1, 1)

    # A second change, to 7, after 5 carried sequences: the untrained rest of the carry, cut into sequences of 8.
    second = [*changes, [carry.start + 5, 25, 7]]
    shortest = PackedDataset.from_corpus(corpus, 7)
    again = GlobalBatchSchedule(len(shortest), 4, shuffle, 3)
    resume_with_changes(shortest, again, second, shuffle, 3)
    trained_before = np.concatenate([trained, carried[: 5 * 26]])
    recarried = _stream_positions(shortest, again.indices(again.carry.start, again.carry.count))
    assert len(np.intersect1d(recarried, trained_before)) == 0 and len(np.unique(recarried)) == len(recarried)
    assert len(np.setdiff1d(np.arange(corpus.num_tokens), np.concatenate([trained_before, recarried]))) < 8
    assert again.carry.next_epoch == 2
    assert replay_changes(second, shortest.stream_tokens, shuffle, 3).order.tolist() == again.carry.order.tolist()


# ---------------------------------------------------------------- optional packages (pyproject.toml's extras)


def block_imports(monkeypatch, *modules: str) -> None:
    """As if ``modules`` were not installed: importing them raises ModuleNotFoundError."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_sources_without_the_data_extra_name_it(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["x"]}), parquet)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    block_imports(monkeypatch, "datasets", "pyarrow", "pyarrow.parquet")
    for source, what in ((parquet, "Parquet"), (saved, "saved dataset"), ("org/name", "hub dataset")):
        with pytest.raises(ConfigError, match=rf"data.path: .*{what}.*pip install 'meshtron\[data\]'") as err:
            list(iter_documents(str(source)))
        assert "\n" not in str(err.value)


def test_streaming_without_the_data_extra_names_it(monkeypatch):
    from meshtron.data.streaming import open_stream

    block_imports(monkeypatch, "datasets")
    with pytest.raises(ConfigError, match=r"data.streaming needs the datasets package.*pip install 'meshtron\[data\]'"):
        open_stream(BUILTIN_CORPUS, "text")


def test_a_broken_package_is_not_called_missing(tmp_path, monkeypatch):
    """An installed package that fails to import a package of its own keeps its own error; a missing one names
    the extra."""
    from meshtron.errors import import_extra

    (tmp_path / "meshtron_test_needs_pyarrow.py").write_text("import pyarrow\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    block_imports(monkeypatch, "pyarrow")
    with pytest.raises(ModuleNotFoundError, match="pyarrow"):
        import_extra("meshtron_test_needs_pyarrow", needed_by="x", extra="y")
    with pytest.raises(ConfigError, match=r"^x needs the meshtron_test_absent package.*'meshtron\[y\]'"):
        import_extra("meshtron_test_absent", needed_by="x", extra="y")
