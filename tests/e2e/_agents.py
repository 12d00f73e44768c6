"""Python agents for the agent-rollout tests: `agent.python.NAME=_agents:FUNCTION` (tests/e2e on PYTHONPATH).

Each calls the policy with the real `openai` client, as a user's agent would."""

import itertools
import re
import time

from openai import OpenAI


def boxed_reward(text: str | None, answer: str) -> float:
    found = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return float(bool(found) and found[-1].strip() == answer)


def answer(base_url, record, model, sampling):
    """One call; reward 1 for the right boxed answer, with a `boxed` component."""
    policy = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    completion = policy.chat.completions.create(
        model=model, messages=[{"role": "user", "content": record["prompt"]}], **sampling
    )
    text = completion.choices[0].message.content
    return {
        "reward": boxed_reward(text, record["answer"]),
        "reward_components": {"boxed": float("\\boxed{" in (text or ""))},
    }


_EPISODES = itertools.count()  # next() is atomic under the GIL


def unruly(base_url, record, model, sampling):
    """Episode after episode, in turn: 0 raises, 1 hangs, 2 rewrites its history between two calls, 3 makes
    no call, 4 returns something that is no reward, 5 flags its episode with mask_sample; 6, 7 `answer`."""
    kind = next(_EPISODES) % 8
    if kind == 0:
        raise ValueError("this agent fails on purpose")
    if kind == 1:
        time.sleep(120)
    if kind == 3:
        return 1.0
    if kind == 4:
        return "a reward"
    if kind == 2:
        policy = OpenAI(base_url=base_url, api_key="none", max_retries=0)
        policy.chat.completions.create(
            model=model, messages=[{"role": "user", "content": record["prompt"]}], **sampling
        )
        policy.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A new conversation."}], **sampling
        )
        return 0.5
    result = answer(base_url, record, model, sampling)
    return {**result, "mask_sample": kind == 5}


def cold(base_url, record, model):
    """Asks for another temperature than the run's: the endpoint refuses, so every episode fails."""
    policy = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    policy.chat.completions.create(
        model=model, messages=[{"role": "user", "content": record["prompt"]}], temperature=0.5
    )
    return 1.0
