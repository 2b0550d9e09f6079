"""The training loop (``trainer.py``) and one step (``step.py``, with its inputs in ``batch.py`` and its numbers across
ranks in ``step_stats.py``); set-up, the run's lifecycle, loss, evaluation, the optimizers, the pipeline step and MoE
routing each in a room of its own."""
