"""Keeping a run going through faults: restarts, preemption signals, hangs, non-finite steps (docs/faults.md)."""
