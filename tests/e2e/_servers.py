"""Starting reinforge's own servers (`reinforge env serve`, `reinforge serve`) as real processes for tests."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
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


@contextlib.contextmanager
def server_process(command, health_url, startup_timeout_s, env=None):
    """Run `command` in its own process group until the block ends; yields (process, startup seconds)."""
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    output = []  # drained in a thread so a chatty server never blocks on a full pipe
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
    reader.start()
    try:
        while True:
            if process.poll() is not None:
                reader.join(5)
                raise RuntimeError(
                    f"{command[:3]} exited with {process.returncode}:\n"
                    + b"".join(output[-40:]).decode(errors="replace")
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(health_url, timeout=1).status_code == 200:
                    break
            if time.monotonic() - start > startup_timeout_s:
                raise RuntimeError(
                    f"{command[:3]} not healthy after {startup_timeout_s} s:\n"
                    + b"".join(output[-40:]).decode(errors="replace")
                )
            time.sleep(0.2)
        yield process, time.monotonic() - start
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # the group: vLLM's engine runs in a child process
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
