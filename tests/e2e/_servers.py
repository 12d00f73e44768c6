"""Starting reinforge's own servers (`reinforge env serve`, `reinforge serve`) as real processes for tests."""

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from reinforge.network import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def cli_server(
    arguments: list[str], log_path: Path, env: dict | None = None, timeout_s: float = 90.0, port: int | None = None
):
    """`reinforge ARGUMENTS --port P` (a free port unless given) in its own process, once its /health answers;
    yields (url, process, log file)."""
    port = port or free_port("127.0.0.1")
    log = log_path.open("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "reinforge.cli", *arguments, "--port", str(port)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"the server exited: {log.read()}")
            assert time.monotonic() < deadline, f"server did not answer /health within {timeout_s:.0f} s"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url, process, log
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
