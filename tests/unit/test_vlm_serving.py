"""`reinforge serve` for a vision-language model: OpenAI image content parts (data URLs) over HTTP with the `openai`
client, answered as transformers' own generate answers the same picture; a follow-up turn with another picture is
spliced onto the first turn's tokens; a recorded call keeps its images (agents' trajectories train on them); an
image file path, a web URL, or an image for a text-only model is a 400 naming the problem."""

import base64

import httpx
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from reinforge.generation.hf import HFGenerationBackend
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_processor, load_tokenizer
from reinforge.paths import PROJECT_ROOT
from reinforge.serving.app import build_app
from reinforge.serving.config import ServingConfig
from reinforge.serving.server import PolicyServer

VLM = PROJECT_ROOT / "models" / "vlm_demo"
IMAGES = PROJECT_ROOT / "data" / "benchmarks" / "vlm_sums" / "images"
QUESTION = "Add the two numbers in the image."
FRAME_TOKENS = {  # Idefics3's expansion of an image: <fake_token_around_image><global-img><image>x4<fake_...>
    AutoProcessor.from_pretrained(VLM).tokenizer.convert_tokens_to_ids(t)
    for t in ("<fake_token_around_image>", "<global-img>")
}


def image_url(index: int) -> str:
    return "data:image/png;base64," + base64.b64encode((IMAGES / f"{index:04d}.png").read_bytes()).decode()


def user(index: int) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": image_url(index)}}, {"type": "text", "text": QUESTION}],
    }


@pytest.fixture(scope="module")
def server():
    config = ModelConfig(name_or_path=str(VLM))
    processor = load_processor(config)
    engine = HFGenerationBackend(load_model(config), processor.tokenizer, max_batch_size=8)
    server = PolicyServer(
        engine,
        processor.tokenizer,
        ServingConfig(batch_wait_s=0),
        max_model_len=256,
        default_max_tokens=32,
        managed=False,
        processor=processor,
    )
    server.start(build_app(server))
    yield server
    server.stop()


def plain_greedy(prompt_ids: list[int], pictures: list[int]) -> list[int]:
    processor = AutoProcessor.from_pretrained(VLM)
    model = AutoModelForImageTextToText.from_pretrained(VLM).eval()
    images = [Image.open(IMAGES / f"{i:04d}.png").convert("RGB") for i in pictures]
    pixels = processor(text=[processor.image_token * len(images)], images=[images], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            pixel_values=pixels["pixel_values"],
            pixel_attention_mask=pixels["pixel_attention_mask"],
            max_new_tokens=32,
            do_sample=False,
            suppress_tokens=[model.config.image_token_id],
        )
    return out[0, len(prompt_ids) :].tolist()


def test_an_image_request_is_answered_as_a_plain_generate_and_a_second_turn_is_spliced(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    first = client.chat.completions.create(model="policy", messages=[user(0)], temperature=0, max_tokens=32)
    message = first.choices[0].message
    processor = AutoProcessor.from_pretrained(VLM)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    image = Image.open(IMAGES / "0000.png").convert("RGB")
    expected_prompt = processor(text=[text], images=[[image]], add_special_tokens=False)["input_ids"][0]
    assert message.prompt_token_ids == list(expected_prompt)
    assert (
        message.generation_token_ids == plain_greedy(message.prompt_token_ids, [0])[: len(message.generation_token_ids)]
    )
    assert "\\boxed{" in message.content

    # turn 2 sends turn 1 back with its token ids, and another picture: the prompt extends turn 1's tokens
    second = client.chat.completions.create(
        model="policy", messages=[user(0), message.model_dump(exclude_none=True), user(1)], temperature=0, max_tokens=32
    )
    follow = second.choices[0].message
    seen = message.prompt_token_ids + message.generation_token_ids
    assert follow.prompt_token_ids[: len(seen) - 1] == seen[:-1]  # (a generation cut short gets its EOS added)
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert follow.prompt_token_ids.count(image_token) == 8  # both pictures' 4 tokens
    assert (
        follow.generation_token_ids == plain_greedy(follow.prompt_token_ids, [0, 1])[: len(follow.generation_token_ids)]
    )


def test_an_admitted_image_request_keeps_its_images_and_vllms_placeholder_prompt(server):
    from reinforge.serving.protocol import ChatCompletionRequest

    admission = server.admit(ChatCompletionRequest(messages=[user(0), user(2)], max_tokens=4), None)
    admission.completions.result(timeout=60)
    image_token = AutoProcessor.from_pretrained(VLM).tokenizer.convert_tokens_to_ids("<image>")
    assert len(admission.images) == 2 and admission.prompt_ids.count(image_token) == 8
    engine_prompt = admission.images.engine_prompt_ids  # one placeholder per picture, the rest the same tokens
    assert engine_prompt.count(image_token) == 2
    assert [t for t in engine_prompt if t != image_token] == [
        t for t in admission.prompt_ids if t != image_token and t not in FRAME_TOKENS
    ]


@pytest.mark.parametrize(
    "url, message",
    [
        (str(IMAGES / "0000.png"), "takes images as data URLs"),
        ("https://example.com/a.png", "takes images as data URLs"),
        ("data:image/png;base64,@@@", "not valid base64"),
    ],
)
def test_a_bad_image_is_a_400_naming_it(server, url, message):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_an_image_for_a_text_model_is_a_400():
    config = ModelConfig(name_or_path=str(PROJECT_ROOT / "models" / "demo"))
    tokenizer = load_tokenizer(config)
    text_server = PolicyServer(
        HFGenerationBackend(load_model(config), tokenizer, max_batch_size=2),
        tokenizer,
        ServingConfig(batch_wait_s=0),
        max_model_len=160,
        default_max_tokens=4,
        managed=False,
    )
    text_server.start(build_app(text_server))
    try:
        response = httpx.post(f"{text_server.base_url}/chat/completions", json={"messages": [user(0)]}, timeout=30)
    finally:
        text_server.stop()
    assert response.status_code == 400 and "the served model is text-only" in response.json()["error"]["message"]
