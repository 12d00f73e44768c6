"""Dependencies write their logs to RUN_DIR/logs/dependencies.log, and the console keeps only reinforge's
own output: the progress bar and metric lines (rich, on stdout) and one-line errors.

Three routes, because dependencies log three ways:
1. Python `logging` (vLLM, Ray, transformers, torch, urllib3, httpx, W&B, MLflow, ...): a file handler on
   the root logger; the dependencies' own console handlers are taken off and their records propagate to
   it. Python warnings join them (`logging.captureWarnings`).
2. Processes a dependency starts (vLLM's engine core, Ray's local workers): environment variables they
   inherit. vLLM configures its logging from VLLM_LOGGING_CONFIG_PATH, pointed at a dictConfig that
   writes to the same file; tqdm and Hugging Face Hub progress bars are turned off.
3. Whatever is written to file descriptor 2 (C and C++ code: gloo, NCCL, torch's C++ warnings; children's
   stderr; Python's stderr too): with `redirect_stderr`, fd 2 is the log file while the context is open.
   stdout stays the terminal, and the CLI prints its one-line errors after the context has closed.

Known gap: a dependency imported for the first time inside the context may add a console handler on
import (Ray does); it writes to sys.stderr, so the fd 2 redirect catches it, except while rich's live
progress display is up (it reroutes sys.stderr to the console).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DEPENDENCY_LOGGERS = (
    "vllm",
    "ray",
    "transformers",
    "torch",
    "huggingface_hub",
    "urllib3",
    "httpx",
    "httpx2",
    "httpcore",
    "filelock",
    "datasets",
    "accelerate",
    "math_verify",
    "numba",
    "asyncio",
    "uvicorn",
    "fastapi",
    "wandb",
    "mlflow",
    "git",
    "matplotlib",
    "PIL",
    "py.warnings",
)
QUIET_ENV = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
FORMAT = "%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"


@contextmanager
def capture_dependency_logs(run_dir: Path, enabled: bool = True, redirect_stderr: bool = True) -> Iterator[Path | None]:
    """Route dependencies' logs to RUN_DIR/logs/dependencies.log (yielded) until the context exits; then
    every logger, environment variable and file descriptor is as it was. `enabled=False` does nothing
    and yields None. Enter it before the dependencies start (Ray, the generation engine) so that their
    processes inherit the settings."""
    if not enabled:
        yield None
        return
    path = Path(run_dir) / "logs" / "dependencies.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    env = {**QUIET_ENV}
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":  # vLLM refuses a config file with configuration off
        env["VLLM_LOGGING_CONFIG_PATH"] = str(write_vllm_logging_config(path))
    saved_env = {name: os.environ.get(name) for name in env}
    for name, value in env.items():
        os.environ.setdefault(name, value)  # a value the user set wins
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().addHandler(handler)
    saved_loggers = detach_console_handlers()
    captured_warnings = _capture_warnings()
    saved_fd = _redirect_fd2(path) if redirect_stderr else None
    try:
        yield path
    finally:
        if saved_fd is not None:
            _restore_fd2(saved_fd)
        if captured_warnings:
            logging.captureWarnings(False)
        for logger, (handlers, propagate) in saved_loggers.items():
            for extra in [h for h in logger.handlers if h not in handlers]:
                if isinstance(extra, logging.FileHandler) and Path(extra.baseFilename) == path.resolve():
                    extra.close()  # vLLM's, from the dictConfig above
            logger.handlers[:] = handlers  # in their order: records reach them as before
            logger.propagate = propagate
        logging.getLogger().removeHandler(handler)
        handler.close()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def detach_console_handlers() -> dict[logging.Logger, tuple[list[logging.Handler], bool]]:
    """Take the console handlers off the dependencies' loggers (and their existing descendants) and let
    their records propagate to the root logger. Returns each logger's handlers and propagate flag as they were."""
    names = set(DEPENDENCY_LOGGERS) | {
        name
        for name in logging.root.manager.loggerDict
        if any(name.startswith(dependency + ".") for dependency in DEPENDENCY_LOGGERS)
    }
    saved = {}
    for name in sorted(names):
        logger = logging.getLogger(name)
        saved[logger] = (list(logger.handlers), logger.propagate)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True
    return saved


def write_vllm_logging_config(path: Path) -> Path:
    """A logging.dictConfig for vLLM (VLLM_LOGGING_CONFIG_PATH) that appends its records to `path`, at
    VLLM_LOGGING_LEVEL (vLLM's default INFO)."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": FORMAT}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(path.resolve()),
                "mode": "a",
                "encoding": "utf-8",
                "formatter": "plain",
                "level": level,
            }
        },
        "loggers": {"vllm": {"handlers": ["file"], "level": level, "propagate": False}},
    }
    config_path = path.parent / "vllm_logging.json"
    config_path.write_text(json.dumps(config, indent=2))
    return config_path


def _capture_warnings() -> bool:
    """Send Python warnings to the "py.warnings" logger; True if this turned it on (it may already be on)."""
    before = warnings.showwarning
    logging.captureWarnings(True)
    return warnings.showwarning is not before


def _redirect_fd2(path: Path) -> int:
    """Point fd 2 at the log file (appending, so that every process writing to it interleaves whole
    writes); returns a duplicate of the original fd 2 to restore."""
    sys.stderr.flush()
    saved = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    return saved


def _restore_fd2(saved: int) -> None:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
