"""`env.judge`: the judge environment's settings (envs/judge.py has the modes, retries and failures). Apart from the
client so that the config schema imports no HTTP code."""

from __future__ import annotations

import re
import string
from typing import Literal

from pydantic import model_validator

from reinforge.config.section import Section

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
    deadline_s: float = 300.0
    """The most one call may take, its retries and their waits included; a call still failing (or still
    receiving a trickled answer) by then leaves its samples unscored: infrastructure failures, masked."""
    max_retries: int = 8
    """Attempts after the first for connection errors, timeouts, HTTP 408, 429, 5xx and non-JSON answers (the
    default rides out about two minutes of outage, a judge server's restart)."""
    retry_backoff_s: float = 1.0
    """Wait before the first retry; it doubles before each further one, up to 30 s (a judge's Retry-After replaces
    it)."""
    failure_reward: float = 0.0
    """Reward of an unparseable judgement (the judge answered without a usable score). A call that failed is
    never scored: its samples are infrastructure failures."""
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
            (self.deadline_s > 0, "env.judge.deadline_s must be > 0"),
            (self.max_retries >= 0, "env.judge.max_retries must be >= 0"),
            (self.retry_backoff_s >= 0, "env.judge.retry_backoff_s must be >= 0"),
            (self.max_tokens >= 1, "env.judge.max_tokens must be >= 1"),
            (self.max_length >= 1, "env.judge.max_length must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self
