"""The pipeline-parallel step: the schedule runner, evaluation and rehearsal under pipeline parallelism."""
