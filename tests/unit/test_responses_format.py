"""Chat messages to and from NeMo Gym's Responses shapes (data/responses_format.py), on hand-built
rows and conversations with exact expected outputs."""

import pytest

from reinforge.data.responses_format import chat_to_response, create_params_to_chat, hermes_messages, items_to_chat
from reinforge.errors import DataError

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "strict": True,
    "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": WEATHER_TOOL["parameters"]},
}
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "SF"}}'


def test_a_string_input_is_one_user_message_and_instructions_lead_as_system():
    messages, tools = create_params_to_chat({"input": "what's it like in sf?", "instructions": "Be brief."})
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "what's it like in sf?"},
    ]
    assert tools is None


def test_easy_and_typed_messages_with_part_lists_become_string_content_and_tools_chat_form():
    params = {
        "input": [
            {"role": "developer", "content": "You help."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "sf "}, {"type": "input_text", "text": "weather?"}],
            },
        ],
        "tools": [WEATHER_TOOL],
    }
    messages, tools = create_params_to_chat(params)
    assert messages == [{"role": "developer", "content": "You help."}, {"role": "user", "content": "sf weather?"}]
    assert tools == [WEATHER_CHAT_TOOL]


def test_a_message_and_the_calls_after_it_make_one_assistant_turn_and_outputs_are_tool_messages():
    items = [
        {"role": "user", "content": "sf and nyc?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "two cities"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "SF"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "NYC"}'},
        {"type": "function_call_output", "call_id": "c1", "output": '{"weather": "cold"}'},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "warm"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_2",
            "content": [{"type": "output_text", "text": "Cold, warm.", "annotations": []}],
        },
    ]
    assert items_to_chat(items) == [
        {"role": "user", "content": "sf and nyc?"},
        {
            "role": "assistant",
            "content": "<think>two cities</think>Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "SF"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "NYC"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"weather": "cold"}'},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
        {"role": "assistant", "content": "Cold, warm."},
    ]


def test_hermes_messages_write_tool_calls_as_blocks_after_the_text():
    messages = [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "SF"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    assert hermes_messages(messages) == [
        {"role": "assistant", "content": f"Checking.<tool_call>{CALL_JSON}</tool_call>"},
        {"role": "tool", "content": "cold"},
    ]


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"input": 3}, "must be a string or a list"),
        ({"tools": []}, "with an `input`"),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
            "'input_file' is not supported",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "needs a name and a call_id"),
    ],
)
def test_unsupported_inputs_are_one_line_data_errors(params, fragment):
    with pytest.raises(DataError, match=fragment):
        create_params_to_chat(params)


def test_hermes_calls_become_function_calls_and_tool_results_answer_them_in_order():
    messages = [
        {
            "role": "assistant",
            "content": f"Let me check.\n<tool_call>{CALL_JSON}</tool_call>\n"
            '<tool_call>{"name": "get_weather", "arguments": {"city": "LA"}}</tool_call>',
        },
        {"role": "tool", "content": "cold"},
        {"role": "tool", "content": "hot"},
        {"role": "assistant", "content": "SF is cold, LA hot."},
    ]
    response = chat_to_response(messages, tools=[WEATHER_TOOL], model="policy", response_id="resp_e1")
    assert response == {
        "id": "resp_e1",
        "object": "response",
        "created_at": 0,
        "model": "policy",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [WEATHER_TOOL],
        "output": [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "SF"}',
                "status": "completed",
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city": "LA"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
            {"type": "function_call_output", "call_id": "call_2", "output": "hot"},
            {
                "id": "msg_6",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "SF is cold, LA hot.", "annotations": []}],
            },
        ],
    }


def test_a_call_only_turn_has_no_message_item_and_openai_tool_calls_keep_their_ids():
    messages = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "abc", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "SF"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "abc", "content": "cold"},
    ]
    output = chat_to_response(messages, tools=None, model="m", response_id="r")["output"]
    assert output == [
        {
            "type": "function_call",
            "call_id": "abc",
            "name": "get_weather",
            "arguments": '{"city": "SF"}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "abc", "output": "cold"},
    ]


def test_a_malformed_block_stays_text_and_its_error_answer_is_left_out():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    messages = [
        {"role": "assistant", "content": text},
        {"role": "tool", "content": "error: the tool call is not valid JSON"},
    ]
    output = chat_to_response(messages, tools=None, model="m", response_id="r")["output"]
    assert output == [
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    ]


def test_an_empty_answer_is_an_empty_message_as_gym_makes_it():
    output = chat_to_response([{"role": "assistant", "content": ""}], tools=None, model="m", response_id="r")["output"]
    assert output == [
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "", "annotations": []}],
        }
    ]


def test_the_response_output_converts_back_to_the_conversation_it_came_from():
    messages = [
        {"role": "assistant", "content": f"<tool_call>{CALL_JSON}</tool_call>"},
        {"role": "tool", "content": "cold"},
        {"role": "assistant", "content": "It is cold."},
    ]
    output = chat_to_response(messages, tools=None, model="m", response_id="r")["output"]
    assert hermes_messages(items_to_chat(output)) == messages
