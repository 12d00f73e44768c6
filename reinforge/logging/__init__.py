"""Metrics: timers, the JSONL log, the console."""
