"""`reinforge serve-tinker [CONFIG.yaml] [key=value ...]`: the Tinker-compatible service until Ctrl-C.

Only argparse is imported at module level, so that `reinforge --help` stays instant.
"""

from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reinforge.tinker.config import TinkerServeConfig
    from reinforge.tinker.service import TinkerService


def add_serve_tinker_command(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve-tinker",
        help="serve the Tinker API (the `tinker` SDK's training and sampling clients) on this machine's models",
        description="A Tinker-compatible service until Ctrl-C: point a Tinker script at it with "
        "TINKER_BASE_URL=http://127.0.0.1:PORT and TINKER_API_KEY=tml-anything (or the token of tinker.token_env). "
        "Training clients (LoRA or full weights) run on reinforge's training backend, sampling clients on its "
        "generation engine, checkpoints are reinforge checkpoints under tinker.run_dir. See docs/tinker.md.",
    )
    serve.add_argument("config", nargs="?", metavar="CONFIG", help="YAML config file (e.g. configs/tinker_demo.yaml)")
    serve.add_argument(
        "overrides",
        nargs="*",
        help="key=value overrides of the config tree, e.g. tinker.port=8100",
    )
    serve.set_defaults(run=run_serve_tinker_command)


def run_serve_tinker_command(args: argparse.Namespace) -> None:
    from reinforge.config.loader import load_recipe_config
    from reinforge.tinker.config import TinkerServeConfig

    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        path, overrides = None, [path, *overrides]  # only overrides were given
    config = load_recipe_config(TinkerServeConfig, path, overrides)
    server = start_server(config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    names = ", ".join(config.served_models())
    access = f"API key from ${config.tinker.token_env}" if config.tinker.token_env else "any tml- API key"
    print(
        f"serving the Tinker API at {server.url} for {names} ({access}); checkpoints in {server.run_dir}; Ctrl-C stops",
        flush=True,
    )
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


@dataclass
class RunningServer:
    url: str
    run_dir: Any
    service: "TinkerService"
    http: Any

    def stop(self) -> None:
        self.http.stop()
        self.service.stop()


def start_server(config: "TinkerServeConfig") -> RunningServer:
    """The service on a uvicorn thread of this process (port 0: a free one)."""
    import logging
    import time
    from pathlib import Path

    from reinforge.network import ThreadedServer, check_bind_address, token_from_env
    from reinforge.tinker.app import build_app
    from reinforge.tinker.service import TinkerService

    settings = config.tinker
    token = token_from_env(settings.token_env, "tinker.token_env")
    check_bind_address(settings.host, settings.allow_remote, token)
    for name in config.served_models():  # a missing model is a one-line error before the server listens
        from reinforge.modeling import model_limits

        model_limits(config.model_config_for(name))
    run_dir = Path(settings.run_dir) if settings.run_dir else Path("runs") / time.strftime("tinker-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("reinforge.tinker").setLevel(logging.INFO)
    service = TinkerService(config, run_dir, token)
    service.start()
    http = ThreadedServer(build_app(service), settings.host, settings.port, "Tinker service").start()
    return RunningServer(http.url, run_dir, service, http)
