"""`reinforge serve`: the policy behind an OpenAI-compatible endpoint, a real process, called with the real `openai`
client.

The demo model answers arithmetic word problems; the tool demo model sometimes calls its calculator.
Every assistant message carries the engine's prompt and generated token ids with their logprobs, a
second turn's prompt extends the first's tokens exactly, concurrent requests share engine calls, and
bad requests get a 400 that names the field.
"""

import json
import os
import threading

import httpx
import openai
import pytest
from _servers import cli_server

TOKEN = "serve-token-7d1e"
QUESTION = "Ann has 57 stickers. She finds 34 more, then loses 49. How many stickers does she have now?"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    arguments = [
        "serve",
        "--model",
        "models/demo",
        "--token-env",
        "REINFORGE_TEST_SERVE_TOKEN",
        "--max-model-len",
        "160",
        "--max-tokens",
        "48",
    ]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with cli_server(arguments, log, env={**os.environ, "REINFORGE_TEST_SERVE_TOKEN": TOKEN}) as (url, _, _):
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)


def test_the_openai_client_gets_the_answer_and_the_engines_token_ids_and_logprobs(demo_url):
    messages = [{"role": "user", "content": QUESTION}]
    completion = client(demo_url).chat.completions.create(
        model="policy", messages=messages, temperature=0, logprobs=True, extra_body={"return_tokens_as_token_ids": True}
    )
    (choice,) = completion.choices
    message = choice.message.model_dump()
    assert "\\boxed{" in message["content"] and choice.finish_reason == "stop"
    prompt, generated, logprobs = (
        message["prompt_token_ids"],
        message["generation_token_ids"],
        message["generation_log_probs"],
    )
    assert prompt == post(demo_url, "/tokenize", {"messages": messages}).json()["tokens"]
    assert generated[-1] == 2 and len(logprobs) == len(generated)  # <|im_end|> (id 2) included
    assert all(value <= 0 for value in logprobs)
    assert [entry.token for entry in choice.logprobs.content] == [f"token_id:{token}" for token in generated]
    assert [entry.logprob for entry in choice.logprobs.content] == logprobs
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(prompt), len(generated))


def test_a_second_turn_prompt_extends_the_first_turns_prompt_and_generation_token_for_token(demo_url):
    policy = client(demo_url)
    messages = [{"role": "user", "content": QUESTION}]
    first = (
        policy.chat.completions.create(model="policy", messages=messages, temperature=1.0, seed=3).choices[0].message
    )
    messages += [first, {"role": "user", "content": "Check it again."}]  # the message object, as agents append it
    second = (
        policy.chat.completions.create(model="policy", messages=messages, temperature=1.0, seed=4).choices[0].message
    )
    before = first.prompt_token_ids + first.generation_token_ids
    assert second.prompt_token_ids[: len(before)] == before
    rendered = post(demo_url, "/tokenize", {"messages": [messages[0], first.model_dump(), messages[2]]}).json()[
        "tokens"
    ]
    assert rendered == second.prompt_token_ids  # /tokenize splices as chat completions does


def test_a_seeded_request_is_reproducible_and_n_gives_n_samples(demo_url):
    policy = client(demo_url)
    runs = [
        policy.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": QUESTION}], n=4, seed=11, temperature=1.0
        )
        for _ in range(2)
    ]
    tokens = [[c.message.generation_token_ids for c in run.choices] for run in runs]
    assert len(tokens[0]) == 4 and tokens[0] == tokens[1]
    assert [c.index for c in runs[0].choices] == [0, 1, 2, 3]


def test_concurrent_requests_are_batched_into_few_engine_calls(demo_url):
    httpx.get(f"{demo_url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})  # reset the counts
    start = threading.Barrier(24)
    answers = []

    def ask(index):
        start.wait()
        answers.append(
            client(demo_url).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": f"{QUESTION} ({index})"}], temperature=1.0
            )
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    metrics = httpx.get(f"{demo_url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).json()["metrics"]
    assert len(answers) == 24 and metrics["sequences"] == 24
    assert metrics["engine_calls"] <= 4, metrics


@pytest.mark.parametrize(
    "change, field",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"temperature": 3}, "temperature"),
        ({"top_logprobs": 5}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream": True}, "stream"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_malformed_request_gets_a_400_naming_the_field(demo_url, change, field):
    response = post(
        demo_url, "/v1/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "hi"}], **change}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field.split(".")[0] in error["message"]


def test_a_prompt_over_the_context_length_is_a_400_that_says_so(demo_url):
    response = post(demo_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION * 6}]})
    assert response.status_code == 400
    assert "maximum context length is 160 tokens" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="context length"):
        client(demo_url).chat.completions.create(model="policy", messages=[{"role": "user", "content": QUESTION * 6}])


def test_the_endpoint_needs_its_token_and_answers_health_and_models_without_fuss(demo_url):
    assert (
        httpx.post(
            f"{demo_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        ).status_code
        == 401
    )
    assert httpx.get(f"{demo_url}/health").json() == {"status": "ok"}
    (model,) = client(demo_url).models.list().data
    assert model.id == "policy"
    not_json = httpx.post(
        f"{demo_url}/v1/chat/completions",
        content="{",
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]


def test_the_tool_demo_model_gets_its_calls_back_as_openai_tool_calls(tmp_path):
    with cli_server(["serve", "--model", "models/tool_demo", "--max-tokens", "48"], tmp_path / "serve.log") as (
        url,
        _,
        _,
    ):
        policy = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        completion = policy.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[CALCULATOR],
            n=16,
            temperature=1.0,
            seed=0,
        )
        calling = [c for c in completion.choices if c.finish_reason == "tool_calls"]
        assert calling, [c.message.content for c in completion.choices]
        for choice in calling:
            (call,) = choice.message.tool_calls
            assert call.function.name == "calculator" and "expression" in json.loads(call.function.arguments)
        # the tool's answer goes back; the policy's next prompt extends its call's tokens exactly
        first = calling[0].message
        messages = [
            {"role": "user", "content": QUESTION},
            first,
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "42"},
        ]
        second = policy.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], temperature=0
        ).choices[0]
        assert (
            second.message.prompt_token_ids[: len(first.prompt_token_ids) + len(first.generation_token_ids)]
            == first.prompt_token_ids + first.generation_token_ids
        )
        assert "\\boxed{42}" in second.message.content


@pytest.mark.xdist_group("ray")  # vLLM takes the machine's cores (tests/conftest.py)
def test_the_endpoint_serves_vllm_as_it_serves_hf(tmp_path, demo_url):
    """The same greedy answer from both engines, with logprobs that agree."""
    question = [{"role": "user", "content": QUESTION}]
    hf = client(demo_url).chat.completions.create(model="policy", messages=question, temperature=0).choices[0].message
    with cli_server(
        ["serve", "--model", "models/demo", "--backend", "vllm", "--max-model-len", "160"],
        tmp_path / "vllm.log",
        timeout_s=300,
    ) as (url, _, _):
        vllm = (
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            .chat.completions.create(model="policy", messages=question, temperature=0)
            .choices[0]
            .message
        )
    assert vllm.prompt_token_ids == hf.prompt_token_ids and vllm.generation_token_ids == hf.generation_token_ids
    assert max(abs(a - b) for a, b in zip(vllm.generation_log_probs, hf.generation_log_probs)) < 1e-3
