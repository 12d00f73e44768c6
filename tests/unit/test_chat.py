"""Chat rendering: the loss mask is 1 exactly on the assistant's tokens, with the demo tokenizer."""

import pytest
from transformers import AutoTokenizer

from reinforge.data.chat import ChatExample, fit_length, render_chat
from reinforge.errors import DataError
from reinforge.paths import PROJECT_ROOT


@pytest.fixture
def tokenizer():
    return AutoTokenizer.from_pretrained(PROJECT_ROOT / "models" / "demo")


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def trained_spans(example: ChatExample, tokenizer) -> list[str]:
    """The decoded text of each contiguous run of trained tokens."""
    spans, current = [], []
    for token, trained in zip(example.token_ids + [None], example.loss_mask + [0]):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


def test_only_the_reply_and_its_end_of_turn_are_trained(tokenizer):
    """ChatML renders `<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\nanswer<|im_end|>\\n`,
    14 tokens: <|im_start|> user \\n h i <|im_end|> \\n <|im_start|> assistant \\n | an swer <|im_end|> | \\n.
    Trained: `an`, `swer`, `<|im_end|>`; not the closing newline, which generation never produces."""
    example = render_chat(chat(("user", "hi"), ("assistant", "answer")), tokenizer)
    assert example.loss_mask == [0] * 10 + [1, 1, 1] + [0]
    assert trained_spans(example, tokenizer) == ["answer<|im_end|>"]
    assert tokenizer.decode(example.token_ids[-1:]) == "\n"


def test_token_ids_are_the_chat_templates_rendering(tokenizer):
    record = chat(("user", "A jar holds 44 cards. How many?"), ("assistant", "44 + 1 = 45. The answer is \\boxed{45}."))
    example = render_chat(record, tokenizer)
    assert example.token_ids == tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=False)


def test_every_assistant_turn_is_trained_and_no_other_message(tokenizer):
    record = chat(
        ("system", "be brief"), ("user", "one"), ("assistant", "first"), ("user", "two"), ("assistant", "second")
    )
    example = render_chat(record, tokenizer)
    assert trained_spans(example, tokenizer) == ["first<|im_end|>", "second<|im_end|>"]
    assert example.num_trained_tokens == len(tokenizer("first<|im_end|>second<|im_end|>")["input_ids"])


def test_the_system_prompt_goes_first_unless_the_chat_has_one(tokenizer):
    added = render_chat(chat(("user", "hi"), ("assistant", "ok")), tokenizer, system_prompt="be brief")
    assert tokenizer.decode(added.token_ids).startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user")
    kept = render_chat(
        chat(("system", "mine"), ("user", "hi"), ("assistant", "ok")), tokenizer, system_prompt="be brief"
    )
    assert "be brief" not in tokenizer.decode(kept.token_ids)
    assert trained_spans(added, tokenizer) == trained_spans(kept, tokenizer) == ["ok<|im_end|>"]


def test_a_template_with_role_headers_and_no_separator_is_masked_the_same_way(tokenizer):
    """Llama-3-like framing: a header before each message, the end-of-turn token and nothing after it."""
    tokenizer.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + ':: ' + m['content'] + '<|im_end|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant:: ' }}{%- endif %}"
    )
    example = render_chat(chat(("user", "hi"), ("assistant", "answer"), ("user", "more")), tokenizer)
    assert trained_spans(example, tokenizer) == ["answer<|im_end|>"]
    assert tokenizer.decode(example.token_ids).endswith("answer<|im_end|><|im_start|>user:: more<|im_end|>")


def test_a_template_that_rewrites_earlier_turns_is_rejected(tokenizer):
    """Like templates that drop past reasoning: an assistant turn renders differently once it is not last."""
    tokenizer.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] != 'assistant' or loop.last %}{{- m['content'] }}{%- endif %}"
        "{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    render_chat(chat(("user", "one"), ("assistant", "first")), tokenizer)  # one turn: still consistent
    with pytest.raises(DataError, match="rewrites earlier turns"):
        render_chat(chat(("user", "one"), ("assistant", "first"), ("user", "two"), ("assistant", "second")), tokenizer)


def test_a_chat_without_an_assistant_message_is_an_error(tokenizer):
    with pytest.raises(DataError, match="no assistant message"):
        render_chat(chat(("user", "hi")), tokenizer)
    with pytest.raises(DataError, match="starts with an assistant message"):
        render_chat(chat(("assistant", "hi")), tokenizer)


def test_right_truncation_keeps_the_first_tokens_and_drops_a_chat_left_without_reply():
    example = ChatExample(token_ids=[10, 11, 12, 13, 14], loss_mask=[0, 0, 1, 1, 1])
    assert fit_length(example, 5, "right") is example
    assert fit_length(example, 4, "right") == ChatExample(token_ids=[10, 11, 12, 13], loss_mask=[0, 0, 1, 1])
    assert fit_length(example, 2, "right") is None  # only prompt tokens would remain
    assert fit_length(example, 4, "drop") is None
    assert fit_length(example, 5, "drop") is example
