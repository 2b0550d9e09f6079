"""Chat fine-tuning data (data.format=chat): the assistant-token mask, packing without cutting conversations, the
first step's loss against a cross-entropy by hand, the settings, and the chat template through export and
``generate --chat``. Parity under DDP2 / FSDP2 / TP2 / PP2 / CP2 is in test_parity.py (the llama-chat reference)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chat_fixture import CHAT_DATA, CHAT_MODEL, write_chat_fixture
from conftest import run_main

from meshtron.config import load_config
from meshtron.data.chat import ChatDataset, build_chat_dataset, choose_separator, iter_conversations, pack, render
from meshtron.data.tokenizer import load_tokenizer
from meshtron.errors import ConfigError


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat")
    write_chat_fixture(directory)
    return directory


def test_only_the_assistants_tokens_and_their_end_of_turn_carry_loss(chat_dir):
    tokenizer = load_tokenizer(str(chat_dir / CHAT_MODEL))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "why?"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "how"},
        {"role": "assistant", "content": "no red"},
    ]
    ids, trained = render(tokenizer, messages, "assistant")
    assert (
        tokenizer.decode(ids)
        == "<system>be brief</s><user>why?</s><assistant>yes</s><user>how</s><assistant>no red</s>"
    )
    assert tokenizer.decode(ids[trained]) == "yes</s>no red</s>"
    ids_all, trained_all = render(tokenizer, messages, "all")
    assert np.array_equal(ids_all, ids) and trained_all.all()
    # The template ends turns with EOS, so EOS cannot separate conversations: the highest id none of them uses does.
    conversations = [(ids, trained)]
    assert choose_separator(tokenizer, conversations) == tokenizer.vocab_size - 1  # "~"
    no_eos = [(ids[ids != tokenizer.eos_token_id], trained[ids != tokenizer.eos_token_id])]
    assert choose_separator(tokenizer, no_eos) == tokenizer.eos_token_id


def test_packing_never_cuts_a_conversation_and_pads_without_loss():
    eos = 9  # the separator
    convs = [
        (np.array([1, 2, 3]), np.array([0, 1, 1], bool)),
        (np.array([4, 5]), np.array([0, 1], bool)),
        (np.array([6, 7, 8, 6, 7, 8, 6]), np.ones(7, bool)),
    ]
    tokens, trained, cut = pack(convs, 6, eos)
    assert tokens.tolist() == [[1, 2, 3, eos, eos, eos], [4, 5, eos, eos, eos, eos], [6, 7, 8, 6, 7, 8]]
    assert trained.tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]] and cut == 1
    inputs, labels = ChatDataset(tokens, trained).batch([0])
    assert inputs.tolist() == [[1, 2, 3, eos, eos]] and labels.tolist() == [[2, 3, -100, -100, -100]]


def chat_overrides(chat_dir, out, *extra) -> list[str]:
    return [
        f"model.name_or_path={chat_dir / CHAT_MODEL}",
        f"data.tokenizer={chat_dir / CHAT_MODEL}",
        "data.format=chat",
        f"data.path={chat_dir / CHAT_DATA}",
        "data.seq_len=128",
        "train.global_batch_size=8",
        "train.steps=1",
        "run.progress=false",
        f"run.output_dir={out}",
        *extra,
    ]


@pytest.fixture(scope="module")
def chat_runs(chat_dir, tmp_path_factory):
    """One-step chat fine-tunes in this process, each checkpointing its step, trained the first time a test asks
    for its overrides: ``chat_runs(*extra)`` is (config, train's result, run directory)."""
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    done = {}

    def run(*extra: str):
        if extra not in done:
            out = tmp_path_factory.mktemp("chat-run") / "run"
            cfg = load_config(None, chat_overrides(chat_dir, out, "checkpoint.interval=1", *extra), env={})
            done[extra] = cfg, train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))), out
        return done[extra]

    return run


@pytest.mark.parametrize("mask_documents", [True, False])
def test_the_first_steps_loss_is_the_cross_entropy_of_the_assistants_tokens(chat_dir, chat_runs, mask_documents):
    """One training step in one process; by hand: plain transformers' logits (each conversation of a sequence on
    its own with document masks, the whole sequence without), cross-entropy summed over the assistant positions and
    divided by their count. The all-token loss is another number."""
    from transformers import AutoModelForCausalLM

    from meshtron.data.chat import build_chat_dataset
    from meshtron.data.sampler import GlobalBatchSchedule

    cfg, result, out = chat_runs(f"data.mask_documents={mask_documents}")
    dataset = build_chat_dataset(cfg.data, load_tokenizer(cfg.data.tokenizer))
    batch = GlobalBatchSchedule(len(dataset), 8, cfg.data.shuffle, cfg.data.seed).global_batch(0)
    rows, trained = dataset.tokens[batch], dataset.trained[batch]
    model = AutoModelForCausalLM.from_pretrained(chat_dir / CHAT_MODEL, dtype=torch.float32).eval()
    losses, assistant = [], []
    for row, mask in zip(rows, trained):
        # Segments: each conversation with its separator (document masks), or the whole sequence.
        ends = np.flatnonzero(row[:-1] == dataset.separator) + 1 if mask_documents else np.array([], dtype=np.int64)
        for start, stop in zip([0, *ends], [*ends, len(row) - 1]):
            if stop <= start:
                continue
            with torch.no_grad():  # positions restart at 0 in each segment, as meshtron's document masks have them
                logits = model(torch.from_numpy(row[start:stop][None])).logits[0].double()
            losses.append(F.cross_entropy(logits, torch.from_numpy(row[start + 1 : stop + 1]), reduction="none"))
            assistant.append(torch.from_numpy(mask[start + 1 : stop + 1]))
    losses, assistant = torch.cat(losses), torch.cat(assistant)
    by_hand = (losses[assistant].sum() / assistant.sum()).item()
    assert result.losses[0] == pytest.approx(by_hand, rel=1e-5)
    assert abs(losses.mean().item() - by_hand) > 100 * 1e-5 * by_hand  # the all-token loss differs, far beyond that
    log = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert log["loss"] == result.losses[0]


def test_chat_settings_are_checked(chat_dir, tmp_path):
    from meshtron.train.setup.preflight import preflight

    def check(*extra):
        preflight(load_config(None, chat_overrides(chat_dir, tmp_path / "x", *extra), env={}), 1, "cpu")

    check()
    with pytest.raises(ConfigError, match="chat template"):
        check("data.tokenizer=byte", "model.name_or_path=", "model.preset=llama-tiny")
    with pytest.raises(ConfigError, match="data.streaming=false"):
        check("data.streaming=true")
    with pytest.raises(ConfigError, match="'data.train_on: 'some' is not one of|data.train_on"):
        check("data.train_on=some")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": "hello"}) + "\n")
    from meshtron.data.chat import iter_conversations

    with pytest.raises(ConfigError, match="must be a list of"):
        list(iter_conversations(str(bad), "messages"))
    with pytest.raises(ConfigError, match="data.messages_field: 'turns' is not in"):
        list(iter_conversations(str(chat_dir / CHAT_DATA), "turns"))


def test_a_chat_fine_tune_exports_its_chat_template_and_generate_chat_replies(chat_dir, chat_runs, tmp_path):
    """The export of a chat fine-tune (and a LoRA one's peft adapter) renders and tokenizes conversations as the run's
    tokenizer does: its chat template came along. ``meshtron generate --chat`` (from the export and from the
    checkpoint) prints only the greedy reply to the prompt as one user message: an argmax loop over plain
    transformers' logits from the templated prompt, up to EOS; transformers' progress bars stay off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = AutoTokenizer.from_pretrained(chat_dir / CHAT_MODEL)
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]

    def same_rendering(folder) -> None:
        exported = AutoTokenizer.from_pretrained(folder)
        for generation_prompt in (False, True):
            text = original.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
            assert (
                exported.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
                == text
            )
            assert exported.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)

    checkpoint = chat_runs("data.mask_documents=True")[2] / "checkpoints" / "step-00000001"
    export = tmp_path / "export"
    assert run_main(["export", str(checkpoint), str(export)]).returncode == 0
    same_rendering(export)
    lora = chat_runs("lora.rank=4")[2] / "checkpoints" / "step-00000001"
    assert run_main(["export", str(lora), str(tmp_path / "adapter"), "--adapter"]).returncode == 0
    same_rendering(tmp_path / "adapter")

    new_tokens = 24
    prompt = original.apply_chat_template(
        [{"role": "user", "content": "why?"}], tokenize=False, add_generation_prompt=True
    )

    def greedy_reply(model) -> list[int]:
        ids, reply = torch.tensor([original.encode(prompt, add_special_tokens=False)]), []
        with torch.no_grad():
            while len(reply) < new_tokens:
                token = int(model(ids).logits[0, -1].argmax())
                if token == original.eos_token_id:
                    break
                reply.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        return reply

    def generate_chat(source) -> str:
        proc = run_main(["generate", str(source), "--chat", "--prompt", "why?", "--max-new-tokens", str(new_tokens)])
        assert proc.returncode == 0, proc.stderr
        assert "Loading weights" not in proc.stderr and "Writing" not in proc.stderr, proc.stderr
        return proc.stdout

    model = AutoModelForCausalLM.from_pretrained(export).eval()
    reply = greedy_reply(model)
    assert generate_chat(export) == generate_chat(checkpoint) == original.decode(reply) + "\n"
    # A head that favours EOS (its row: twice the third reply token's) ends the reply early: printed up to EOS.
    with torch.no_grad():
        model.lm_head.weight[original.eos_token_id] = 2 * model.lm_head.weight[reply[2]]
    model.save_pretrained(tmp_path / "ends")
    original.save_pretrained(tmp_path / "ends")
    ending = greedy_reply(model)
    assert len(ending) < new_tokens and generate_chat(tmp_path / "ends") == original.decode(ending) + "\n"


def test_a_role_other_than_system_user_assistant_or_tool_is_refused_naming_the_line(chat_dir, tmp_path):
    """A "bot" message would be rendered but never carry loss: one line naming the file, its line and the role."""
    good = [{"role": r, "content": "hi"} for r in ("system", "user", "assistant", "tool", "assistant")]
    bad = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]
    path = tmp_path / "roles.jsonl"
    path.write_text(f"{json.dumps({'messages': good})}\n\n{json.dumps({'messages': bad})}\n")
    proc = run_main(["train", *(f"--{o}" for o in chat_overrides(chat_dir, tmp_path / "run", f"data.path={path}"))])
    assert proc.returncode != 0 and proc.stderr.strip() == (
        f"meshtron: error: data.path: {path}:3: message 2 has role 'bot', not one of system, user, assistant, tool; "
        "rename it in the data"
    ), proc.stderr[-2000:]
    assert list(iter_conversations(str(path), "messages", max_documents=1)) == [good]


def test_conversations_with_no_assistant_token_are_counted_in_the_start_up_line(chat_dir, tmp_path):
    """No assistant message, or one cut away with the rest of a conversation longer than a sequence: nothing of it
    carries loss, and the data's part of the start-up line says how many such conversations there are."""
    from meshtron.train.run.messages import data_summary

    def message(role, content):
        return {"role": role, "content": content}

    conversations = [
        [message("user", "why?"), message("assistant", "yes")],
        [message("system", "be brief"), message("user", "how?")],  # no assistant message
        [message("user", "the cat " * 20), message("assistant", "no")],  # the assistant's turn is past seq_len
        [message("user", "how?"), message("assistant", "red")],
    ]
    path = tmp_path / "untrained.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    cfg = load_config(None, chat_overrides(chat_dir, tmp_path / "run", f"data.path={path}", "data.seq_len=64"), env={})
    dataset = build_chat_dataset(cfg.data, load_tokenizer(cfg.data.tokenizer))
    assert dataset.untrained == 2 and dataset.cut == 1
    summary = data_summary(dataset, cfg.data.seq_len)
    assert "from 4 conversations, 1 cut to one sequence, 2 with no assistant token (nothing to train on), " in summary
    every_token = load_config(
        None, chat_overrides(chat_dir, tmp_path / "run", f"data.path={path}", "data.train_on=all"), env={}
    )
    dataset = build_chat_dataset(every_token.data, load_tokenizer(cfg.data.tokenizer))  # every token carries loss
    assert dataset.untrained == 0 and "nothing to train on" not in data_summary(dataset, every_token.data.seq_len)
