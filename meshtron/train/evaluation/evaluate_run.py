"""``meshtron eval``'s run: set up as a training run is (meshtron.train.trainer.run_session), train nothing, and
evaluate the model as built or restored from the checkpoint ``checkpoint.resume`` names, once, on the ``[eval]``
data (meshtron.train.evaluation.evaluate)."""

from __future__ import annotations

from meshtron.config import Config
from meshtron.distributed.runtime import Runtime
from meshtron.train.run.messages import evaluated_message
from meshtron.train.run.resumable import Resumable
from meshtron.train.setup.run_setup import RunSetup
from meshtron.train.trainer import TrainResult, evaluate_model, run_session


def evaluate_run(cfg: Config, runtime: Runtime, setup: RunSetup | None = None) -> TrainResult:
    """Evaluate once; rank 0 writes the evaluation's metrics row (at the step the model was trained to) and the
    resolved config. Its ``eval_losses`` holds the one evaluation."""
    return run_session(cfg, runtime, setup, _evaluate_once, evaluates_once=True)


def _evaluate_once(
    cfg: Config, runtime: Runtime, setup: RunSetup, result: TrainResult, loop, resumable: Resumable
) -> str:
    step = result.start_step
    loop.logger.log({"step": step, **evaluate_model(loop, step, result.model, result)})
    return evaluated_message(result)
