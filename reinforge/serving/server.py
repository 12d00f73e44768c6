"""The endpoint's state and rules: one policy over an engine, and, inside a GRPO run, the rollout sessions
during which agents may call it. serving/app.py is its HTTP adapter; whoever starts the endpoint builds
that app and hands it to `start`.

Standalone (`reinforge serve`) every request is served with the settings it asks for. In a run the
endpoint is *managed*: it answers only while a rollout is under way (`rollout_session`; in flight several at once,
a prompt group each, recording into one `CallRecorder`), with the run's
sampling settings (a request that asks for another temperature or top_p is refused; the length is
capped at `generation.max_new_tokens` per call), and records what it generated for the rollout to
rebuild its trajectories from. Between rollouts the trainer owns the engine (refit, validation by the
run itself), and requests are refused with `NotInRollout`.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from transformers import PreTrainedTokenizerBase

from reinforge.data.images import ImageInputs, record_image_refs
from reinforge.errors import DataError
from reinforge.generation.base import Completion, GenerationBackend, SamplingParams
from reinforge.hang import HangError
from reinforge.network import ThreadedServer
from reinforge.serving.batcher import Batcher
from reinforge.serving.config import ServingConfig
from reinforge.serving.errors import EpisodeOver, InvalidRequest, NotInRollout
from reinforge.serving.prompt import image_prompt, message_dicts, prompt_ids
from reinforge.serving.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from reinforge.serving.recorder import CallRecorder, RecordedCall

SAMPLING_TOLERANCE = 1e-6  # a request's temperature or top_p this close to the run's is the run's


@dataclass
class RolloutSession:
    """One rollout's worth of agent traffic: its sampling settings and what the endpoint generated."""

    sampling: SamplingParams  # temperature, top_p, top_k, max_new_tokens (per call) and the seed stream
    recorder: CallRecorder = field(default_factory=CallRecorder)  # the endpoint's, shared by the sessions open
    opened_at: int = 0  # the recorder's `mark` when the session opened
    open_episodes: set[str] = field(default_factory=set)
    episodes: set[str] = field(default_factory=set)  # every episode id it gave out
    num_running: int = 0  # episodes in flight, Python or Gym: the batcher's hint
    pending: set[Future] = field(default_factory=set)  # its calls not yet answered
    closed: bool = False
    unclaimed: int = 0  # once closed: the calls it made (or could have made) that no episode took


@dataclass(frozen=True)
class Admission:
    """A chat request the endpoint accepted, already queued for the engine."""

    prompt_ids: list[int]  # the engine's prompt, after the splice of serving/prompt.py
    images: "ImageInputs | None"  # its images (a vision-language model's request with image parts)
    params: SamplingParams  # as generated: max_new_tokens fits the context, num_samples completions
    completions: Future[list[Completion]]
    episode_id: str | None
    session: RolloutSession | None  # the rollout it belongs to (None standalone)


class PolicyServer:
    """The OpenAI-compatible endpoint over `engine`: admission, batching into the engine, recording."""

    def __init__(
        self,
        engine: GenerationBackend,
        tokenizer: PreTrainedTokenizerBase,
        config: ServingConfig,
        *,
        max_model_len: int,
        default_max_tokens: int,
        managed: bool,
        token: str | None = None,
        vocab_size: int | None = None,
        engine_calls: int = 1,
        processor: Any = None,
    ):
        """`vocab_size`: the model's (its embedding's rows; None: the tokenizer's length): every token id a
        request sends back must be below it. `engine_calls`: how many batches the engine takes at once (the
        in-flight engine: several; serving/batcher.py). `processor`: a vision-language model's, which renders
        requests with image content parts (None: text only)."""
        self.tokenizer, self.config, self.processor = tokenizer, config, processor
        self.vocab_size = max(vocab_size or 0, len(tokenizer))
        self.max_model_len, self.default_max_tokens, self.managed, self.token = (
            max_model_len,
            default_max_tokens,
            managed,
            token,
        )
        self.model_name = config.model_name
        self._batcher = Batcher(
            engine,
            config.max_batch_size,
            config.batch_wait_s,
            self._num_running,
            request_timeout_s=config.request_timeout_s,
            max_concurrent_calls=engine_calls,
            max_queued=config.max_queued_requests,
        )
        self._lock = threading.Lock()  # guards the sessions against a request being admitted as one closes
        self._sessions: list[RolloutSession] = []  # open, oldest first
        self._episode_sessions: dict[str, RolloutSession] = {}  # each open episode's
        self._recorder = CallRecorder()
        self._episode_ids = itertools.count()
        self._counts_lock = threading.Lock()
        self._counts = {"requests": 0, "rejected": 0}
        self.num_received = 0  # every chat, tokenize or refused request since the start, never reset
        self._http: ThreadedServer | None = None

    @property
    def url(self) -> str:
        """http://HOST:PORT (the `/v1` base URL of the OpenAI client is `base_url`)."""
        assert self._http is not None, "start the endpoint first"
        return self._http.url

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def episode_base_url(self, episode_id: str) -> str:
        """The `base_url` of one episode: its calls are recorded under its id."""
        return f"{self.url}/episodes/{episode_id}/v1"

    def start(self, app: Any) -> PolicyServer:
        """Serve `app` (the ASGI app of this server, serving/app.py's `build_app(self)`) on a uvicorn thread at
        `config.host`:`config.port`."""
        self._http = ThreadedServer(app, self.config.host, self.config.port, "policy endpoint").start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.stop()
        self._batcher.close()

    def admit(self, request: ChatCompletionRequest, episode_id: str | None) -> Admission:
        """Queue `request` (sent under episode `episode_id`'s URL, or None) for the engine, with the sampling
        settings it is generated with; raises `InvalidRequest`, `NotInRollout` or `EpisodeOver` for a request
        the endpoint refuses.

        Standalone, the request's own settings (temperature 1, top_p 1, `default_max_tokens` when it gives
        none; a request with a seed is generated alone, so that the seed alone decides its sample). Managed,
        the session's: a temperature, top_p or top_k other than the run's is refused, as is n != 1; max_tokens
        is capped at the run's; a seed is ignored (the run's seed stream decides). Either way max_tokens is cut
        to the room the context leaves after the prompt."""
        with self._counts_lock:
            self._counts["requests"] += 1
            self.num_received += 1
        if request.tool_choice not in (None, "auto", "none"):
            raise InvalidRequest(
                f"tool_choice={request.tool_choice!r} is not supported: the policy decides whether to call a tool "
                "('auto'), or is shown no tools ('none')",
                "tool_choice",
            )
        tools = None if request.tool_choice == "none" else request.tools
        prompt, images = self._prompt(request.messages, tools, request.required_prefix_token_ids)
        with self._lock:  # admitted and queued at once, so that a closing session never misses a call
            # an episode's own session; a call without one (a Gym agent's) the oldest open session's settings
            session = self._episode_sessions.get(episode_id) if episode_id else None
            session = session or (self._sessions[0] if self._sessions else None)
            if self.managed:
                params, alone = self._managed_params(request, session, episode_id), False
            else:
                params, alone = self._standalone_params(request), request.seed is not None
            room = self.max_model_len - len(prompt)
            if room < 1:
                raise InvalidRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens, and the prompt has "
                    f"{len(prompt)} tokens; shorten the conversation",
                    "messages",
                )
            params = replace(params, max_new_tokens=min(params.max_new_tokens, room))
            completions = self._batcher.submit(prompt, params, alone, images)
            if session is not None:
                session.pending.add(completions)
        if session is not None:  # outside the lock: a future already done runs the callback here
            completions.add_done_callback(lambda future: self._answered(session, future))
        return Admission(prompt, images, params, completions, episode_id, session)

    def record(self, admission: Admission, completions: list[Completion]) -> None:
        """File what the engine generated for `admission` with its rollout session (standalone: nowhere)."""
        if admission.session is None:
            return
        for completion in completions:
            call = RecordedCall(
                admission.prompt_ids,
                list(completion.token_ids),
                list(completion.logprobs),
                completion.finish_reason == "length",
                completion.routed_experts,  # with the run's router replay (its sampling asks for routes)
                completion.token_versions,  # in flight: a call may span an update
                admission.images,
            )
            admission.session.recorder.record(call, admission.episode_id)

    def tokenize(self, request: TokenizeRequest) -> list[int]:
        """vLLM's `/tokenize`: the prompt chat completions would use for `request.messages` (splice included),
        or the tokens of `request.prompt`; raises `InvalidRequest`."""
        with self._counts_lock:
            self.num_received += 1
        if (request.messages is None) == (request.prompt is None):
            raise InvalidRequest("bad request: give either messages (chat) or prompt (text)", "messages")
        if request.messages is not None:
            return self._prompt(
                request.messages, request.tools, request.required_prefix_token_ids, request.add_generation_prompt
            )[0]
        return list(self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"])

    def count_rejected(self) -> None:
        """One more request answered with an error (malformed, refused or failed)."""
        with self._counts_lock:
            self._counts["rejected"] += 1
            self.num_received += 1

    def metrics(self) -> dict[str, float]:
        """The endpoint's counts since the last call (requests, engine calls, batch sizes), then reset."""
        with self._counts_lock:
            counts, self._counts = dict(self._counts), dict.fromkeys(self._counts, 0)
        return {**{k: float(v) for k, v in counts.items()}, **self._batcher.metrics()}

    @contextmanager
    def rollout_session(self, sampling: SamplingParams) -> Iterator[RolloutSession]:
        """Agents may call the endpoint while this is open (other sessions may be open too: in-flight
        generation opens one per prompt group); on exit its episodes' new calls are refused, its calls in
        flight are answered, and what its episodes left unclaimed is forgotten (`session.unclaimed`)."""
        with self._lock:
            session = RolloutSession(sampling=sampling, recorder=self._recorder, opened_at=self._recorder.mark())
            self._sessions.append(session)
        try:
            yield session
        finally:
            with self._lock:
                session.closed = True
                self._sessions.remove(session)  # its episodes, which run inside it, have left `_episode_sessions`
            self._wait_answered(session)
            with self._lock:  # calls without an episode made before every open session began: nobody can claim
                before = min((other.opened_at for other in self._sessions), default=None)
                session.unclaimed = self._recorder.forget(
                    session.episodes, self._recorder.mark() if before is None else before
                )

    @contextmanager
    def episode(self, session: RolloutSession, keyed: bool) -> Iterator[str | None]:
        """One episode in flight; `keyed`: it gets an id of its own (its `episode_base_url`), else None."""
        episode_id = f"ep{next(self._episode_ids)}-{uuid.uuid4().hex[:8]}" if keyed else None
        with self._lock:
            session.num_running += 1
            if episode_id:
                session.open_episodes.add(episode_id)
                session.episodes.add(episode_id)
                self._episode_sessions[episode_id] = session
        try:
            yield episode_id
        finally:
            with self._lock:
                session.num_running -= 1
                session.open_episodes.discard(episode_id)
                self._episode_sessions.pop(episode_id, None)

    def _answered(self, session: RolloutSession, future: Future) -> None:
        with self._lock:
            session.pending.discard(future)

    def _wait_answered(self, session: RolloutSession) -> None:
        """Until the session's calls are answered (or given up on); a `HangError` after the request timeout."""
        with self._lock:
            pending = list(session.pending)
        _, not_done = wait(pending, timeout=self.config.request_timeout_s)
        if not_done:
            what, setting = "the engine to answer the requests in flight", "agent.endpoint.request_timeout_s"
            raise HangError("policy endpoint", what, self.config.request_timeout_s, setting).capture()

    def _prompt(
        self,
        messages: list[ChatMessage],
        tools: list[dict] | None,
        required_prefix: list[int] | None,
        add_generation_prompt: bool = True,
    ) -> tuple[list[int], ImageInputs | None]:
        """The engine's prompt and its images (None without)."""
        self._check_token_ids(messages, required_prefix)
        try:
            if self.processor is not None:
                return image_prompt(self.processor, messages, tools, required_prefix, add_generation_prompt)
            if record_image_refs({}, message_dicts(messages)):
                raise DataError("the messages hold images, but the served model is text-only")
            return prompt_ids(self.tokenizer, messages, tools, required_prefix, add_generation_prompt), None
        except DataError as exc:
            raise InvalidRequest(f"bad request: {exc}", "messages") from None

    def _check_token_ids(self, messages: list[ChatMessage], required_prefix: list[int] | None) -> None:
        """Token ids sent back (a spliced history's, a required prefix) must be the model's: the engine would fail
        on one outside its vocabulary."""
        fields = [
            (f"messages[{index}].{name}", ids)
            for index, message in enumerate(messages)
            for name in ("prompt_token_ids", "generation_token_ids")
            if (ids := getattr(message, name)) is not None
        ]
        fields += [("required_prefix_token_ids", required_prefix)] if required_prefix is not None else []
        for name, ids in fields:
            bad = next((token for token in ids if not 0 <= token < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"{name} holds token id {bad}, outside the model's vocabulary of {self.vocab_size} tokens "
                    f"(0 to {self.vocab_size - 1}); send back the token ids this endpoint returned",
                    name,
                )

    def _managed_params(
        self, request: ChatCompletionRequest, session: RolloutSession | None, episode_id: str | None
    ) -> SamplingParams:
        if session is None:
            raise NotInRollout(
                "the policy is being trained: this endpoint serves agents only during the run's rollouts"
            )
        if episode_id is not None and episode_id not in session.open_episodes:
            raise EpisodeOver(f"episode {episode_id} is over (it ended or timed out); its calls are no longer recorded")
        run = session.sampling
        for name, asked, allowed in (
            ("temperature", request.temperature, run.temperature),
            ("top_p", request.top_p, run.top_p),
        ):
            if asked is not None and abs(asked - allowed) > SAMPLING_TOLERANCE:
                raise InvalidRequest(
                    f"{name}={asked} differs from the run's {name}={allowed}: during training the policy samples "
                    "as the trainer scores it; send the run's value or none",
                    name,
                )
        if request.top_k not in (None, -1, 0, run.top_k):
            raise InvalidRequest(f"top_k={request.top_k} differs from the run's top_k={run.top_k}", "top_k")
        if request.n != 1:
            raise InvalidRequest(
                f"n={request.n}: during training each call samples one completion (an episode is one trajectory)", "n"
            )
        max_new_tokens = min(request.requested_max_tokens() or run.max_new_tokens, run.max_new_tokens)
        return replace(run, max_new_tokens=max_new_tokens, num_samples=1, stop_strings=request.stop_strings())

    def _standalone_params(self, request: ChatCompletionRequest) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=request.requested_max_tokens() or self.default_max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if request.top_k in (None, 0) else request.top_k,
            stop_strings=request.stop_strings(),
            num_samples=request.n,
            seed=request.seed or 0,
        )

    def _num_running(self) -> int:
        # no lock: the batcher asks holding its own, which `admit` takes holding this server's
        return sum(session.num_running for session in list(self._sessions))
