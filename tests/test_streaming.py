"""Streamed data (data.streaming): lanes, the split across ranks, the saved position, sources and settings.

Training parity (DDP2 and DP2 x TP2 vs one process) is in test_parity.py; exact resume of a streamed run, under
the same layout and under another, in test_checkpoint.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshtron.config import DataConfig
from meshtron.data import streaming
from meshtron.data.streaming import StreamingDataset, StreamSchedule, check_stream_checkpoint, open_stream
from meshtron.data.tokenizer import ByteTokenizer
from meshtron.errors import ConfigError, MeshtronError

G, SEQ = 4, 24
WIDTH = SEQ + 1


def documents(count: int = 90) -> list[str]:
    """Texts of 1 to ~60 bytes; every 7th line of the file is empty (skipped, not counted)."""
    rng = np.random.default_rng(3)
    return [" ".join(f"d{i}w{j}" for j in range(int(rng.integers(1, 12)))) for i in range(count)]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = []
    for i, text in enumerate(documents()):
        if i % 7 == 3:
            lines.append(json.dumps({"text": ""}))
        lines.append(json.dumps({"text": text, "id": i}))
    path.write_text("\n".join(lines) + "\n")
    return path


def stream(path, lanes=range(G), max_documents=None) -> StreamingDataset:
    dataset = StreamingDataset(DataConfig(path=str(path), seq_len=SEQ, max_documents=max_documents), ByteTokenizer(), G)
    dataset.own(lanes)
    return dataset


def expected_batches(texts: list[str], batches: int) -> list[np.ndarray]:
    """The definition, written out: each document (epochs repeat the list) to the lane dealt the fewest characters
    so far (lowest on ties), its bytes and EOS appended to that lane; batch n is sequence n of lanes 0..G-1."""
    chars, lanes, i = [0] * G, [[] for _ in range(G)], 0
    while min(len(lane) for lane in lanes) < batches * WIDTH:
        text = texts[i % len(texts)]
        i += 1
        lane = chars.index(min(chars))
        chars[lane] += len(text)
        lanes[lane] += list(text.encode()) + [ByteTokenizer.eos_token_id]
    return [np.array([lane[n * WIDTH : (n + 1) * WIDTH] for lane in lanes]) for n in range(batches)]


def global_batch(n: int, lanes=range(G)) -> list[int]:
    return [n * G + j for j in lanes]


def test_lanes_follow_the_definition_across_epochs(source):
    """max_documents=25 ends each epoch after 25 documents, so 60 batches read the stream several times over."""
    want = expected_batches(documents()[:25], 60)
    dataset = stream(source, max_documents=25)
    for n in range(60):
        assert np.array_equal(dataset.rows(global_batch(n)), want[n]), f"batch {n + 1}"
    assert dataset.reader.epoch >= 3
    # Lanes stay within one document's characters of each other.
    assert dataset.reader.chars.max() - dataset.reader.chars.min() <= max(len(t) for t in documents())


def test_ranks_splitting_the_lanes_read_the_batches_of_one_process_and_tokenize_only_their_documents(source):
    whole = stream(source)
    want = [whole.rows(global_batch(n)) for n in range(30)]
    ranks = [stream(source, lanes) for lanes in ([0, 2], [1, 3])]
    for n in range(30):
        for rank, lanes in zip(ranks, ([0, 2], [1, 3])):
            assert np.array_equal(rank.rows(global_batch(n, lanes)), want[n][lanes])
    tokenized = [rank.tokenized_documents for rank in ranks]
    assert sum(tokenized) <= whole.tokenized_documents + 2 and min(tokenized) < whole.tokenized_documents * 0.7


def test_the_global_batches_are_the_schedules_positions():
    schedule = StreamSchedule(G)
    assert schedule.global_batch(0).tolist() == [0, 1, 2, 3] and schedule.global_batch(5).tolist() == [20, 21, 22, 23]
    schedule.skip([2])
    assert schedule.global_batch(1).tolist() == [8, 9, 10, 11]  # batch 2 is left out: lanes skip a sequence
    assert schedule.local_micro_batches(1, 1, 2, 1) == [[9], [11]]


@pytest.mark.parametrize("resumed_lanes", [[[0, 1, 2, 3]], [[0, 2], [1, 3]], [[3], [0, 1, 2]]])
def test_a_saved_position_resumes_exactly_under_any_split_of_the_lanes(source, monkeypatch, resumed_lanes):
    """Two ranks (lanes 0, 2 and 1, 3) save their position before batch 23 after one has read batch 23 ahead;
    ranks of another split continue from the two files exactly. Snapshots every 8 documents: the resume starts
    from one the stream's own state_dict() positions (not the beginning), across an epoch boundary."""
    monkeypatch.setattr(streaming, "SNAPSHOT_EVERY", 8)
    want = expected_batches(documents()[:30], 45)
    saving = [stream(source, lanes, max_documents=30) for lanes in ([0, 2], [1, 3])]
    for n in range(22):
        for rank, lanes in zip(saving, ([0, 2], [1, 3])):
            rank.rows(global_batch(n, lanes))
    saving[0].rows(global_batch(22, [0, 2]))  # read ahead (data.prefetch)
    states = json.loads(json.dumps([rank.state(22) for rank in saving]))  # through the checkpoint's files
    assert all(s["snapshot"]["document"] > 0 and s["snapshot"]["stream"] is not None for s in states)
    assert min(s["snapshot"]["epoch"] for s in states) >= 1
    for lanes in resumed_lanes:
        resumed = stream(source, lanes, max_documents=30)
        resumed.restore(states)
        for n in range(22, 45):
            assert np.array_equal(resumed.rows(global_batch(n, lanes)), want[n][lanes]), f"lanes {lanes}, batch {n + 1}"


def test_lanes_skip_batches_and_go_back_a_few(source):
    want = expected_batches(documents(), 12)
    dataset = stream(source)
    dataset.rows(global_batch(0))
    assert np.array_equal(dataset.rows(global_batch(4)), want[4])  # batches 2-4 skipped
    for n in range(5, 10):
        dataset.rows(global_batch(n))
    assert np.array_equal(dataset.rows(global_batch(7)), want[7])  # a stale read ahead after a rollback
    assert np.array_equal(dataset.rows(global_batch(8)), want[8])
    with pytest.raises(MeshtronError, match="no longer known"):
        dataset.state(1)


def test_restore_refuses_another_batch_size_or_source(source, tmp_path):
    state = stream(source).state(0)
    other = StreamingDataset(DataConfig(path=str(source), seq_len=SEQ), ByteTokenizer(), 8)
    other.own(range(8))
    with pytest.raises(ConfigError, match="global_batch_size"):
        other.restore([state])
    moved = tmp_path / "moved.jsonl"
    moved.write_text(source.read_text())
    with pytest.raises(ConfigError, match="resume with those"):
        stream(moved).restore([state])


def test_sources_stream_in_the_prepared_paths_order(tmp_path):
    """Text files are one document each (as `data prepare` reads them), in sorted order; parquet and saved datasets
    by rows; a folder mixing kinds and a missing column are one-line errors."""
    import datasets

    folder = tmp_path / "text"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_text("first\nfile")
    (folder / "b" / "c.md").write_text("second")
    ds, field = open_stream(str(folder), "ignored")
    assert [row[field] for row in ds] == ["first\nfile", "second"]

    table = datasets.Dataset.from_dict({"body": ["x", "yy", "zzz"]})
    table.to_parquet(str(tmp_path / "rows.parquet"))
    ds, field = open_stream(str(tmp_path / "rows.parquet"), "body")
    assert [row[field] for row in ds] == ["x", "yy", "zzz"]
    table.save_to_disk(str(tmp_path / "saved"))
    ds, field = open_stream(str(tmp_path / "saved"), "body")
    assert [row[field] for row in ds] == ["x", "yy", "zzz"]

    with pytest.raises(ConfigError, match="data.text_field: 'text' is not in"):
        open_stream(str(tmp_path / "rows.parquet"), "text")
    (folder / "d.jsonl").write_text('{"text": "j"}\n')
    with pytest.raises(ConfigError, match="mixes json and text files"):
        open_stream(str(folder), "text")


def test_streaming_settings_and_checkpoints_are_checked(tmp_path):
    from meshtron.data.prepare import prepare_corpus
    from meshtron.train.setup.preflight import check_data_sources

    (tmp_path / "a.txt").write_text("some text " * 20)
    with pytest.raises(ConfigError, match="not a mixture"):
        check_data_sources(DataConfig(streaming=True, sources=[f"{tmp_path}/a.txt:1"]))
    prepare_corpus(DataConfig(path=str(tmp_path / "a.txt")), tmp_path / "prepared")
    with pytest.raises(ConfigError, match="prepared directory"):
        check_data_sources(DataConfig(streaming=True, path=str(tmp_path / "prepared")))

    checkpoint = tmp_path / "step-00000004"
    checkpoint.mkdir()
    with pytest.raises(ConfigError, match="saved without data.streaming"):
        check_stream_checkpoint(checkpoint, streaming=True)
    check_stream_checkpoint(checkpoint, streaming=False)
    (checkpoint / streaming.STATE_FILE.format(rank=0)).write_text("{}")
    with pytest.raises(ConfigError, match="resume it with data.streaming=true"):
        check_stream_checkpoint(checkpoint, streaming=False)
    check_stream_checkpoint(checkpoint, streaming=True)
    check_stream_checkpoint(None, streaming=True)
