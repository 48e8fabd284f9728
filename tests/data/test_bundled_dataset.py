"""The bundled health-agent dataset: it is exactly what its generator writes, and every row is a
well-formed OpenAI-format tool-calling conversation."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_bundled_dataset.py"
BUNDLED = REPO / "src" / "phalanx" / "data" / "bundled" / "health_agent.jsonl"

JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in BUNDLED.read_text(encoding="utf-8").splitlines()]


def test_file_is_what_the_generator_writes(tmp_path):
    out = tmp_path / "health_agent.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, capture_output=True)
    assert out.read_bytes() == BUNDLED.read_bytes(), "regenerate with: python scripts/make_bundled_dataset.py"


def test_size(rows):
    assert len(rows) >= 250
    assert BUNDLED.stat().st_size < 600_000


def _check_row(row: dict) -> dict:
    """Validate one conversation; returns a summary of its shape."""
    assert set(row) == {"messages", "tools"}
    offered = {}
    for tool in row["tools"]:
        assert tool["type"] == "function"
        fn = tool["function"]
        assert fn["name"] and fn["description"] and fn["parameters"]["type"] == "object"
        assert set(fn["parameters"]["required"]) <= set(fn["parameters"]["properties"])
        assert fn["name"] not in offered
        offered[fn["name"]] = fn["parameters"]

    messages = row["messages"]
    assert messages[0]["role"] == "system" and messages[0]["content"]
    assert messages[1]["role"] == "user"
    assert messages[-1]["role"] == "assistant" and messages[-1]["content"] and not messages[-1].get("tool_calls")

    pending: dict[str, str] = {}  # call id -> tool name, not yet answered
    seen_ids = set()
    shape = {"calls": 0, "parallel": False, "calling_turns": 0, "user_turns": 0}
    for i, m in enumerate(messages[1:], start=1):
        role = m["role"]
        assert role in {"user", "assistant", "tool"}, f"message {i}: role {role!r}"
        if role == "user":
            assert isinstance(m["content"], str) and m["content"].strip()
            assert not pending, f"message {i}: user speaks before tool calls {sorted(pending)} are answered"
            shape["user_turns"] += 1
        elif role == "assistant":
            assert not pending, f"message {i}: assistant speaks before tool calls {sorted(pending)} are answered"
            calls = m.get("tool_calls") or []
            assert calls or (isinstance(m["content"], str) and m["content"].strip())
            shape["calls"] += len(calls)
            shape["calling_turns"] += bool(calls)
            shape["parallel"] |= len(calls) > 1
            for call in calls:
                assert call["type"] == "function"
                assert call["id"].startswith("call_") and call["id"] not in seen_ids
                seen_ids.add(call["id"])
                name = call["function"]["name"]
                assert name in offered, f"message {i}: calls {name!r}, offered {sorted(offered)}"
                args = json.loads(call["function"]["arguments"])
                schema = offered[name]
                assert isinstance(args, dict)
                assert set(schema["required"]) <= set(args), f"message {i}: {name} misses required arguments"
                for key, value in args.items():
                    spec = schema["properties"][key]  # KeyError: an argument the schema does not declare
                    assert isinstance(value, JSON_TYPES[spec["type"]]) and not isinstance(value, bool), (key, value)
                    if "enum" in spec:
                        assert value in spec["enum"]
                pending[call["id"]] = name
        else:
            assert m["tool_call_id"] in pending, f"message {i}: answers unknown call {m['tool_call_id']!r}"
            pending.pop(m["tool_call_id"])
            assert isinstance(json.loads(m["content"]), dict)
    assert not pending
    return shape


def test_every_row_is_a_valid_tool_conversation(rows):
    shapes = []
    for n, row in enumerate(rows, start=1):
        try:
            shapes.append(_check_row(row))
        except (AssertionError, KeyError, json.JSONDecodeError) as e:
            raise AssertionError(f"{BUNDLED.name} line {n}: {e!r}") from e
    # The mix the demo promises: no calls, single calls, parallel calls, sequential calls, follow-ups.
    assert sum(s["calls"] == 0 for s in shapes) >= 20
    assert sum(s["calls"] == 1 for s in shapes) >= 100
    assert sum(s["parallel"] for s in shapes) >= 20
    assert sum(s["calling_turns"] >= 2 for s in shapes) >= 20
    assert sum(s["user_turns"] >= 2 for s in shapes) >= 30
    # Varied wording, not one conversation repeated.
    assert len({row["messages"][1]["content"] for row in rows}) >= 0.8 * len(rows)


def test_tool_results_follow_from_the_arguments(rows):
    checked = 0
    for row in rows:
        calls = {c["id"]: c["function"] for m in row["messages"] for c in m.get("tool_calls") or []}
        for m in row["messages"]:
            if m["role"] != "tool" or calls[m["tool_call_id"]]["name"] != "get_bmi":
                continue
            args, result = json.loads(calls[m["tool_call_id"]]["arguments"]), json.loads(m["content"])
            assert result["bmi"] == round(args["weight_kg"] / (args["height_cm"] / 100) ** 2, 1)
            checked += 1
    assert checked >= 20


def test_rendered_lengths_stay_short(rows):
    """Byte-level sequences: the embedded template keeps most conversations under 1024 bytes."""
    from phalanx.models.presets import build_embedded_tokenizer

    tokenizer = build_embedded_tokenizer()
    lengths = sorted(
        len(tokenizer.apply_chat_template(r["messages"], tools=r["tools"] or None, tokenize=False).encode())
        for r in rows
    )
    assert sum(lengths) / len(lengths) < 1200
    assert lengths[len(lengths) // 2] < 1024
    assert lengths[-1] < 4096  # max_position_embeddings of the embedded model
