"""Image prompts through the trainer: rendering with the processor, the trainer's logprobs of a VLM rollout against
a plain Hugging Face forward of the same image and tokens (packed, unpacked, prompts shared), a changed pixel that
changes them, and malformed images as one-line errors naming their row."""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from reinforge.data import images as image_module
from reinforge.data.batch import Trajectory, collate
from reinforge.data.prompts import DataConfig, load_prompts
from reinforge.errors import DataError
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_model, load_processor
from reinforge.training.backend import Backend
from reinforge.training.base import TrainingConfig
from reinforge.training.heads import LogprobHead
from reinforge.training.micro_batching import token_logprobs
from reinforge.training.optimizer import OptimizerConfig, SchedulerConfig


def png(seed: int, size: int = 32) -> bytes:
    pixels = (np.random.default_rng(seed).random((size, size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


@pytest.fixture(scope="module")
def image_data(tmp_path_factory):
    """Six prompts of one text: three images as files beside the data file, three as data URLs."""
    root = tmp_path_factory.mktemp("vlm_data")
    (root / "images").mkdir()
    records = []
    for index in range(6):
        if index % 2:
            ref = data_url(index)
        else:
            (root / "images" / f"{index}.png").write_bytes(png(index))
            ref = f"images/{index}.png"
        # one text for all: prompts that differ only by their pictures must never share a prompt's copy
        records.append({"prompt": "add the numbers", "images": [ref], "answer": str(2 * index + 1)})
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prompts_of(model_dir, path):
    processor = load_processor(ModelConfig(name_or_path=str(model_dir)))
    return load_prompts(str(path), DataConfig(), processor.tokenizer, processor)


def rollout_batch(prompts, samples=2, seed=0):
    """`samples` random answers per prompt, as a rollout's trajectories."""
    gen = torch.Generator().manual_seed(seed)
    trajectories = []
    for group, prompt in enumerate(prompts):
        for sample in range(samples):
            response = torch.randint(3, 440, (4 + (group + sample) % 4,), generator=gen).tolist()
            trajectories.append(
                Trajectory(
                    prompt.token_ids, response, [0.0] * len(response), False, 0.0, group, "math", images=prompt.images
                )
            )
    return collate(trajectories, [0.0] * len(trajectories), pad_token_id=0)


def hf_logprobs(model, batch, suppressed=None):
    """A plain forward of each sequence with its own image: the reference; with `suppressed`, the logprobs of the
    distribution without that token (what the engine samples from)."""
    out = torch.zeros_like(batch.loss_mask)
    with torch.no_grad():
        for row in range(len(batch)):
            length = int(batch.attention_mask[row].sum())
            tensors = batch.images[row].tensors
            logits = model(
                input_ids=batch.input_ids[row : row + 1, :length],
                pixel_values=tensors["pixel_values"].unsqueeze(0),
                pixel_attention_mask=tensors["pixel_attention_mask"].unsqueeze(0),
            ).logits
            if suppressed is not None:
                logits[..., suppressed] = float("-inf")
            out[row, :length] = token_logprobs(logits, batch.input_ids[row : row + 1, :length], 1.0)[0]
    return out * batch.loss_mask


def backend(model_dir, **training):
    return Backend(
        ModelConfig(name_or_path=str(model_dir)),
        TrainingConfig(micro_batch_size=4, global_batch_size=12, **training),
        OptimizerConfig(lr=1e-3),
        SchedulerConfig(),
        num_optimizer_steps=1,
        head=LogprobHead(temperature=1.0),
    )


def test_image_prompts_expand_into_image_tokens_and_keep_the_placeholder_prompt(tiny_vlm_dir, image_data):
    prompts = prompts_of(tiny_vlm_dir, image_data)
    image_token = load_model(ModelConfig(name_or_path=str(tiny_vlm_dir))).config.image_token_id
    assert len(prompts) == 6
    for prompt in prompts:
        assert prompt.token_ids.count(image_token) == 4  # image_seq_len image tokens for its one image
        assert prompt.images.engine_prompt_ids.count(image_token) == 1  # vLLM's input: one placeholder
        assert prompt.images.tensors["pixel_values"].shape == (1, 3, 32, 32)
    # the file and the data URL of the same picture give the same pixels
    assert not torch.equal(prompts[0].images.tensors["pixel_values"], prompts[1].images.tensors["pixel_values"])


def test_a_prompt_of_pictures_of_three_sizes_takes_one_processor_pass_and_equals_the_processors_own(
    tiny_vlm_dir, monkeypatch
):
    """process_prompt and the endpoint's image_prompt preprocess each picture once (one image-processor call per
    prompt or request) and give the ids, pixels and pixel mask of the processor's own one-prompt call."""
    from reinforge.serving.prompt import image_prompt
    from reinforge.serving.protocol import ChatMessage

    processor = load_processor(ModelConfig(name_or_path=str(tiny_vlm_dir)))
    pictures = [
        Image.new("RGB", size, color) for size, color in [((32, 32), "red"), ((20, 48), "lime"), ((64, 16), "blue")]
    ]
    messages = [{"role": "user", "content": [{"type": "image"}] * 3 + [{"type": "text", "text": "how many?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    own = processor(text=[text], images=[pictures], return_tensors="pt", add_special_tokens=False)
    calls = []
    preprocess = processor.image_processor.preprocess
    monkeypatch.setattr(processor.image_processor, "preprocess", lambda *a, **k: calls.append(1) or preprocess(*a, **k))

    ids, inputs = image_module.process_prompt(processor, messages, pictures)
    assert len(calls) == 1
    assert ids == own["input_ids"][0].tolist()
    assert torch.equal(inputs.tensors["pixel_values"], own["pixel_values"][0])  # [3, C, 32, 32]
    assert torch.equal(inputs.tensors["pixel_attention_mask"], own["pixel_attention_mask"][0])
    placeholder = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert inputs.engine_prompt_ids.count(placeholder) == 3 and len(inputs.engine_prompt_ids) < len(ids)

    buffers = []
    for picture in pictures:
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        buffers.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in buffers] + [
        {"type": "text", "text": "how many?"}
    ]
    calls.clear()
    served, request_inputs = image_prompt(processor, [ChatMessage(role="user", content=parts)], None)
    assert len(calls) == 1
    assert served == ids and request_inputs.engine_prompt_ids == inputs.engine_prompt_ids
    assert torch.equal(request_inputs.tensors["pixel_values"], inputs.tensors["pixel_values"])


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"sequence_packing": True},
        {"sequence_packing": True, "share_prompts": True, "micro_batch_tokens": 256},
    ],
    ids=["unpacked", "packed", "shared-prompts"],
)
def test_trainer_logprobs_of_a_vlm_rollout_equal_a_plain_forward(tiny_vlm_dir, image_data, layout):
    prompts = prompts_of(tiny_vlm_dir, image_data)
    batch = rollout_batch(prompts)
    trainer = backend(tiny_vlm_dir, **layout)
    expected = hf_logprobs(load_model(ModelConfig(name_or_path=str(tiny_vlm_dir))).eval(), batch)
    got = trainer.logprobs(batch)
    assert batch.loss_mask.sum() > 0
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_one_changed_pixel_changes_the_logprobs(tiny_vlm_dir, image_data):
    prompts = prompts_of(tiny_vlm_dir, image_data)[:2]
    batch = rollout_batch(prompts)
    trainer = backend(tiny_vlm_dir)
    before = trainer.logprobs(batch)
    changed = image_module.ImageInputs(
        prompts[0].images.images, dict(prompts[0].images.tensors), prompts[0].images.engine_prompt_ids
    )
    pixels = changed.tensors["pixel_values"].clone()
    pixels[0, :, 5, 7] += 0.5
    changed.tensors["pixel_values"] = pixels
    batch.images = [changed, changed, *batch.images[2:]]
    after = trainer.logprobs(batch)
    assert (after[:2] - before[:2]).abs().max() > 1e-4  # the image's sequences moved
    assert torch.equal(after[2:], before[2:])  # the other prompt's did not


@pytest.mark.parametrize(
    "image, message",
    [
        ("images/missing.png", "no such file"),
        ("notes.txt", "is not an image"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("big.png", "more than"),
        ("https://example.com/a.png", "web URLs are not fetched"),
    ],
)
def test_a_malformed_image_is_one_line_naming_its_row(tiny_vlm_dir, tmp_path, monkeypatch, image, message):
    (tmp_path / "notes.txt").write_text("not an image")
    Image.new("RGB", (40, 40)).save(tmp_path / "big.png")
    monkeypatch.setattr(image_module, "MAX_IMAGE_PIXELS", 1500)  # 40 x 40 is over it, 32 x 32 not
    good = {"prompt": "add", "images": [data_url(0)], "answer": "1"}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "images": [image]}) + "\n")
    with pytest.raises(DataError, match=message) as raised:
        prompts_of(tiny_vlm_dir, path)
    assert f"{path}:2:" in str(raised.value) and "\n" not in str(raised.value)


def test_a_gym_rows_image_is_rendered_for_a_vlm_and_refused_for_a_text_model(tiny_vlm_dir, tmp_path):
    """A NeMo Gym row's `input_image` part (a Gym VLM server's row) becomes the prompt's image."""
    from reinforge.modeling import load_tokenizer
    from reinforge.paths import resolve_path

    row = {
        "responses_create_params": {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": data_url(3)},
                        {"type": "input_text", "text": "add the numbers"},
                    ],
                }
            ]
        }
    }
    path = tmp_path / "gym.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (prompt,) = prompts_of(tiny_vlm_dir, path)
    (expected,) = prompts_of(tiny_vlm_dir, image_data_file(tmp_path, 3))
    assert prompt.token_ids == expected.token_ids and prompt.images.digest() == expected.images.digest()
    config = ModelConfig(name_or_path=str(resolve_path("models/demo")))
    with pytest.raises(DataError, match=r"gym.jsonl:1: the row has images, but the model is text-only"):
        load_prompts(str(path), DataConfig(), load_tokenizer(config), None)


def image_data_file(tmp_path, seed: int):
    """One plain image record: the picture `seed` before the text, as an `images` field."""
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"prompt": "add the numbers", "images": [data_url(seed)], "answer": "1"}) + "\n")
    return path


def test_images_for_a_text_model_are_one_line(tmp_path):
    from reinforge.modeling import load_tokenizer
    from reinforge.paths import resolve_path

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "add", "images": [data_url(0)], "answer": "1"}) + "\n")
    config = ModelConfig(name_or_path=str(resolve_path("models/demo")))
    assert load_processor(config) is None
    with pytest.raises(DataError, match=r"train.jsonl:1: the record has images, but the model is text-only"):
        load_prompts(str(path), DataConfig(use_chat_template=False), load_tokenizer(config), None)


def test_the_hf_engine_samples_from_image_prompts_with_the_trainers_logprobs(tiny_vlm_dir, image_data):
    """Batched and left-padded, each prompt's greedy answer is the one a plain generate gives it alone; sampled
    answers' engine logprobs are the trainer's (the image reaches the engine too: other images, other answers)."""
    from reinforge.generation.base import SamplingParams
    from reinforge.generation.hf import HFGenerationBackend
    from reinforge.rollout.single_turn import generate_trajectories

    config = ModelConfig(name_or_path=str(tiny_vlm_dir))
    processor = load_processor(config)
    prompts = prompts_of(tiny_vlm_dir, image_data)
    prompts[0].token_ids = prompts[0].token_ids[:3] + prompts[0].token_ids  # a longer prompt: left padding
    engine = HFGenerationBackend(load_model(config), processor.tokenizer, max_batch_size=64)
    greedy = engine.generate(
        [p.token_ids for p in prompts],
        SamplingParams(max_new_tokens=6, temperature=0),
        images=[p.images for p in prompts],
    )
    model = load_model(config).eval()
    answers = []
    for prompt, completions in zip(prompts, greedy.completions):
        tensors = prompt.images.tensors
        alone = model.generate(
            input_ids=torch.tensor([prompt.token_ids]),
            pixel_values=tensors["pixel_values"].unsqueeze(0),
            pixel_attention_mask=tensors["pixel_attention_mask"].unsqueeze(0),
            max_new_tokens=6,
            do_sample=False,
            suppress_tokens=[model.config.image_token_id],
        )[0, len(prompt.token_ids) :].tolist()
        assert completions[0].token_ids == alone[: len(completions[0].token_ids)]
        answers.append(tuple(alone))
    assert len(set(answers)) > 1  # the same text, other images: other answers
    trajectories = generate_trajectories(
        prompts, engine, SamplingParams(max_new_tokens=8, num_samples=2, seed=3), processor.tokenizer
    )
    batch = collate(trajectories, [0.0] * len(trajectories), pad_token_id=0)
    mask = batch.loss_mask.bool()
    # the engine never samples the image token: its logprobs are those of the distribution without it
    sampled_from = hf_logprobs(model, batch, suppressed=model.config.image_token_id)
    assert torch.allclose(batch.gen_logprobs[mask], sampled_from[mask], atol=1e-4)
    assert torch.allclose(backend(tiny_vlm_dir).logprobs(batch)[mask], hf_logprobs(model, batch)[mask], atol=1e-5)


def image_chats(count: int) -> list[dict]:
    """Chats whose user turn holds an image_url part, of one text (only the picture tells them apart)."""
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(index)}},
                        {"type": "text", "text": "add the numbers"},
                    ],
                },
                {"role": "assistant", "content": f"the answer is {index}"},
            ]
        }
        for index in range(count)
    ]


def test_an_image_chat_renders_as_its_processor_does_with_the_loss_on_the_reply(tiny_vlm_dir):
    from reinforge.data.chat import render_chat

    processor = load_processor(ModelConfig(name_or_path=str(tiny_vlm_dir)))
    record = image_chats(1)[0]
    example = render_chat(record, processor.tokenizer, processor=processor)
    messages = image_module.image_messages(record["messages"], 0)
    text = processor.apply_chat_template(messages, tokenize=False)
    expected = processor(text=[text], images=[[Image.open(io.BytesIO(png(0))).convert("RGB")]])["input_ids"][0]
    assert example.token_ids == list(expected)
    trained = [t for t, m in zip(example.token_ids, example.loss_mask) if m]
    assert processor.tokenizer.decode(trained) == "the answer is 0<|im_end|>"
    assert example.images is not None and example.images.tensors["pixel_values"].shape == (1, 3, 32, 32)


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_sft_loss_on_image_chats_equals_a_plain_forward(tiny_vlm_dir, packing):
    from reinforge.algorithms.sft import examples_batch, nll_loss
    from reinforge.data.chat import render_chat

    config = ModelConfig(name_or_path=str(tiny_vlm_dir))
    processor = load_processor(config)
    examples = [render_chat(r, processor.tokenizer, processor=processor) for r in image_chats(5)]
    batch = examples_batch(examples, pad_id=0)
    trainer = backend(tiny_vlm_dir, sequence_packing=packing, micro_batch_tokens=256)
    got = trainer.evaluate(batch, nll_loss)["loss"]
    model = load_model(config).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            tensors = example.images.tensors
            labels = torch.tensor([[t if m else -100 for t, m in zip(example.token_ids, example.loss_mask)]])
            out = model(
                input_ids=torch.tensor([example.token_ids]),
                pixel_values=tensors["pixel_values"].unsqueeze(0),
                pixel_attention_mask=tensors["pixel_attention_mask"].unsqueeze(0),
                labels=labels,
            )
            num = int((labels[:, 1:] != -100).sum())
            total, count = total + out.loss.item() * num, count + num
    assert abs(got - total / count) < 1e-5


def test_an_image_in_a_text_models_chat_is_one_line(tmp_path):
    from reinforge.data.chat import render_chat
    from reinforge.modeling import load_tokenizer
    from reinforge.paths import resolve_path

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(resolve_path("models/demo"))))
    with pytest.raises(DataError, match="the chat has images, but the model is text-only"):
        render_chat(image_chats(1)[0], tokenizer)


def test_dpo_image_pairs_reach_the_trainer_as_a_plain_forward_sees_them(tiny_vlm_dir, tmp_path):
    """Image pairs: both rows of a pair carry the pair's picture, and the trainer's logprobs of the interleaved
    batch equal a plain forward of each row with its image."""
    from reinforge.algorithms.pairs import pair_batch
    from reinforge.data.preference import PreferenceDataConfig, load_pairs, tokenize_for_policy

    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": "add the numbers", "images": [data_url(i)], "chosen": f"it is {i}", "rejected": f"it is {i + 1}"}
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = ModelConfig(name_or_path=str(tiny_vlm_dir))
    processor = load_processor(config)
    pairs = load_pairs(str(path), processor.tokenizer, tokenize_for_policy, PreferenceDataConfig(), processor)
    batch = pair_batch(pairs, pad_token_id=0)
    assert [b.digest() for b in batch.images] == [p.images.digest() for p in pairs for _ in range(2)]
    expected = hf_logprobs(load_model(config).eval(), batch)
    assert torch.allclose(backend(tiny_vlm_dir).logprobs(batch), expected, atol=1e-5)
    with pytest.raises(DataError, match=r"pairs.jsonl:1: the pair has images, but the model is text-only"):
        load_pairs(str(path), processor.tokenizer, tokenize_for_policy, PreferenceDataConfig(), None)
