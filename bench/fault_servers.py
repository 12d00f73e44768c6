"""What the fault benchmark (bench/faults.py) runs beside a run: NeMo Gym's servers, an HTTP fault proxy, a
deterministic judge, a small tmpfs for the run directory, a two-node Ray test cluster. Every address is 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the tests' process helpers (_kill.py) and Gym launcher (_gym.py)
from _kill import cmdline  # noqa: E402

HOST = "127.0.0.1"
BATCH_32 = ["training.global_batch_size=32", "training.micro_batch_size=32"]  # 8 prompts x 4 samples


def all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def free_port() -> int:
    from reinforge.network import free_port as free

    return free(HOST)


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the server for {url} exited with status {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url}/health did not answer within {timeout_s:.0f} s")


class GymServers:
    """The gym scenario's servers: reinforge's tool_use env served the NeMo Gym way, Gym's vllm_model model server
    pointed at the run's endpoint, and Gym's simple_agent (tests/e2e/_gym.py starts Gym's servers)."""

    def __init__(self, out: Path):
        from contextlib import ExitStack

        from _gym import gym_servers

        from reinforge.data.jsonl import read_jsonl

        self.gym_servers, self.logs = gym_servers, out / "gym_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        ports = {name: free_port() for name in ("calculator", "agent", "model", "policy")}
        self.policy_port, self.agent_port = ports["policy"], ports["agent"]
        serve = ["env", "serve", "--protocol", "gym", "--env", "tool_use", "tool_use.tools=[calculator]"]
        self.calculator = subprocess.Popen(
            [sys.executable, "-m", "reinforge.cli", *serve, "--port", str(ports["calculator"])],
            stdout=open(self.logs / "calculator.log", "w"),
            stderr=subprocess.STDOUT,
        )
        server = {"entrypoint": "app.py", "host": HOST}
        self.config = {
            "calculator": {
                "resources_servers": {"reinforge_tool_use": {**server, "domain": "agent", "port": ports["calculator"]}}
            },
            "calculator_agent": {
                "responses_api_agents": {
                    "simple_agent": {
                        **server,
                        "port": ports["agent"],
                        "resources_server": {"type": "resources_servers", "name": "calculator"},
                        "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    }
                }
            },
            "policy_model": {
                "responses_api_models": {
                    "vllm_model": {
                        **server,
                        "port": ports["model"],
                        "base_url": f"http://{HOST}:{self.policy_port}/v1",
                        "api_key": "none",
                        "model": "policy",
                        "return_token_id_information": True,
                        "uses_reasoning_parser": False,
                    }
                }
            },
        }
        self.models, self.agent, self.restarts = ExitStack(), ExitStack(), 0
        self.models.enter_context(self.gym_servers(self.config, self.logs, external=("calculator", "calculator_agent")))
        self._start_agent()
        ref = {"agent_ref": {"type": "responses_api_agents", "name": "calculator_agent"}}
        for split in ("train", "val"):
            rows = read_jsonl(ROOT / "data" / "tool_demo" / f"{split}.jsonl")[:2000]
            (out / f"gym_{split}.jsonl").write_text("".join(json.dumps({**row, **ref}) + "\n" for row in rows))
        self.data = out

    def _start_agent(self) -> None:
        logs = self.logs / f"agent_{self.restarts}"
        self.agent.enter_context(self.gym_servers(self.config, logs, external=("calculator", "policy_model")))

    def overrides(self) -> list[str]:
        return [
            "model.name_or_path=models/tool_demo",
            f"data.train_path={self.data / 'gym_train.jsonl'}",
            f"data.val_path={self.data / 'gym_val.jsonl'}",
            "data.max_val_prompts=32",
            "rollout.driver=agent",
            "rollout.max_turns=3",
            "rollout.num_generations_per_prompt=4",
            *BATCH_32,
            f"agent.endpoint.port={self.policy_port}",
            f"agent.gym.calculator_agent.url=http://{HOST}:{self.agent_port}",
        ]

    def kill_agent(self) -> bool:
        """SIGKILL the Gym agent's process; it is back on its port 5 s later."""
        victims = [pid for pid in all_pids() if "simple_agent" in cmdline(pid) and "app.py" in cmdline(pid)]
        if not victims:
            return False
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        self.agent.close()  # reaps what is left of it
        time.sleep(5)
        self.restarts += 1
        self._start_agent()
        return True

    def close(self) -> None:
        self.agent.close()
        self.models.close()
        self.calculator.kill()
        self.calculator.wait()


class FaultProxy:
    """An HTTP proxy in front of `upstream` that passes every request through, except during a fault window:
    `503` answers every request with HTTP 503; `trickle` forwards the request but sends the answer's body one byte a
    second (headers at once, as a server stuck writing would), until the client gives up or the proxy closes."""

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://")
        self.mode, self.until, self.closed = "", 0.0, threading.Event()
        self.faulted = 0  # requests answered with the fault
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                proxy.handle(self)

            do_POST = do_GET

        self.server = ThreadingHTTPServer((HOST, free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fault(self, mode: str, seconds: float) -> None:
        self.mode, self.until, self.faulted = mode, time.time() + seconds, 0

    def active(self) -> bool:
        return time.time() < self.until

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        mode = self.mode if self.active() else ""
        if mode == "503":
            self.faulted += 1
            return self._answer(request, 503, {"Content-Type": "application/json"}, b'{"error": "unavailable"}')
        upstream = http.client.HTTPConnection(self.upstream, timeout=600)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "connection")}
        upstream.request(request.command, request.path, body=body, headers=headers)
        answer = upstream.getresponse()
        content, status = answer.read(), answer.status
        headers = {k: v for k, v in answer.getheaders() if k.lower() not in ("transfer-encoding", "connection")}
        upstream.close()
        if mode != "trickle":
            return self._answer(request, status, headers, content)
        self.faulted += 1
        self._answer(request, status, headers, b"", length=len(content))
        for byte in range(len(content)):
            if self.closed.wait(1.0):
                break
            try:
                request.wfile.write(content[byte : byte + 1])
                request.wfile.flush()
            except OSError:  # the client gave up
                break
        request.close_connection = True

    @staticmethod
    def _answer(request, status: int, headers: dict, content: bytes, length: int | None = None) -> None:
        request.send_response(status)
        for key, value in headers.items():
            if key.lower() not in ("content-length", "date", "server"):
                request.send_header(key, value)
        request.send_header("Content-Length", str(len(content) if length is None else length))
        request.end_headers()
        if content:
            request.wfile.write(content)

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()


class EnvServer:
    """`reinforge env serve --env math` in its own process, behind a FaultProxy: a run uses it as env.remote.math."""

    def __init__(self, out: Path):
        port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "reinforge.cli", "env", "serve", "--env", "math", "--port", str(port)],
            stdout=open(out / "env_server.log", "w"),
            stderr=subprocess.STDOUT,
        )
        wait_healthy(f"http://{HOST}:{port}", self.process)
        self.proxy = FaultProxy(f"http://{HOST}:{port}")

    def overrides(self) -> list[str]:
        return [f"env.remote.math.url={self.proxy.url}"]

    def close(self) -> None:
        self.proxy.close()
        self.process.kill()
        self.process.wait()


JUDGED = re.compile(r"\[Reference answer\]\n(.*?)\n\n\[Response\]\n(.*)\Z", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeServer:
    """A deterministic OpenAI-compatible chat judge (the demo model cannot judge): `[[10]]` when the last number of
    the response in envs/judge.py's default rubric equals the reference answer, else `[[0]]`; behind a FaultProxy.
    The run's data are the demo's with `task: judge`."""

    def __init__(self, out: Path):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._json({"status": "ok"} if self.path == "/health" else {"data": [{"id": "judge"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                match = JUDGED.search(body["messages"][-1]["content"])
                numbers = NUMBER.findall(match.group(2)) if match else []
                right = bool(numbers) and float(numbers[-1]) == float(match.group(1).strip())
                verdict = f"Checked against the reference. [[{10 if right else 0}]]"
                self._json({"choices": [{"index": 0, "message": {"role": "assistant", "content": verdict}}]})

            def _json(self, payload: dict) -> None:
                content = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.server = ThreadingHTTPServer((HOST, free_port()), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.proxy = FaultProxy(f"http://{HOST}:{self.server.server_address[1]}")
        for split in ("train", "val"):
            rows = [json.loads(line) for line in (ROOT / "data" / "demo" / f"{split}.jsonl").read_text().splitlines()]
            (out / f"judge_{split}.jsonl").write_text("".join(json.dumps({**r, "task": "judge"}) + "\n" for r in rows))
        self.data = out

    def overrides(self) -> list[str]:
        return [
            f"data.train_path={self.data / 'judge_train.jsonl'}",
            f"data.val_path={self.data / 'judge_val.jsonl'}",
            "env.judge.mode=chat",
            f"env.judge.url={self.proxy.url}/v1",
            "env.judge.model=judge",
        ]

    def close(self) -> None:
        self.proxy.close()
        self.server.shutdown()
        self.server.server_close()


class SmallDisk:
    """A tmpfs of `size` mounted for the run directory; `fill` takes its free space with one file, `free` gives it
    back. `mounted` is False (and the reason in `why`) where mounting is not permitted."""

    def __init__(self, out: Path, size: str = "160m"):
        self.path, self.filler = out / "small_disk", out / "small_disk" / "filler"
        self.path.mkdir(parents=True, exist_ok=True)
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)], text=True,
                               capture_output=True)  # fmt: skip
        self.mounted, self.why = mount.returncode == 0, (mount.stderr or mount.stdout).strip()

    def fill(self) -> int:
        """Take every free byte; returns how many."""
        stat = os.statvfs(self.path)
        size = stat.f_bavail * stat.f_frsize
        with open(self.filler, "wb") as file:
            try:
                os.posix_fallocate(file.fileno(), 0, size)
            except OSError:  # no fallocate: write until the disk is full
                with contextlib.suppress(OSError):
                    while True:
                        file.write(b"\0" * (1 << 20))
        return size

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


class RayNodes:
    """Ray's multi-node test cluster on this machine: node A (the head, `node_a`) holds the trainer, node B
    (`node_b`) the generation engine; `lose` removes node B and adds a fresh one 5 s later."""

    def __init__(self):
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 2}})
        self.node_b = self._add_b()

    def _add_b(self):
        node = self.cluster.add_node(num_cpus=2, resources={"node_b": 1})
        self.cluster.wait_for_nodes()
        return node

    def overrides(self) -> list[str]:
        return [
            f"cluster.address={self.cluster.address}",
            "cluster.colocate=false",
            "cluster.training_resources={node_a: 1}",
            "cluster.generation_resources={node_b: 1}",
            "cluster.num_threads=1",
        ]

    def lose(self) -> bool:
        """Remove node B now; `tick` (Ray adds nodes from the main thread only) adds a fresh one 5 s later."""
        self.cluster.remove_node(self.node_b, allow_graceful=False)
        self.node_b, self.add_at = None, time.time() + 5
        return True

    def tick(self) -> None:
        if self.node_b is None and time.time() >= self.add_at:
            self.node_b = self._add_b()

    def close(self) -> None:
        self.cluster.shutdown()


class Servers:
    """A scenario's servers (each None where the scenario has none): its overrides for the run, and their closing."""

    def __init__(self, setup: str, out: Path):
        self.gym = GymServers(out) if setup == "gym" else None
        self.http = EnvServer(out) if setup == "env_http" else JudgeServer(out) if setup == "judge_http" else None
        self.disk = SmallDisk(out) if setup == "disk" else None
        self.nodes = RayNodes() if setup == "lost_node" else None

    def overrides(self) -> list[str]:
        return [*(arg for part in (self.gym, self.http, self.nodes) if part for arg in part.overrides())]

    def tick(self) -> None:
        """What must happen on the main thread (a Ray node added back)."""
        if self.nodes:
            self.nodes.tick()

    def close(self) -> None:
        for part in (self.gym, self.http, self.disk, self.nodes):
            if part:
                part.close()
