"""Start-up probes against real HTTP servers on 127.0.0.1 (loops/probes.py): a refused port, a wrong token or key
(401) and a wrong URL (404) are one-line configuration errors; an answer, or a 5xx (infrastructure, for the calls
to retry), passes."""

import pytest
from _http import QuietHandler, served

from reinforge.algorithms.grpo_config import load_config
from reinforge.data.prompts import Prompt
from reinforge.envs.http_server import build_app
from reinforge.envs.math_env import MathEnv
from reinforge.errors import ConfigError
from reinforge.loops.probes import probe, probe_servers
from reinforge.network import ThreadedServer, free_port


class Answers(QuietHandler):
    """Answers each path with the status its first segment names: /401/..., /404/..., /200/..., /503/..."""

    def _answer(self):
        status = int(self.path.strip("/").split("/")[0] or 200)
        body = b'{"detail": "as asked"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


server = served(Answers, "server")


def test_a_refused_port_a_wrong_key_and_a_wrong_url_are_one_line_and_an_answer_or_5xx_passes(server):
    refused = f"http://127.0.0.1:{free_port('127.0.0.1')}/metrics"  # free a moment ago: nothing listens
    with pytest.raises(ConfigError, match=r"env.remote.math.url: .* cannot be reached at start-up") as error:
        probe("env.remote.math.url", refused)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"refused the credentials \(HTTP 401: as asked\)"):
        probe("env.judge.url", f"{server}/401/models")
    with pytest.raises(ConfigError, match=r"answered HTTP 404 \(as asked\) at start-up"):
        probe("env.judge.url", f"{server}/404/models")
    probe("env.judge.url", f"{server}/200/models")
    probe("env.judge.url", f"{server}/503/models")  # infrastructure: the calls retry it
    probe("env.judge.url", f"{server}/429/models")


def test_a_run_probes_its_env_servers_token_and_its_judges_url(server, monkeypatch):
    app = build_app(MathEnv(), token="right", max_request_bytes=1 << 20)
    env_server = ThreadedServer(app, "127.0.0.1", 0, "math env").start()
    try:
        monkeypatch.setenv("ENV_TOKEN", "wrong")
        remote = [f"env.remote.math.url={env_server.url}", "env.remote.math.token_env=ENV_TOKEN"]
        with pytest.raises(
            ConfigError, match=r"env.remote.math.url \(token: ENV_TOKEN\): .* \(HTTP 401: missing or wrong bearer"
        ):
            probe_servers(load_config(None, remote), {"math"}, [])
        monkeypatch.setenv("ENV_TOKEN", "right")
        probe_servers(load_config(None, remote), {"math"}, [])
        judge = ["env.judge.mode=chat", f"env.judge.url={server}/404/v1", "env.judge.model=judge"]
        expected = r"env.judge.url \(key: none\), env.judge.model=judge: .*/404/v1/chat/completions answered HTTP 404"
        with pytest.raises(ConfigError, match=expected):
            probe_servers(load_config(None, judge), {"judge"}, [])
        probe_servers(load_config(None, judge), {"math"}, [])  # a judge the run does not use is not probed
    finally:
        env_server.stop()


def test_a_gym_resources_server_answering_4xx_to_the_first_session_is_one_line(server):
    gym = [f"env.gym.weather.url={server}/404", "env.default_task=weather"]
    prompt = Prompt(record={"task": "weather", "responses_create_params": {"input": []}}, messages=[], token_ids=[1])
    with pytest.raises(ConfigError, match=r"env.gym.weather.url: .*/404/seed_session answered HTTP 404"):
        probe_servers(load_config(None, gym), {"weather"}, [prompt])
    probe_servers(load_config(None, [f"env.gym.weather.url={server}/200"]), {"weather"}, [prompt])
    probe_servers(load_config(None, gym), {"weather"}, [])  # no record of the task: nothing to seed, no probe
