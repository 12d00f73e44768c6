"""The judge environment: a model scores each response, over HTTP or in this process.

Three modes (`JudgeEnvConfig.mode`):

- `chat`: an OpenAI-compatible chat-completions server (vLLM, SGLang, a hosted API) acts as the
  judge. Each sample is one `POST {url}/chat/completions` with `prompt_template` filled in as the
  user message (after `system_prompt`, if any), `temperature` and `max_tokens`. The last match of
  `score_pattern` in the judge's answer is the score; reward = (score - min_score) /
  (max_score - min_score). An answer with no match, or a score outside [min_score, max_score], is
  *unparseable*: it scores `failure_reward` and is counted, and is not asked again (a greedy
  judge would repeat itself).
- `reward_model`: a reward-model server (`reinforge serve-rm`, reward_model_server.py) scores the
  whole conversations, `batch_size` per `POST {url}/score`. reward = the model's score
  (`reward_model_transform="sigmoid"` maps it into (0, 1)).
- `local`: the same reward model in this process (`RewardModelScorer`), `batch_size` per forward
  pass. The server and local mode share the scoring code, so they give the same scores.

Template placeholders: `{question}` (the last user message before the response), `{response}`
(the last message), `{reference}` (`record[reference_key]`), `{conversation}` (every message before
the response, one `role: content` block each). Literal braces are written `{{` and `}}`.

HTTP calls run on a pool of `max_concurrency` threads sharing one httpx client, so `step` can be
called from any ordinary thread. Each attempt waits at most `timeout_s` to connect, to send, and
between received bytes. A connection error, a timeout, HTTP 408, 429 or 5xx is retried up to
`max_retries` times after `retry_backoff_s`, doubling each time; any other 4xx is a client error
(wrong model name, missing key, prompt longer than the judge's context) and is not retried.

Failures: a call that fails after its retries fails its samples (one in chat mode, up to
`batch_size` in reward_model mode). A dead or misconfigured judge must not silently zero every
reward, so by default (`max_failed_fraction=0`) the first failure raises `JudgeError`, naming the
URL and the cause, as soon as it happens: calls still queued are cancelled and no further retries
start. A larger `max_failed_fraction` tolerates that share of a step's samples failing (each scores
`failure_reward` and counts in `judge_errors`); 1 never raises. The time a dead judge costs is
bounded: each call makes at most `max_retries + 1` attempts of at most `timeout_s` each (per
connect, send, or gap between bytes) plus the backoff waits.

Metrics (counts since the last `metrics()` call): `judge_errors` (samples whose call failed),
`retries` (attempts after the first), `unparseable` (judge answers without a usable score),
`calls` (successful calls or local forward batches), `latency_s_mean` and `latency_s_max` (seconds
per successful call).
"""

from __future__ import annotations

import math
import os
import re
import string
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Literal

import httpx
from pydantic import model_validator

from reinforge.config.section import Section
from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.errors import ConfigError, DataError, ReinforgeError

DEFAULT_PROMPT_TEMPLATE = """\
Please act as an impartial judge and evaluate the response to the question below. Compare it with \
the reference answer and rate its correctness on a scale of 0 to 10. Explain briefly, then give \
your rating in exactly this format: [[N]], for example [[7]].

[Question]
{question}

[Reference answer]
{reference}

[Response]
{response}"""

PLACEHOLDERS = ("question", "response", "reference", "conversation")


class JudgeEnvConfig(Section):
    mode: Literal["chat", "reward_model", "local"] = "chat"
    """`chat`: an OpenAI-compatible chat model judges with `prompt_template`; `reward_model`: a
    `reinforge serve-rm` server scores conversations over HTTP; `local`: a Hugging Face
    sequence-classification reward model in this process."""
    url: str = ""
    """Base URL of the server. chat: the OpenAI base URL, e.g. `http://127.0.0.1:8000/v1`
    (requests go to `{url}/chat/completions`); reward_model: the server root, e.g.
    `http://127.0.0.1:8001` (requests go to `{url}/score`). Unused in local mode."""
    model: str = ""
    """chat: the judge's model name as the server knows it (vLLM: `--served-model-name`)."""
    api_key_env: str = ""
    """Name of the environment variable holding the API key, sent as `Authorization: Bearer`; empty
    sends no key. The key itself never goes in a config."""
    system_prompt: str = ""
    """chat: system message sent before the rubric; empty sends none."""
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    """chat: the judge's user message, with placeholders {question}, {response}, {reference} and
    {conversation} (see the module doc); literal braces are doubled."""
    reference_key: str = "answer"
    """The dataset record's field that fills {reference}."""
    score_pattern: str = r"\[\[(-?\d+(?:\.\d+)?)\]\]"
    """chat: regular expression with one group capturing the score; the last match counts. For
    "Score: 7" use `(?i)score:\\s*(-?\\d+(?:\\.\\d+)?)`."""
    min_score: float = 0.0
    """chat: the lowest score the rubric allows; it maps to reward 0."""
    max_score: float = 10.0
    """chat: the highest score the rubric allows; it maps to reward 1."""
    temperature: float = 0.0
    """chat: the judge's sampling temperature; 0 is greedy, so identical samples get identical verdicts."""
    max_tokens: int = 512
    """chat: the most tokens the judge may write."""
    reward_model_transform: Literal["none", "sigmoid"] = "none"
    """reward_model and local: `none` uses the reward model's score as the reward; `sigmoid` maps
    it into (0, 1)."""
    batch_size: int = 8
    """reward_model: conversations per `POST /score`; local: conversations per forward pass."""
    max_concurrency: int = 8
    """HTTP calls in flight at once (threads and connections)."""
    timeout_s: float = 60.0
    """Per attempt: the longest wait to connect, to send, or between bytes of the answer."""
    max_retries: int = 3
    """Attempts after the first for connection errors, timeouts and HTTP 408, 429, 5xx."""
    retry_backoff_s: float = 1.0
    """Wait before the first retry; it doubles before each further one."""
    max_failed_fraction: float = 0.0
    """Largest fraction of a step's samples whose call may fail after all retries, each then scoring
    `failure_reward`; past it `step` raises JudgeError. 0: any failure raises (a dead judge must
    not silently zero the rewards); 1: never raises."""
    failure_reward: float = 0.0
    """Reward of an unparseable judgement, and of a failed call that `max_failed_fraction` tolerates."""
    local_model_path: str = ""
    """local: directory of a Hugging Face sequence-classification model with one label and a
    tokenizer with a chat template."""
    device: str = "cpu"
    """local: torch device of the reward model, e.g. `cpu` or `cuda:0`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """local: the reward model's parameter dtype."""
    max_length: int = 2048
    """local: the most tokens per conversation; longer ones lose their beginning (the response is
    kept)."""

    @model_validator(mode="after")
    def _check(self) -> "JudgeEnvConfig":
        # The fields each mode needs are checked when the env is built: the default section is valid.
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"env.judge.url={self.url!r} must start with http:// or https://")
        if self.url.rstrip("/").endswith(("/chat/completions", "/score")):
            raise ValueError(
                f"env.judge.url={self.url!r} must be the base URL; the judge appends /chat/completions or /score"
            )
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as exc:
            raise ValueError(
                f"env.judge.score_pattern={self.score_pattern!r} is not a regular expression: {exc}"
            ) from None
        if groups != 1:
            raise ValueError(
                f"env.judge.score_pattern={self.score_pattern!r} has {groups} groups; "
                "it needs exactly one, capturing the score"
            )
        for _, field, spec, conversion in string.Formatter().parse(self.prompt_template):
            if field is not None and (field not in PLACEHOLDERS or spec or conversion):
                raise ValueError(
                    f"env.judge.prompt_template has the placeholder {{{field}}}; the placeholders are "
                    f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}; write literal braces as {{{{ and }}}}"
                )
        checks = [
            (self.max_score > self.min_score, "env.judge.max_score must be greater than env.judge.min_score"),
            (self.batch_size >= 1, "env.judge.batch_size must be >= 1"),
            (self.max_concurrency >= 1, "env.judge.max_concurrency must be >= 1"),
            (self.timeout_s > 0, "env.judge.timeout_s must be > 0"),
            (self.max_retries >= 0, "env.judge.max_retries must be >= 0"),
            (self.retry_backoff_s >= 0, "env.judge.retry_backoff_s must be >= 0"),
            (0 <= self.max_failed_fraction <= 1, "env.judge.max_failed_fraction must be in [0, 1]"),
            (self.max_tokens >= 1, "env.judge.max_tokens must be >= 1"),
            (self.max_length >= 1, "env.judge.max_length must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


class JudgeError(ReinforgeError):
    """The judge failed on more samples than `max_failed_fraction` allows; says where and why."""


class _Retryable(Exception):
    """A failed attempt worth repeating: connection error, timeout, 408, 429 or 5xx."""


class _Fatal(Exception):
    """A failed attempt that would fail again: another 4xx, or an answer that breaks the protocol."""


@dataclass
class _Failure:
    """A call that failed after its retries."""

    cause: str


class JudgeEnv:
    """Scores responses with a judge model or a reward model; see the module doc."""

    def __init__(self, config: JudgeEnvConfig) -> None:
        needs = {"chat": ("url", "model"), "reward_model": ("url",), "local": ("local_model_path",)}[config.mode]
        for name in needs:
            if not getattr(config, name):
                raise ConfigError(f"env.judge.{name} must be set when env.judge.mode={config.mode}")
        self.config = config
        self._lock = threading.Lock()  # guards the counters; step may run in several threads
        self._counts = dict.fromkeys(["judge_errors", "retries", "unparseable", "calls"], 0)
        self._latencies: list[float] = []
        self._placeholders = {field for _, field, _, _ in string.Formatter().parse(config.prompt_template) if field}
        if config.mode == "local":
            from reinforge.envs.reward_model_server import RewardModelScorer

            self._scorer = RewardModelScorer(
                config.local_model_path,
                device=config.device,
                dtype=config.dtype,
                max_length=config.max_length,
                batch_size=config.batch_size,
            )
            return
        headers = {}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ConfigError(
                    f"env.judge.api_key_env={config.api_key_env}: that environment variable is not set; "
                    "export the judge's API key in it"
                )
            headers["Authorization"] = f"Bearer {key}"
        path = "/chat/completions" if config.mode == "chat" else "/score"
        self.endpoint = config.url.rstrip("/") + path
        self._client = httpx.Client(
            headers=headers,
            timeout=config.timeout_s,
            limits=httpx.Limits(
                max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency
            ),
        )
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="judge")

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        if self.config.mode == "chat":
            return self._step_chat(requests)
        conversations = [request.messages for request in requests]
        size = self.config.batch_size
        chunks = [conversations[i : i + size] for i in range(0, len(conversations), size)]
        if self.config.mode == "local":
            results = [self._timed(lambda chunk=chunk: self._scorer.score(chunk)) for chunk in chunks]
        else:
            results = self._call_all(
                [lambda chunk=chunk: self._score(chunk) for chunk in chunks], [len(c) for c in chunks]
            )
        responses = []
        for chunk, result in zip(chunks, results):
            if isinstance(result, _Failure):
                responses += [
                    EnvResponse(reward=self.config.failure_reward, info={"judge_error": result.cause}) for _ in chunk
                ]
            else:
                responses += [
                    EnvResponse(reward=self._transform(score), info={"reward_model_score": score}) for score in result
                ]
        return responses

    def _step_chat(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        prompts = [self._judge_messages(request) for request in requests]  # data errors before any call
        answers = self._call_all(
            [lambda messages=messages: self._chat(messages) for messages in prompts], [1] * len(prompts)
        )
        responses = []
        for answer in answers:
            if isinstance(answer, _Failure):
                responses.append(EnvResponse(reward=self.config.failure_reward, info={"judge_error": answer.cause}))
                continue
            score = self.parse_score(answer)
            if score is None:
                with self._lock:
                    self._counts["unparseable"] += 1
                reward = self.config.failure_reward
            else:
                reward = (score - self.config.min_score) / (self.config.max_score - self.config.min_score)
            responses.append(EnvResponse(reward=reward, info={"judge_output": answer, "judge_score": score}))
        return responses

    def parse_score(self, answer: str) -> float | None:
        """The last `score_pattern` match in the judge's answer, None if none is in range."""
        matches = re.findall(self.config.score_pattern, answer)
        if not matches:
            return None
        try:
            score = float(matches[-1])
        except ValueError:
            return None
        return score if self.config.min_score <= score <= self.config.max_score else None

    def _judge_messages(self, request: EnvRequest) -> list[dict[str, str]]:
        history, response = request.messages[:-1], request.messages[-1]["content"]
        values = {
            "response": response,
            "question": next((m["content"] for m in reversed(history) if m["role"] == "user"), ""),
            "conversation": "\n\n".join(f"{m['role']}: {m['content']}" for m in history),
            "reference": "",
        }
        if "reference" in self._placeholders:
            if self.config.reference_key not in request.record:
                raise DataError(
                    f"the judge's prompt_template uses {{reference}} but a record has no {self.config.reference_key!r} "
                    f"(keys: {sorted(request.record)}); "
                    "set env.judge.reference_key or drop {reference} from the template"
                )
            values["reference"] = str(request.record[self.config.reference_key])
        messages = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return messages + [{"role": "user", "content": self.config.prompt_template.format(**values)}]

    def _chat(self, messages: list[dict[str, str]]) -> str:
        body = self._post(
            {
                "model": self.config.model,
                "messages": messages,
                "temperature": self.config.temperature,
                "max_tokens": self.config.max_tokens,
            }
        )
        try:
            content = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise _Fatal(f"the answer has no choices[0].message.content: {str(body)[:300]}") from None
        return content or ""  # a null content (e.g. only reasoning) has no score: unparseable

    def _score(self, conversations: list[list[dict[str, str]]]) -> list[float]:
        body = self._post({"conversations": conversations})
        scores = body.get("scores") if isinstance(body, dict) else None
        if (
            not isinstance(scores, list)
            or len(scores) != len(conversations)
            or not all(isinstance(score, (int, float)) and not isinstance(score, bool) for score in scores)
        ):
            raise _Fatal(f'expected {{"scores": [{len(conversations)} numbers]}}, got {str(body)[:300]}')
        return [float(score) for score in scores]

    def _post(self, payload: dict[str, Any]) -> Any:
        try:
            response = self._client.post(self.endpoint, json=payload)
        except httpx.TimeoutException as exc:
            raise _Retryable(f"{type(exc).__name__}: no answer within timeout_s={self.config.timeout_s}") from None
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        except httpx.HTTPError as exc:  # decoding errors, redirect loops: trying again changes nothing
            raise _Fatal(f"{type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            error = _Retryable if response.status_code in (408, 429) or response.status_code >= 500 else _Fatal
            raise error(f"HTTP {response.status_code}: {response.text[:300]}")
        try:
            return response.json()
        except ValueError:
            raise _Fatal(f"the answer is not JSON: {response.text[:300]!r}") from None

    def _call_all(self, calls: list[Callable[[], Any]], sizes: list[int]) -> list[Any]:
        """Each call's result or `_Failure`, in order; raises JudgeError as soon as the failed
        samples exceed `max_failed_fraction` of them all."""
        allowed = math.floor(self.config.max_failed_fraction * sum(sizes) + 1e-9)
        abort = threading.Event()
        futures = [self._pool.submit(self._with_retries, call, abort) for call in calls]
        index_of: dict[Future, int] = {future: i for i, future in enumerate(futures)}
        results: list[Any] = [None] * len(calls)
        failed = 0
        for future in as_completed(futures):
            i = index_of[future]
            results[i] = future.result()
            if not isinstance(results[i], _Failure):
                continue
            failed += sizes[i]
            with self._lock:
                self._counts["judge_errors"] += sizes[i]
            if failed > allowed:
                abort.set()  # queued calls return at once; running ones start no further attempt
                for other in futures:
                    other.cancel()
                raise JudgeError(
                    f"the judge at {self.endpoint} failed: {results[i].cause}; "
                    f"{failed} of {sum(sizes)} samples failed, "
                    f"more than env.judge.max_failed_fraction={self.config.max_failed_fraction} allows"
                )
        return results

    def _with_retries(self, call: Callable[[], Any], abort: threading.Event) -> Any:
        attempts = 0
        for attempt in range(self.config.max_retries + 1):
            if attempt and abort.wait(self.config.retry_backoff_s * 2 ** (attempt - 1)):
                break
            if abort.is_set():
                break
            if attempt:
                with self._lock:
                    self._counts["retries"] += 1
            attempts += 1
            try:
                return self._timed(call)
            except _Retryable as exc:
                cause = str(exc)
            except _Fatal as exc:
                return _Failure(f"{exc} (not retried)")
        if attempts == 0:
            return _Failure("cancelled after another call failed")
        return _Failure(f"{cause} (after {attempts} attempt{'s' if attempts > 1 else ''})")

    def _timed(self, call: Callable[[], Any]) -> Any:
        start = time.monotonic()
        result = call()
        with self._lock:
            self._counts["calls"] += 1
            self._latencies.append(time.monotonic() - start)
        return result

    def _transform(self, score: float) -> float:
        if self.config.reward_model_transform == "sigmoid":
            return 0.5 * (1 + math.tanh(score / 2))  # the logistic function, without exp overflow
        return score

    def metrics(self) -> dict[str, float]:
        with self._lock:
            metrics = {name: float(count) for name, count in self._counts.items()}
            metrics["latency_s_mean"] = sum(self._latencies) / len(self._latencies) if self._latencies else 0.0
            metrics["latency_s_max"] = max(self._latencies, default=0.0)
            self._counts = dict.fromkeys(self._counts, 0)
            self._latencies = []
        return metrics

    def close(self) -> None:
        if self.config.mode != "local":
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._client.close()
