"""An ASGI app served by uvicorn on a thread of this process: the policy endpoint inside a run, and the
environments a run serves for its agents (`agent.serve_envs`)."""

from __future__ import annotations

import threading
import time

from reinforge.cluster.network import free_port
from reinforge.errors import ConfigError

STARTUP_TIMEOUT_S = 30.0


class ThreadedServer:
    def __init__(self, app, host: str, port: int, name: str):
        self.app, self.host, self.name = app, host, name
        self.port = port or free_port(host)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> "ThreadedServer":
        import uvicorn

        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="warning", access_log=False, timeout_keep_alive=30
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"reinforge-{self.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(
                    f"the {self.name} could not start on {self.host}:{self.port} (is the port in use?); "
                    "choose another port, or 0 for any free one"
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
