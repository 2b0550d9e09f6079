"""Metrics: FLOPs and MFU, memory, metrics.jsonl and the progress line."""
