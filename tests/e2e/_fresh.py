"""Running a test's vLLM engine in a fresh process (vLLM sets up process-wide state)."""

import json
from pathlib import Path

import torch.multiprocessing as mp


def run_in_fresh_process(target, *args, out: Path, timeout_s: float = 400) -> dict:
    """`target(*args, out)` in a spawned process, which writes its outcomes as JSON to `out`; those outcomes."""
    process = mp.get_context("spawn").Process(target=target, args=(*args, out))
    process.start()
    process.join(timeout=timeout_s)
    if process.is_alive():
        process.kill()
    assert process.exitcode == 0, process.exitcode
    return json.loads(out.read_text())
