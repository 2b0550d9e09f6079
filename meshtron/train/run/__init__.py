"""A run's lifecycle around the loop: what a checkpoint holds of it, its segments, its first and last log lines, and
the planner's figures beside the measured ones."""
