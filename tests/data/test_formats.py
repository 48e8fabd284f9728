"""Every row format normalises to one conversation shape; every bad row names its place and the field."""

from __future__ import annotations

import json

import pytest

from phalanx.data.formats import detect_format, to_conversation
from phalanx.errors import DataError

WHERE = "data/train.jsonl line 17"


def test_openai_messages_with_tools_and_string_arguments(tool_row, tools):
    conv = to_conversation(tool_row, WHERE)
    msgs = conv["messages"]
    assert conv["tools"] == tools and conv["text"] is None
    call = msgs[2]["tool_calls"][0]
    assert call == {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert msgs[2]["content"] == ""  # None would render as 'None' in many templates
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "TOOL-RESULT 18C"}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]


def test_flat_tool_calls_flat_tools_text_parts_and_null_keys():
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": None},
            {
                "role": "assistant",
                "tool_calls": [{"name": "f", "arguments": {"x": 1}, "id": "c9"}],
                "tool_call_id": None,
            },
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "done", "tool_calls": None},
        ],
        "tools": json.dumps([{"name": "f", "parameters": {"type": "object"}}]),
    }
    conv = to_conversation(row, WHERE, "messages")
    assert conv["messages"][0] == {"role": "user", "content": "ab"}
    assert conv["messages"][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c9"}
    ]
    assert "tool_call_id" not in conv["messages"][1]
    assert conv["messages"][3] == {"role": "assistant", "content": "done"}
    assert conv["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_sharegpt_roles_and_function_calls(tools):
    row = {
        "system": "be brief",
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "function_call", "value": json.dumps({"name": "f", "arguments": {"q": "x"}})},
            {"from": "observation", "value": "42"},
            {"from": "gpt", "value": "it is 42"},
        ],
        "tools": json.dumps(tools),
    }
    conv = to_conversation(row, WHERE)
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv["messages"][2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"q": "x"}}
    assert conv["messages"][4]["content"] == "it is 42"
    assert conv["tools"] == tools


def test_alpaca_with_and_without_input():
    conv = to_conversation({"instruction": "Add", "input": "1 and 2", "output": "3", "system": "math"}, WHERE)
    assert conv["messages"] == [
        {"role": "system", "content": "math"},
        {"role": "user", "content": "Add\n\n1 and 2"},
        {"role": "assistant", "content": "3"},
    ]
    conv = to_conversation({"instruction": "Say hi", "input": "", "output": "hi"}, WHERE)
    assert conv["messages"] == [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]


def test_plain_text():
    assert to_conversation({"text": "once upon a time"}, WHERE) == {
        "messages": None,
        "tools": None,
        "text": "once upon a time",
    }


@pytest.mark.parametrize(
    "row, fmt",
    [
        ({"messages": [], "tools": None}, "messages"),
        ({"conversations": [{"from": "human", "value": "a"}]}, "sharegpt"),
        ({"instruction": "a", "output": "b"}, "alpaca"),
        ({"text": "a", "messages": None}, "text"),  # Arrow fills absent keys with None
    ],
)
def test_auto_detection(row, fmt):
    assert detect_format(row, WHERE) == fmt


def _error(row, fmt="auto") -> str:
    with pytest.raises(DataError) as info:
        to_conversation(row, WHERE, fmt)
    message = str(info.value)
    assert message.startswith(WHERE + ": ")
    return message


def test_unknown_role_lists_accepted_roles():
    msg = _error({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})
    assert "messages[1].role" in msg and "'bot'" in msg and "system, user, assistant, tool" in msg


def test_no_assistant_turn():
    msg = _error({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]})
    assert "no assistant turn" in msg and "system, user" in msg
    assert "no assistant turn" in _error({"conversations": [{"from": "human", "value": "a"}]})


def test_unknown_shape_lists_accepted_shapes():
    msg = _error({"prompt": "a", "completion": "b"})
    assert "'prompt', 'completion'" in msg
    for shape in ('"messages"', '"conversations"', '"instruction"', '"text"'):
        assert shape in msg
    assert "format 'alpaca'" in _error({"prompt": "a"}, "alpaca")


def test_content_of_wrong_type():
    msg = _error({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "b"}]})
    assert "messages[0].content" in msg and "a number" in msg and "expected a string" in msg
    msg = _error(
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "b"}]}
    )
    assert "messages[0].content[0]" in msg and "text" in msg
    assert "output: expected a string" in _error({"instruction": "a", "output": ["b"]})
    assert "conversations[0].value" in _error({"conversations": [{"from": "human", "value": 3}]})


def test_empty_messages():
    assert "messages: empty" in _error({"messages": []}, "messages")
    assert "messages: expected a list" in _error({"messages": "hi"})


def test_arguments_that_are_not_json_name_the_field_path(tool_row):
    row = tool_row
    row["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    msg = _error(row)
    assert "messages[2].tool_calls[0].function.arguments" in msg and "not valid JSON" in msg and "{city: Paris" in msg
    row["messages"][2]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    assert "expected a JSON object, found a list" in _error(row)


def test_other_message_errors():
    assert "messages[0]: expected an object" in _error({"messages": ["hi", {"role": "assistant", "content": "b"}]})
    assert "messages[1].role: missing" in _error({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]})
    assert "messages[0].tool_calls: only assistant" in _error(
        {
            "messages": [
                {"role": "user", "content": "a", "tool_calls": [{"name": "f"}]},
                {"role": "assistant", "content": "b"},
            ]
        }
    )
    assert "messages[1].content: missing" in _error(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}
    )
    assert "conversations[1].from: unknown speaker 'robot'" in _error(
        {"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}
    )
    assert "unknown format 'csv'" in _error({"text": "a"}, "csv")
    assert "text: expected a string" in _error({"text": 1}, "text")


def test_reasoning_under_any_common_name_reaches_every_name_templates_read():
    for key in ("reasoning_content", "reasoning", "thinking"):
        row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: "because"}]}
        message = to_conversation(row, "row 1")["messages"][1]
        assert (message["reasoning_content"], message["reasoning"], message["thinking"]) == ("because",) * 3
    with pytest.raises(DataError, match=r"^row 1: messages\[0\]: only assistant messages may carry reasoning"):
        to_conversation(
            {"messages": [{"role": "user", "content": "q", "thinking": "x"}, {"role": "assistant", "content": "a"}]},
            "row 1",
        )
    with pytest.raises(DataError, match=r"^row 1: messages\[1\]\.reasoning_content: expected a string, found a list"):
        to_conversation(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "reasoning_content": ["x"]},
                ]
            },
            "row 1",
        )
