"""The preference objectives (meshtron.train.loss.preference) against TRL 1.16's own code on the same log-probabilities.

TRL's trainers run here without their __init__ (an object made by ``__new__`` with the attributes their loss code
reads) on a stand-in model that returns given per-token log-probabilities (DPOTrainer's fused head) or logits (CPO,
ORPO): their loss and logged metrics are compared with meshtron's, computed from rows laid out by the row contract
(chosen answer's labels, a separator, the rejected answer's labels).
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from meshtron.config import DpoConfig, IpoConfig, OrpoConfig, SimpoConfig
from meshtron.data.labels import IGNORE_INDEX
from meshtron.train.loss.preference import (
    PROMPT_RUN,
    preference_objective,
    preference_runs,
    prompt_sums,
    sequence_sums,
    target_tokens,
)

trl = pytest.importorskip("trl")
from trl import DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

PAIRS, LENGTH, VOCAB = 6, 12, 11
ACCELERATOR = types.SimpleNamespace(
    device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x, unwrap_model=lambda m: m
)


def _pairs(seed: int = 0):
    """TRL's concatenated batch of ``PAIRS`` pairs (chosen rows, then rejected rows) of ``LENGTH`` tokens: input ids,
    attention mask and completion mask (prompts of 2-4 tokens, answers of 1-6, then padding)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2 * PAIRS, LENGTH), generator=gen)
    attention, completion = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for pair in range(PAIRS):
        prompt = int(torch.randint(2, 5, (), generator=gen))
        for row in (pair, PAIRS + pair):
            answer = int(torch.randint(1, 7, (), generator=gen))
            attention[row, : prompt + answer] = 1
            completion[row, prompt : prompt + answer] = 1
    return input_ids, attention, completion


def _rows(token_logps: torch.Tensor, shift_completion: torch.Tensor):
    """meshtron's rows for the pairs: (labels, token log-probabilities), each row the chosen sequence's positions, a
    separator position, the rejected sequence's; the log-probabilities are 0 where there is no label (as the head's)."""
    labels = torch.where(shift_completion.bool(), 5, IGNORE_INDEX)
    separator = torch.full((PAIRS, 1), IGNORE_INDEX)
    row_labels = torch.cat([labels[:PAIRS], separator, labels[PAIRS:]], dim=1)
    row_logps = torch.cat([token_logps[:PAIRS], torch.zeros(PAIRS, 1), token_logps[PAIRS:]], dim=1)
    return row_labels, row_logps * (row_labels != IGNORE_INDEX)


def _meshtron(objective, row_logps, row_labels, reference=None, nll=None):
    """meshtron's loss and metrics for all pairs in one micro-batch."""
    policy, lengths = sequence_sums(row_logps, preference_runs(row_labels))
    chosen_tokens = int(lengths[:, 0].sum()) if nll is None else nll[1]
    loss, sums = objective.loss(
        policy,
        lengths,
        reference,
        global_pairs=PAIRS,
        global_chosen_tokens=chosen_tokens,
        nll_logps=None if nll is None else nll[0],
    )
    return loss, objective.metric_values(sums.detach(), PAIRS)


def _assert_metrics_equal(got: dict[str, float], want: dict[str, float], names):
    for name in names:
        assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-7), name


def _dpo_trainer(loss_types, loss_weights, beta, label_smoothing=0.0):
    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer.__dict__.update(
        model=types.SimpleNamespace(training=True),
        accelerator=ACCELERATOR,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=loss_types,
        loss_weights=loss_weights,
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    return trainer


DPO_CASES = {
    "dpo sigmoid": ("dpo", DpoConfig(beta=0.3), (["sigmoid"], [1.0])),
    "dpo robust": ("dpo", DpoConfig(beta=0.2, loss_type="robust", label_smoothing=0.2), (["robust"], [1.0])),
    "dpo rpo": ("dpo", DpoConfig(beta=0.1, rpo_alpha=0.7), (["sigmoid", "sft"], [1.0, 0.7])),
    "ipo": ("ipo", IpoConfig(beta=0.4), (["ipo"], [1.0])),
}


def _objective(name, section):
    sections = {"dpo": DpoConfig(), "ipo": IpoConfig(), "simpo": SimpoConfig(), "orpo": OrpoConfig()}
    sections[name] = section
    return preference_objective(name, sections["dpo"], sections["ipo"], sections["simpo"], sections["orpo"])


@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_and_ipo_equal_trl_dpo_trainer(case):
    """DPOTrainer._compute_loss with precomputed reference log-probabilities, on a stand-in model whose fused head
    returns the given per-token log-probabilities: loss, every reward metric and the log-probabilities' gradients."""
    name, section, (loss_types, loss_weights) = DPO_CASES[case]
    input_ids, attention, completion = _pairs()
    shift = completion[:, 1:]
    gen = torch.Generator().manual_seed(1)
    token_logps = (-3 * torch.rand(2 * PAIRS, LENGTH - 1, generator=gen)).requires_grad_()
    reference = -2 * torch.rand(PAIRS, 2, generator=gen) - 4
    outputs = types.SimpleNamespace(
        log_probs=token_logps * shift,
        entropy=torch.zeros(2 * PAIRS, LENGTH - 1),
        mean_logits=torch.zeros(2 * PAIRS, LENGTH - 1),
        is_top1=torch.zeros(2 * PAIRS, LENGTH - 1, dtype=torch.bool),
    )
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "ref_chosen_logps": reference[:, 0],
        "ref_rejected_logps": reference[:, 1],
    }
    trainer = _dpo_trainer(loss_types, loss_weights, section.beta, getattr(section, "label_smoothing", 0.0))
    want_loss = DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, False)
    want_metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    (want_grad,) = torch.autograd.grad(want_loss, [token_logps])

    objective = _objective(name, section)
    assert objective.uses_reference
    row_labels, row_logps = _rows(token_logps, shift)
    loss, metrics = _meshtron(objective, row_logps, row_labels, reference)
    (grad,) = torch.autograd.grad(loss, [token_logps])
    assert float(loss.detach()) == pytest.approx(float(want_loss.detach()), rel=1e-6)
    _assert_metrics_equal(metrics, want_metrics, objective.metric_names)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-8)


def _logits_batch(seed: int = 0):
    """TRL's CPO/ORPO batch (chosen_* and rejected_* input ids, attention masks, labels with the prompt ignored) and
    a stand-in model's logits for the concatenated rows."""
    input_ids, attention, completion = _pairs(seed)
    labels = torch.where(completion.bool(), input_ids, IGNORE_INDEX)
    batch = {}
    for side, rows in (("chosen", slice(0, PAIRS)), ("rejected", slice(PAIRS, None))):
        batch[f"{side}_input_ids"] = input_ids[rows]
        batch[f"{side}_attention_mask"] = attention[rows]
        batch[f"{side}_labels"] = labels[rows]
    gen = torch.Generator().manual_seed(seed + 1)
    logits = (2 * torch.randn(2 * PAIRS, LENGTH, VOCAB, generator=gen)).requires_grad_()
    return batch, logits, input_ids, attention, completion


def _token_logps(logits, input_ids):
    """Each next token's log-probability under the logits (what head_token_logps gives)."""
    return torch.log_softmax(logits[:, :-1], -1).gather(2, input_ids[:, 1:].unsqueeze(2)).squeeze(2)


def _trainer_without_init(cls, **attributes):
    trainer = cls.__new__(cls)
    trainer.__dict__.update(accelerator=ACCELERATOR, is_encoder_decoder=False, aux_loss_enabled=False, **attributes)
    return trainer


@pytest.mark.parametrize("cpo_alpha", [0.0, 0.6])
def test_simpo_equals_trl_cpo_trainer(cpo_alpha):
    """CPOTrainer.get_batch_loss_metrics (loss_type=simpo) on a stand-in model's logits."""
    section = SimpoConfig(beta=2.0, gamma=0.7, cpo_alpha=cpo_alpha)
    batch, logits, input_ids, _, completion = _logits_batch()
    trainer = _trainer_without_init(
        CPOTrainer,
        pad_token_id=0,
        cpo_alpha=cpo_alpha,
        loss_type="simpo",
        alpha=0.0,
        beta=section.beta,
        simpo_gamma=section.gamma,
        label_smoothing=0.0,
    )
    model = lambda *args, **kwargs: types.SimpleNamespace(logits=logits)  # noqa: E731
    want_loss, want_metrics = CPOTrainer.get_batch_loss_metrics(trainer, model, batch)
    (want_grad,) = torch.autograd.grad(want_loss, [logits])

    objective = _objective("simpo", section)
    assert not objective.uses_reference and "nll_loss" in objective.metric_names
    row_labels, row_logps = _rows(_token_logps(logits, input_ids), completion[:, 1:])
    loss, metrics = _meshtron(objective, row_logps, row_labels)
    (grad,) = torch.autograd.grad(loss, [logits])
    assert float(loss.detach()) == pytest.approx(float(want_loss.detach()), rel=1e-6)
    _assert_metrics_equal(metrics, want_metrics, objective.metric_names)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)


def test_orpo_equals_trl_orpo_trainer():
    """ORPOTrainer.get_batch_loss_metrics on a stand-in model's logits; its NLL covers the chosen sequence's prompt
    tokens too, passed as ``nll_logps``."""
    section = OrpoConfig(beta=0.3)
    batch, logits, input_ids, attention, completion = _logits_batch(seed=3)
    trainer = _trainer_without_init(ORPOTrainer, padding_value=0, beta=section.beta)
    model = lambda *args, **kwargs: types.SimpleNamespace(logits=logits)  # noqa: E731
    want_loss, want_metrics = ORPOTrainer.get_batch_loss_metrics(trainer, model, batch)
    (want_grad,) = torch.autograd.grad(want_loss, [logits])

    objective = _objective("orpo", section)
    token_logps = _token_logps(logits, input_ids)
    row_labels, row_logps = _rows(token_logps, completion[:, 1:])
    chosen_sequence = attention[:PAIRS, 1:].bool()
    nll = ((token_logps[:PAIRS] * chosen_sequence).sum(1), int(chosen_sequence.sum()))
    loss, metrics = _meshtron(objective, row_logps, row_labels, nll=nll)
    (grad,) = torch.autograd.grad(loss, [logits])
    assert float(loss.detach()) == pytest.approx(float(want_loss.detach()), rel=1e-6)
    _assert_metrics_equal(metrics, want_metrics, objective.metric_names)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(
    "name,section",
    [
        ("dpo", DpoConfig(beta=0.2, rpo_alpha=0.5)),
        ("ipo", IpoConfig()),
        ("simpo", SimpoConfig(cpo_alpha=0.3)),
        ("orpo", OrpoConfig()),
    ],
)
def test_micro_batches_add_up_to_the_whole_batch(name, section):
    """The shares of micro-batches of 1, 2 and 3 pairs add up to the whole batch's loss, gradient and metrics."""
    objective = _objective(name, section)
    gen = torch.Generator().manual_seed(4)
    policy = (-20 * torch.rand(PAIRS, 2, generator=gen) - 1).requires_grad_()
    lengths = torch.randint(1, 9, (PAIRS, 2), generator=gen).float()
    reference = -20 * torch.rand(PAIRS, 2, generator=gen) - 1
    counts = {"global_pairs": PAIRS, "global_chosen_tokens": int(lengths[:, 0].sum())}
    whole, whole_metrics = objective.loss(policy, lengths, reference, **counts)
    (whole_grad,) = torch.autograd.grad(whole, [policy])
    total, total_metrics = 0, 0
    for part in (slice(0, 1), slice(1, 3), slice(3, 6)):
        loss, metrics = objective.loss(policy[part], lengths[part], reference[part], **counts)
        total, total_metrics = total + loss, total_metrics + metrics
    (grad,) = torch.autograd.grad(total, [policy])
    assert float(total.detach()) == pytest.approx(float(whole.detach()), rel=1e-6)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(total_metrics, whole_metrics, rtol=1e-6, atol=1e-6)
    assert len(whole_metrics) == len(objective.metric_names)


def test_runs_number_the_chosen_and_rejected_answers():
    labels = torch.tensor(
        [
            [-100, -100, 4, 5, -100, -100, -100, 6, 7, 8, -100, -100],
            [-100, 3, -100, -100, -100, 2, 2, 2, 2, 2, 2, 2],
        ]
    )
    want = torch.tensor(
        [
            [-1, -1, 0, 0, -1, -1, -1, 1, 1, 1, -1, -1],
            [-1, 0, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    assert torch.equal(preference_runs(labels), want)
    logps = torch.arange(24, dtype=torch.float32).reshape(2, 12) * (labels != -100)
    sums, counts = sequence_sums(logps, want)
    assert torch.equal(sums, torch.tensor([[5.0, 7 + 8 + 9], [13.0, sum(range(17, 24))]]))
    assert torch.equal(counts, torch.tensor([[2.0, 3.0], [1.0, 7.0]]))


def test_nll_only_marks_form_the_prompt_run_outside_the_two_answers():
    """ORPO's chosen prompt targets (labels below IGNORE_INDEX) are run PROMPT_RUN, summed apart by prompt_sums and
    turned back into their tokens by target_tokens; the answers' runs and sums are unchanged."""
    mark = IGNORE_INDEX - 1  # token t is labelled mark - t
    labels = torch.tensor([[mark - 7, mark - 0, 4, 5, -100, -100, 6, 7, -100]])
    runs = preference_runs(labels)
    assert runs.tolist() == [[PROMPT_RUN, PROMPT_RUN, 0, 0, -1, -1, 1, 1, -1]]
    assert target_tokens(labels).tolist() == [[7, 0, 4, 5, -100, -100, 6, 7, -100]]
    logps = torch.arange(9, dtype=torch.float32)[None]
    sums, counts = sequence_sums(logps, runs)
    assert sums.tolist() == [[5.0, 13.0]] and counts.tolist() == [[2.0, 2.0]]
    assert prompt_sums(logps, runs).tolist() == [1.0]


@pytest.mark.parametrize(
    "row,runs",
    [([-100, 4, 5, -100, -100], 1), ([3, -100, 4, -100, 5], 3), ([-100] * 5, 0), ([1, 2, 3, 4, 5], 1)],
)
def test_a_row_without_exactly_two_answers_is_refused(row, runs):
    labels = torch.tensor([[-100, 1, -100, 2, -100], row])
    with pytest.raises(ValueError, match=f"row 1 of the micro-batch has {runs} runs"):
        preference_runs(labels)


def test_objectives_say_whether_they_need_a_reference():
    assert _objective("dpo", DpoConfig()).uses_reference and _objective("ipo", IpoConfig()).uses_reference
    assert not _objective("simpo", SimpoConfig()).uses_reference and not _objective("orpo", OrpoConfig()).uses_reference
    assert preference_objective("causal_lm", DpoConfig(), IpoConfig(), SimpoConfig(), OrpoConfig()) is None
    with pytest.raises(ValueError, match="reference"):
        _objective("dpo", DpoConfig()).loss(
            torch.zeros(1, 2), torch.ones(1, 2), None, global_pairs=1, global_chosen_tokens=1
        )
