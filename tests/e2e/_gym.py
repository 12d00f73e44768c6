"""Starting real NeMo Gym servers from a NeMo Gym virtualenv, for the Gym tests (test_gym_envs.py,
test_gym_agents.py). Users start Gym's servers with Gym's own CLI (docs/agents.md).

    with gym_servers({"weather": {"resources_servers": {"example_single_tool_call": {"entrypoint": "app.py",
                                                                                  "domain": "agent"}}}},
                     log_dir=Path("runs/gym_logs")) as urls:
        urls["weather"]   # "http://127.0.0.1:PORT"

`config` is a NeMo Gym global config: top-level keys are instance names, each
`{server_type: {implementation_dir: {settings}}}` (server types: resources_servers,
responses_api_agents, responses_api_models, environment_servers); other top-level keys are global
settings and pass through. Missing `host`s become 127.0.0.1 and missing `port`s free ones; a
`head_server` entry is added (a port only: servers find each other by name in the config, so none is
started) and `dry_run: false`. The merged config is written to `log_dir/gym_config.yaml`.

Each server starts as Gym's own `gym env start` would run it once its environment is set up, without
uv, Ray or a head server: `python <site-packages>/<type>/<impl>/<entrypoint>` in its directory, with
NEMO_GYM_CONFIG_DICT (the merged YAML), NEMO_GYM_CONFIG_PATH (its instance name) and PYTHONPATH (its
directory), in a process group of its own, logging to `log_dir/<name>.log`. A Gym server reads its
own settings from NEMO_GYM_CONFIG_DICT under the instance name that NEMO_GYM_CONFIG_PATH gives, and
finds the other servers by their names in the same config.
The servers are up when each answers `GET /health`; on leaving the block every group is killed and
reaped. Limits: a server class that does not declare `ray_enabled = False` starts a local Ray
cluster of its own (the example servers, simple_agent and vllm_model declare it); give the config a
`ray_head_node_address` to reuse a running cluster instead. Servers that need packages beyond
nemo-gym need them in the Gym virtualenv.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any, Iterator

import httpx
import yaml

from reinforge.errors import ReinforgeError
from reinforge.network import free_port
from reinforge.paths import PROJECT_ROOT

SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models", "environment_servers")
HOST = "127.0.0.1"
GYM_VENV_ENV = "REINFORGE_GYM_VENV"
NUM_LOG_LINES = 5


class GymLaunchError(ReinforgeError):
    """A NeMo Gym virtualenv that is missing, or a Gym server that does not come up."""


def gym_python() -> Path:
    """The NeMo Gym virtualenv's interpreter: `$REINFORGE_GYM_VENV/bin/python`, else `<repo>/.gym-venv/bin/python`."""
    venv = Path(os.environ[GYM_VENV_ENV]) if os.environ.get(GYM_VENV_ENV) else PROJECT_ROOT / ".gym-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        raise GymLaunchError(
            f"no NeMo Gym virtualenv at {venv} ({python} is missing); run `make gym-venv`, "
            f"or point {GYM_VENV_ENV} at a virtualenv with nemo-gym installed"
        )
    return python


def policy_model(port: int) -> dict[str, Any]:
    """Gym's `vllm_model` model server calling reinforge's endpoint at 127.0.0.1:`port` (with token ids back)."""
    return {
        "responses_api_models": {
            "vllm_model": {
                "entrypoint": "app.py",
                "base_url": f"http://127.0.0.1:{port}/v1",
                "api_key": "none",
                "model": "policy",
                "return_token_id_information": True,
                "uses_reasoning_parser": False,
            }
        }
    }


@contextlib.contextmanager
def gym_servers(
    config: dict[str, Any],
    log_dir: Path,
    python: Path | None = None,
    timeout_s: float = 120,
    external: tuple[str, ...] = (),
) -> Iterator[dict[str, str]]:
    """Start every server of `config` but the `external` ones (already running, e.g. `reinforge env serve
    --protocol gym`: the config only tells the others their `host` and `port`), wait until all answer
    /health, yield {instance name: URL}; see the module doc."""
    python = python or gym_python()
    site = _site_packages(python)
    merged, servers = _resolve(config)
    for name in external:
        if name not in servers or not {"host", "port"} <= set(config[name][servers[name][0]][servers[name][1]]):
            raise GymLaunchError(
                f"external NeMo Gym server {name} must be an instance of the config with its host and port"
            )
        servers.pop(name)
    log_dir.mkdir(parents=True, exist_ok=True)
    config_yaml = yaml.safe_dump(merged, sort_keys=False)
    (log_dir / "gym_config.yaml").write_text(config_yaml)
    processes: dict[str, subprocess.Popen] = {}
    logs: list[IO[bytes]] = []
    try:
        for name, (server_type, impl, settings) in servers.items():
            directory = site / server_type / impl
            entrypoint = directory / settings.get("entrypoint", "app.py")
            if not entrypoint.is_file():
                raise GymLaunchError(
                    f"NeMo Gym server {name}: {entrypoint} does not exist; is {server_type}/{impl} "
                    f"a server shipped with the nemo-gym in {python}?"
                )
            env = {
                **os.environ,
                "NEMO_GYM_CONFIG_DICT": config_yaml,
                "NEMO_GYM_CONFIG_PATH": name,
                "PYTHONPATH": str(directory),
            }
            env.pop("VIRTUAL_ENV", None)  # reinforge's, not Gym's
            log = (log_dir / f"{name}.log").open("wb")
            logs.append(log)
            processes[name] = subprocess.Popen(
                [str(python), str(entrypoint)],
                cwd=directory,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        urls = {name: f"http://{settings['host']}:{settings['port']}" for name, (_, _, settings) in servers.items()}
        _wait_until_up(urls, processes, log_dir, timeout_s)
        yield urls
    finally:
        _stop(processes.values())
        for log in logs:
            log.close()


def _site_packages(python: Path) -> Path:
    """Where the Gym venv keeps nemo_gym and the server directories."""
    code = "import nemo_gym, pathlib; print(pathlib.Path(nemo_gym.__file__).resolve().parent.parent)"
    try:
        result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GymLaunchError(f"{python} does not run: {exc}") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise GymLaunchError(f"{python} cannot import nemo_gym ({last}); run `make gym-venv`")
    return Path(result.stdout.strip())


def _resolve(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str, str, dict[str, Any]]]]:
    """(the merged config, {instance: (server type, implementation dir, its settings in the merged config)})."""
    merged = copy.deepcopy(config)
    servers = {}
    for name, value in merged.items():
        if not (isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SERVER_TYPES):
            continue  # a global setting
        ((server_type, implementations),) = value.items()
        if not (isinstance(implementations, dict) and len(implementations) == 1):
            raise GymLaunchError(
                f"NeMo Gym config {name}.{server_type} must hold one implementation directory, "
                f"e.g. {{example_single_tool_call: {{entrypoint: app.py}}}}"
            )
        ((impl, settings),) = implementations.items()
        settings.setdefault("host", HOST)
        settings.setdefault("port", free_port(HOST))
        if not isinstance(settings["port"], int) or isinstance(settings["port"], bool):
            raise GymLaunchError(
                f"NeMo Gym config {name}.{server_type}.{impl}.port must be an integer, got {settings['port']!r}"
            )
        servers[name] = (server_type, impl, settings)
    if not servers:
        raise GymLaunchError(
            f"the NeMo Gym config names no server (top-level keys: {', '.join(merged) or 'none'}); "
            "each instance is {server_type: {implementation_dir: {...}}} "
            f"with a type among {', '.join(SERVER_TYPES)}"
        )
    merged.setdefault("head_server", {"host": HOST, "port": free_port(HOST)})
    merged.setdefault("dry_run", False)
    return merged, servers


def _wait_until_up(
    urls: dict[str, str], processes: dict[str, subprocess.Popen], log_dir: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = dict(urls)
    with httpx.Client(timeout=2.0) as client:
        while waiting:
            for name, url in list(waiting.items()):
                status = _exit_status(processes[name])
                if status is not None:
                    raise GymLaunchError(
                        f"NeMo Gym server {name} exited with status {status} before answering {url}/health; "
                        f"{_log_tail(log_dir / f'{name}.log')}"
                    )
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        del waiting[name]
                except httpx.TransportError:
                    pass
            if waiting and time.monotonic() > deadline:
                name = next(iter(waiting))
                raise GymLaunchError(
                    f"NeMo Gym server {name} did not answer {waiting[name]}/health within {timeout_s:g} s; "
                    f"{_log_tail(log_dir / f'{name}.log')}"
                )
            if waiting:
                time.sleep(0.2)


def _log_tail(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return f"last lines of {path}: " + (" | ".join(lines[-NUM_LOG_LINES:]) or "(empty)")


def _stop(processes: Any) -> None:
    """SIGTERM each process group, then SIGKILL it (what is left of it after up to 5 s: children of a
    server, a Ray cluster, uvicorn workers), then reap the server. The leader is reaped only after the
    group's last signal, so that its group id cannot have been reused by then."""
    processes = list(processes)
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for process in processes:
        while time.monotonic() < deadline and _exit_status(process) is None:
            time.sleep(0.05)
        _signal_group(process, signal.SIGKILL)
        process.wait()


def _exit_status(process: subprocess.Popen) -> int | None:
    """The process's exit status (or killing signal) once it has exited, without reaping it; None while it runs."""
    if process.returncode is not None:
        return process.returncode
    info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return None if info is None else info.si_status


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    if process.returncode is None:  # not reaped: its group id is still its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
