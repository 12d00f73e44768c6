"""Dependencies' logs land in RUN_DIR/logs/dependencies.log, not on the console: real dependencies
(transformers, Ray, vLLM's logging config) logging through their own handlers, C-level writes to fd 2,
child processes; reinforge's stdout and its errors after the run still reach the terminal."""

import logging
import os
import subprocess
import sys

from reinforge.logging.capture import capture_dependency_logs

SCRIPT = r"""
import logging, os, subprocess, sys, warnings
import ray, transformers  # both install a console handler when imported
from rich.console import Console
from transformers import GenerationConfig
from reinforge.logging.capture import capture_dependency_logs

with capture_dependency_logs(sys.argv[1]) as path:
    Console().print("step    1 | reward 0.500")  # the console log, on stdout
    GenerationConfig(do_sample=False, temperature=0.5)  # transformers warns that temperature is unused
    logging.getLogger("ray.util").warning("ray driver warning")
    warnings.warn("a dependency's warning")
    os.write(2, b"C-level write to fd 2\n")
    subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('child process stderr\\n')"], check=True)
    print("python-level stderr", file=sys.stderr)
print("reinforge: error: something to fix", file=sys.stderr)  # as cli.py prints, after the run's context
logging.getLogger("ray").warning("ray console handler restored")
"""


def test_dependency_logs_go_to_the_file_and_reinforge_output_to_the_terminal(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "step    1 | reward 0.500\n"
    stderr = result.stderr.splitlines()
    assert stderr[0] == "reinforge: error: something to fix"
    assert stderr[1].endswith("ray console handler restored") and len(stderr) == 2

    log = (tmp_path / "logs" / "dependencies.log").read_text()
    for line in [
        "The following generation flags are not valid and may be ignored: ['temperature']",
        "WARNING ray.util [pid ",
        "ray driver warning",
        "UserWarning: a dependency's warning",
        "C-level write to fd 2\n",
        "child process stderr\n",
        "python-level stderr\n",
    ]:
        assert line in log, line
    assert "reinforge: error" not in log and "reward 0.500" not in log


def test_vllm_processes_log_to_the_file_through_their_logging_config(tmp_path, monkeypatch):
    """A process started inside the context configures vLLM's logging as vLLM's engine does
    (LoggingConfig from the environment), and its INFO records land in the file."""
    child = (
        "from vllm.config.logging import LoggingConfig; from vllm.logger import configure_logging, init_logger; "
        "configure_logging(LoggingConfig()); init_logger('vllm.v1.engine.core').info('engine core started')"
    )
    # vLLM's own default level, INFO (an in-process engine earlier in this pytest process sets WARNING)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    with capture_dependency_logs(tmp_path) as path:
        result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "engine core started" not in result.stdout + result.stderr
    log = path.read_text()
    assert "INFO vllm.v1.engine.core [pid " in log and "]: engine core started\n" in log
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ  # restored


def test_loggers_environment_and_fd2_are_restored_on_exit(tmp_path, capfd):
    import transformers  # noqa: F401  (installs its console handler)

    hf_logger, root = logging.getLogger("transformers"), logging.getLogger()
    before = (list(hf_logger.handlers), hf_logger.propagate, list(root.handlers), os.environ.get("TQDM_DISABLE"))
    with capture_dependency_logs(tmp_path) as path:
        assert not [h for h in hf_logger.handlers if type(h) is logging.StreamHandler]
        assert os.environ["TQDM_DISABLE"] == "1"
        os.write(2, b"inside\n")
    os.write(2, b"outside\n")
    assert (
        list(hf_logger.handlers),
        hf_logger.propagate,
        list(root.handlers),
        os.environ.get("TQDM_DISABLE"),
    ) == before
    assert capfd.readouterr().err == "outside\n"
    assert path.read_text() == "inside\n"


def test_disabled_capture_changes_nothing(tmp_path, capfd):
    with capture_dependency_logs(tmp_path, enabled=False) as path:
        os.write(2, b"on the terminal\n")
    assert path is None and not (tmp_path / "logs").exists()
    assert capfd.readouterr().err == "on the terminal\n"
