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
between received bytes, and each call (its attempts and the waits between them) ends by `deadline_s`
from its start: an answer still trickling in then is a timeout (envs/http_calls.py). A connection
error, a timeout, HTTP 408, 429 or 5xx, or a 2xx answer that is not the protocol's JSON (a proxy's
error page) is retried up to `max_retries` times after the server's `Retry-After` when it sent one,
else after `retry_backoff_s`, doubling each time; a retry that could not start before the deadline is
not made.

Failures are typed by whose they are (docs/reliability.md):
- the judge's machinery (a call still failing after its retries, or past its deadline): no verdict.
  Each of its samples is an infrastructure failure (`infra_failure="judge"`, `info["infra_error"]`
  names the URL and the cause), which the rollout runs again and then masks (rollout/infra.py), never
  a reward. Counted in `judge_errors` here and `rollout/infra_judge` there.
- the run's configuration: any other 4xx (a wrong key 401/403, a wrong URL or model 404, a request
  the judge refuses, e.g. a prompt longer than its context 400) raises `JudgeError` at once, one line
  naming the URL and the answer; calls still queued are cancelled and no further retries start.
- the judgement itself: an answer with no usable score is `unparseable` and scores `failure_reward`.

`step` as a whole waits at most `deadline_s + timeout_s` per wave of `max_concurrency` calls (a
safety net: each call ends by its own deadline); a call still unfinished then is an infrastructure
failure like any other.

Metrics (counts since the last `metrics()` call): `judge_errors` (samples whose call failed: masked as
infrastructure failures), `retries` (attempts after the first), `unparseable` (judge answers without a
usable score), `calls` (successful calls or local forward batches), `latency_s_mean` and
`latency_s_max` (seconds per successful call).
"""

from __future__ import annotations

import math
import os
import re
import string
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from reinforge.envs.base import EnvRequest, EnvResponse
from reinforge.envs.http_calls import one_line, retry_after_s, retry_wait, retryable_status, send_within
from reinforge.envs.judge_config import JudgeEnvConfig
from reinforge.errors import ConfigError, DataError, ReinforgeError


class JudgeError(ReinforgeError):
    """The judge refused a request in a way that repeats (a wrong key, URL or model): the run's configuration."""


class _Retryable(Exception):
    """A failed attempt worth repeating: connection error, timeout, 408, 429, 5xx or a malformed answer."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Refused(Exception):
    """An answer that would be the same again: a 4xx other than 408 and 429."""


@dataclass
class _Failure:
    """A call that failed after its retries (`refused`: the judge's 4xx, the run's configuration)."""

    cause: str
    refused: bool = False


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
            results = [self._timed(self._scorer.score, chunk) for chunk in chunks]
        else:
            results = self._call_all(
                [lambda deadline, chunk=chunk: self._score(chunk, deadline) for chunk in chunks],
                [len(c) for c in chunks],
            )
        responses = []
        for chunk, result in zip(chunks, results):
            if isinstance(result, _Failure):
                responses += [self._unscored(result) for _ in chunk]
            else:
                responses += [
                    EnvResponse(reward=self._transform(score), info={"reward_model_score": score}) for score in result
                ]
        return responses

    def _step_chat(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        prompts = [self._judge_messages(request) for request in requests]  # data errors before any call
        answers = self._call_all(
            [lambda deadline, messages=messages: self._chat(messages, deadline) for messages in prompts],
            [1] * len(prompts),
        )
        responses = []
        for answer in answers:
            if isinstance(answer, _Failure):
                responses.append(self._unscored(answer))
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

    def _unscored(self, failure: _Failure) -> EnvResponse:
        """A sample whose call failed: no verdict, an infrastructure failure (retried, then masked by the rollout)."""
        error = f"judge {self.endpoint}: {failure.cause}"
        return EnvResponse(reward=0.0, infra_failure="judge", info={"judge_error": failure.cause, "infra_error": error})

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

    def _chat(self, messages: list[dict[str, str]], deadline: float) -> str:
        body = self._post(
            deadline,
            {
                "model": self.config.model,
                "messages": messages,
                "temperature": self.config.temperature,
                "max_tokens": self.config.max_tokens,
            },
        )
        try:
            content = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise _Retryable(f"the answer has no choices[0].message.content: {one_line(str(body)[:300])}") from None
        return content or ""  # a null content (e.g. only reasoning) has no score: unparseable

    def _score(self, conversations: list[list[dict[str, str]]], deadline: float) -> list[float]:
        body = self._post(deadline, {"conversations": conversations})
        scores = body.get("scores") if isinstance(body, dict) else None
        if (
            not isinstance(scores, list)
            or len(scores) != len(conversations)
            or not all(isinstance(score, (int, float)) and not isinstance(score, bool) for score in scores)
        ):
            raise _Retryable(f'expected {{"scores": [{len(conversations)} numbers]}}, got {one_line(str(body)[:300])}')
        return [float(score) for score in scores]

    def _post(self, deadline: float, payload: dict[str, Any]) -> Any:
        try:
            response = send_within(self._client, "POST", self.endpoint, deadline, json=payload)
        except httpx.TimeoutException as exc:
            raise _Retryable(f"{type(exc).__name__}: {one_line(exc)} (timeout_s={self.config.timeout_s:g})") from None
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {one_line(exc)}") from None
        except httpx.HTTPError as exc:  # decoding errors, redirect loops: trying again changes nothing
            raise _Refused(f"{type(exc).__name__}: {one_line(exc)}") from None
        if response.status_code >= 400:
            cause = f"HTTP {response.status_code}: {one_line(response.text[:300])}"
            if retryable_status(response.status_code):
                raise _Retryable(cause, retry_after_s(response))
            raise _Refused(cause)
        try:
            return response.json()
        except ValueError:
            raise _Retryable(f"the answer is not JSON: {one_line(response.text[:300])!r}") from None

    def _call_all(self, calls: list[Callable[[float], Any]], sizes: list[int]) -> list[Any]:
        """Each call's result or `_Failure`, in order; raises JudgeError at the first refused call, and gives up on
        the calls still running past the step's safety deadline (module doc)."""
        abort = threading.Event()
        futures = [self._pool.submit(self._with_retries, call, abort) for call in calls]
        index_of: dict[Future, int] = {future: i for i, future in enumerate(futures)}
        results: list[Any] = [_Failure("no answer before the step's deadline")] * len(calls)
        waves = math.ceil(len(calls) / self.config.max_concurrency)
        step_deadline_s = waves * (self.config.deadline_s + self.config.timeout_s) + 5.0
        try:
            for future in as_completed(futures, timeout=step_deadline_s):
                i = index_of[future]
                results[i] = future.result()
                if isinstance(results[i], _Failure) and results[i].refused:
                    raise JudgeError(
                        f"the judge at {self.endpoint} refused a request: {results[i].cause}; such an answer repeats: "
                        "check env.judge.url, env.judge.model and env.judge.api_key_env, and that the judge's context "
                        "holds the rubric and the longest response"
                    )
        except FuturesTimeout:
            pass  # the calls not done are unscored (infrastructure failures); abort below stops their retries
        finally:
            abort.set()  # queued calls return at once; running ones start no further attempt
            for future in futures:
                future.cancel()
        failed = sum(size for size, result in zip(sizes, results) if isinstance(result, _Failure))
        with self._lock:
            self._counts["judge_errors"] += failed
        return results

    def _with_retries(self, call: Callable[[float], Any], abort: threading.Event) -> Any:
        deadline = time.monotonic() + self.config.deadline_s
        attempts, retry_after, cause = 0, None, "cancelled before its first attempt"
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                wait = retry_wait(attempt, self.config.retry_backoff_s, retry_after, deadline)
                if wait is None:
                    cause += f"; no time left for a retry within env.judge.deadline_s={self.config.deadline_s:g}"
                    break
                if abort.wait(wait):
                    break
            if abort.is_set():
                break
            if attempt:
                with self._lock:
                    self._counts["retries"] += 1
            attempts += 1
            try:
                return self._timed(call, deadline)
            except _Retryable as exc:
                cause, retry_after = str(exc), exc.retry_after
            except _Refused as exc:
                return _Failure(f"{exc} (not retried)", refused=True)
        if attempts == 0:
            return _Failure(cause)
        return _Failure(f"{cause} (after {attempts} attempt{'s' if attempts > 1 else ''})")

    def _timed(self, call: Callable[..., Any], *args: Any) -> Any:
        start = time.monotonic()
        result = call(*args)
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
