"""Shared pieces for the data tests: file-free tokenizers with hand-written chat templates, sample rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import ByT5Tokenizer

# ChatML in the style of Qwen: tools in the system turn, tool calls as <tool_call> JSON, tool
# results as their own turn.
CHATML = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    '{% for tc in m.tool_calls or [] %}<tool_call>{"name": "{{ tc.function.name }}", '
    '"arguments": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n'
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

# A multi-turn tool-call conversation in the OpenAI format (arguments as a JSON string).
TOOL_ROW = {
    "messages": [
        {"role": "system", "content": "SYSTEM-TEXT"},
        {"role": "user", "content": "USER-ONE weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "TOOL-RESULT 18C"},
        {"role": "assistant", "content": "ASSISTANT-ONE It is 18C."},
        {"role": "user", "content": "USER-TWO thanks"},
        {"role": "assistant", "content": "ASSISTANT-TWO You're welcome."},
    ],
    "tools": TOOLS,
}


def _chat_row(i: int, answer: str = "fine") -> dict:
    return {
        "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"{answer} {i}"}]
    }


def _make_tokenizer(template: str | None = CHATML) -> ByT5Tokenizer:
    tok = ByT5Tokenizer()  # byte-level, needs no files; slow (no offsets)
    if template is not None:
        tok.chat_template = template
    return tok


def _write_jsonl(path: Path, rows: list) -> Path:
    """Rows as JSON lines; a str row is written as it is (for malformed lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# The data tests share these through fixtures: tests/ has its own conftest module, so
# `from conftest import ...` would be ambiguous.
@pytest.fixture
def chatml() -> str:
    return CHATML


@pytest.fixture
def tool_row() -> dict:
    return json.loads(json.dumps(TOOL_ROW))


@pytest.fixture
def tools() -> list:
    return json.loads(json.dumps(TOOLS))


@pytest.fixture
def chat_row():
    return _chat_row


@pytest.fixture
def make_tokenizer():
    return _make_tokenizer


@pytest.fixture
def write_jsonl():
    return _write_jsonl


@pytest.fixture
def tokenizer() -> ByT5Tokenizer:
    return _make_tokenizer()


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Keep load_dataset's Arrow cache inside the test's folder, and never reach the network."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
