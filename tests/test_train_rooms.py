"""``meshtron/train/`` keeps the loop and the step at its top and everything else in a room (issue 58, item 3):
set-up in ``setup/``, the run's lifecycle in ``run/``, the loss in ``loss/``, evaluation in ``evaluation/``, and
``optim/``, ``pipeline/``, ``moe/``. A new module goes into the room it belongs to, or opens one."""

from pathlib import Path

MESHTRON = Path(__file__).resolve().parents[1] / "meshtron"
TRAIN = MESHTRON / "train"

TOP_OF_TRAIN = {
    "__init__": "the package",
    "trainer": "the loop",
    "step": "one optimizer step",
    "batch": "the step's inputs (a packed micro-batch cut into the model's inputs and labels), which evaluation shares",
    "step_stats": "the step's numbers across ranks in one collective, which evaluation shares",
}
"""The modules allowed at the top of ``meshtron/train/``, each with why it is part of the loop or the step."""


def test_train_has_no_loose_module_outside_its_rooms():
    loose = sorted(path.stem for path in TRAIN.glob("*.py") if path.stem not in TOP_OF_TRAIN)
    assert not loose, (
        f"meshtron/train/ has loose modules {loose}: put each in the room it belongs to (setup/, run/, loss/, "
        "evaluation/, optim/, pipeline/, moe/, or a new one); only the loop and the step stay at the top (TOP_OF_TRAIN)"
    )


def test_the_modules_allowed_at_the_top_of_train_exist():
    assert sorted(name for name in TOP_OF_TRAIN if not (TRAIN / f"{name}.py").exists()) == []


def test_every_folder_of_modules_is_a_package():
    """A room without ``__init__.py`` would be a namespace package: mypy and the packaging skip it."""
    folders = {path.parent for path in MESHTRON.rglob("*.py")}
    assert sorted(str(f.relative_to(MESHTRON)) for f in folders if not (f / "__init__.py").exists()) == []
