"""`data.streaming`'s prompt sampler (data/prompt_stream.py) on a parquet file written by `datasets`, rendered with
the demo tokenizer: file order without shuffling, each epoch a permutation with a buffer as large as the set, a
resumed stream continuing exactly where an uninterrupted one goes, the over-long prompts skipped."""

import datasets
import pytest

from reinforge.data.curriculum import CurriculumConfig
from reinforge.data.prompt_stream import PromptStream, stream_sampler
from reinforge.data.prompts import DataConfig
from reinforge.errors import ConfigError
from reinforge.model_config import ModelConfig
from reinforge.modeling import load_tokenizer

QUESTIONS = [f"What is {n} + {n}?" for n in range(10)]
LONG = "What is " + " + ".join(["1"] * 200) + "?"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path="models/demo"))


@pytest.fixture
def data(tmp_path):
    rows = [{"question": q, "answer": str(2 * n)} for n, q in enumerate(QUESTIONS)]
    rows.insert(3, {"question": LONG, "answer": "200"})  # longer than max_prompt_tokens: skipped
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    return DataConfig(
        train_path=str(tmp_path / "train.parquet"),
        streaming=True,
        columns={"prompt": "question"},
        max_prompt_tokens=64,
    )


def asked(batch):
    return [prompt.record["prompt"] for prompt in batch]


def test_without_shuffling_the_stream_is_the_file_order_epoch_after_epoch(tokenizer, data):
    stream = PromptStream(data.model_copy(update={"shuffle": False}), tokenizer, batch_size=4, seed=0)
    drawn = asked(stream.next_batch()) + asked(stream.next_batch()) + asked(stream.next_batch())
    assert drawn == QUESTIONS + QUESTIONS[:2]
    assert stream.state_dict() == {"epoch": 1, "position": 2, "drawn": 12}
    assert asked(stream.head()) == QUESTIONS


def test_with_a_buffer_as_large_as_the_set_each_epoch_is_a_seeded_permutation(tokenizer, data):
    stream = PromptStream(data.model_copy(update={"shuffle_buffer": 100}), tokenizer, batch_size=5, seed=1)
    first, second = [asked(stream.next_batch()) + asked(stream.next_batch()) for _ in range(2)]
    assert sorted(first) == sorted(second) == sorted(QUESTIONS)
    assert first != QUESTIONS and first != second
    again = PromptStream(data.model_copy(update={"shuffle_buffer": 100}), tokenizer, batch_size=5, seed=1)
    assert asked(again.next_batch()) == first[:5]


def test_a_resumed_stream_draws_what_the_uninterrupted_one_draws(tokenizer, data):
    small = data.model_copy(update={"shuffle_buffer": 3})
    uninterrupted = PromptStream(small, tokenizer, batch_size=3, seed=7)
    batches = [asked(uninterrupted.next_batch()) for _ in range(7)]  # crosses two epoch ends
    interrupted = PromptStream(small, tokenizer, batch_size=3, seed=7)
    for _ in range(4):
        interrupted.next_batch()
    resumed = PromptStream(small, tokenizer, batch_size=3, seed=7)
    resumed.load_state_dict(interrupted.state_dict())
    assert [asked(resumed.next_batch()) for _ in range(3)] == batches[4:]
    assert resumed.drawn == uninterrupted.drawn == 21


def test_a_small_buffer_only_mixes_within_its_span(tokenizer, data):
    stream = PromptStream(data.model_copy(update={"shuffle_buffer": 2}), tokenizer, batch_size=10, seed=3)
    order = [QUESTIONS.index(q) for q in asked(stream.next_batch())]
    assert sorted(order) == list(range(10))
    assert all(index - position <= 1 for position, index in enumerate(order))  # never drawn over 1 place early
    assert order != list(range(10))


def test_streaming_refuses_the_curriculum_and_is_off_by_default(tokenizer, data):
    with pytest.raises(ConfigError, match="data.streaming draws each prompt as it is read, but the curriculum"):
        stream_sampler(data, CurriculumConfig(prefilter=True), tokenizer, 4, 0)
    assert stream_sampler(data.model_copy(update={"streaming": False}), CurriculumConfig(), tokenizer, 4, 0) is None
