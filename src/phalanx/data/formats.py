"""Normalise one raw dataset row (OpenAI messages, ShareGPT, Alpaca or plain text) to a conversation.

The result is what chat templates expect: ``{"role", "content"}`` messages, assistant
``tool_calls`` as ``{"type": "function", "function": {"name", "arguments": dict}}`` (templates
do ``arguments | tojson``, so a JSON string would be quoted twice), and tools in the
``{"type": "function", "function": {...}}`` form. Every error is a DataError that starts with
the row's location and names the field, what was found and what is accepted.
"""

from __future__ import annotations

import json
from typing import Any, Optional, TypedDict

from phalanx.errors import DataError

FORMATS = ("messages", "sharegpt", "alpaca", "text")
ROLES = ("system", "user", "assistant", "tool")
# Where an assistant message may carry its reasoning; the first one present wins.
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")

# ShareGPT speaker names (lower-cased) -> roles. function_call carries a tool call as JSON.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}

ACCEPTED_SHAPES = (
    "accepted row shapes: "
    '{"messages": [{"role": ..., "content": ...}, ...], "tools": [...] (optional)} (OpenAI messages); '
    '{"conversations": [{"from": "human"|"gpt"|..., "value": ...}, ...]} (ShareGPT); '
    '{"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional)} (Alpaca); '
    '{"text": ...} (plain text)'
)


class Conversation(TypedDict):
    """A normalised row: chat ``messages`` (+ ``tools``), or plain ``text`` trained on every token."""

    messages: Optional[list[dict]]
    tools: Optional[list[dict]]
    text: Optional[str]


def _present(row: dict, key: str) -> bool:
    # Arrow-backed datasets fill absent keys with None: treat both the same.
    return row.get(key) is not None


def detect_format(row: Any, where: str) -> str:
    """The format a row is written in, from its keys (messages > conversations > alpaca > text)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, found {_kind(row)}; {ACCEPTED_SHAPES}")
    if _present(row, "messages"):
        return "messages"
    if _present(row, "conversations"):
        return "sharegpt"
    if _present(row, "instruction") and _present(row, "output"):
        return "alpaca"
    if _present(row, "text"):
        return "text"
    keys = ", ".join(repr(k) for k in row) or "none"
    raise DataError(f"{where}: cannot tell the row's format from its fields ({keys}); {ACCEPTED_SHAPES}")


def to_conversation(row: dict, where: str, fmt: str = "auto") -> Conversation:
    """Normalise ``row`` (found at ``where``, e.g. ``"data/train.jsonl line 17"``) to a Conversation."""
    if fmt == "auto":
        fmt = detect_format(row, where)
    elif fmt not in FORMATS:
        raise DataError(f"{where}: unknown format {fmt!r}; accepted: auto, {', '.join(FORMATS)}")
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, found {_kind(row)}; {ACCEPTED_SHAPES}")
    if fmt == "messages":
        return _from_messages(row, where)
    if fmt == "sharegpt":
        return _from_sharegpt(row, where)
    if fmt == "alpaca":
        return _from_alpaca(row, where)
    return _from_text(row, where)


# ---------------------------------------------------------------------------- formats


def _from_messages(row: dict, where: str) -> Conversation:
    raw = _require(row, "messages", where, "format 'messages'")
    if not isinstance(raw, list):
        raise DataError(f"{where}: messages: expected a list of message objects, found {_kind(raw)}")
    messages = [_message(m, f"messages[{i}]", where) for i, m in enumerate(raw)]
    tools = _tools(row.get("tools"), "tools", where)
    return _finish(messages, tools, "messages", where)


def _message(m: Any, path: str, where: str) -> dict:
    if not isinstance(m, dict):
        raise DataError(f"{where}: {path}: expected an object with 'role' and 'content', found {_kind(m)}")
    role = m.get("role")
    if role is None:
        raise DataError(f"{where}: {path}.role: missing; accepted roles: {', '.join(ROLES)}")
    if role not in ROLES:
        raise DataError(f"{where}: {path}.role: unknown role {role!r}; accepted roles: {', '.join(ROLES)}")
    out = {k: v for k, v in m.items() if v is not None}  # keep extra keys a template may use
    tool_calls = m.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise DataError(
                f"{where}: {path}.tool_calls: only assistant messages may carry tool calls, found role {role!r}"
            )
        out["tool_calls"] = _tool_calls(tool_calls, f"{path}.tool_calls", where)
        if not out["tool_calls"]:
            del out["tool_calls"]
    content = _content(m.get("content"), f"{path}.content", where)
    if content is None:
        if "tool_calls" not in out:
            raise DataError(
                f"{where}: {path}.content: missing; every message needs text content "
                "(an assistant message may instead carry tool_calls)"
            )
        content = ""  # many templates concatenate content; None would render as 'None'
    out["content"] = content
    for key in ("tool_call_id", "name", *REASONING_KEYS):
        if key in out and not isinstance(out[key], str):
            raise DataError(f"{where}: {path}.{key}: expected a string, found {_kind(out[key])}")
    reasoning = next((out[key] for key in REASONING_KEYS if key in out), None)
    if reasoning is not None:
        if role != "assistant":
            raise DataError(f"{where}: {path}: only assistant messages may carry reasoning, found role {role!r}")
        # Datasets and templates name it differently (Qwen3 and DeepSeek read reasoning_content, gpt-oss reads
        # thinking): every name carries it, so the template finds it under the one it reads.
        out.update({key: reasoning for key in REASONING_KEYS})
    return out


def _content(content: Any, path: str, where: str) -> Optional[str]:
    """A string, or OpenAI-style text parts joined into one string."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise DataError(
                    f'{where}: {path}[{j}]: expected a text part {{"type": "text", "text": ...}}, '
                    f"found {_short(part)}; only text content is supported"
                )
        return "".join(texts)
    raise DataError(
        f"{where}: {path}: expected a string (or a list of text parts), found {_kind(content)} {_short(content)}"
    )


def _tool_calls(calls: Any, path: str, where: str) -> list[dict]:
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise DataError(f"{where}: {path}: expected a list of tool calls, found {_kind(calls)}")
    return [_tool_call(c, f"{path}[{j}]", where) for j, c in enumerate(calls)]


def _tool_call(call: Any, path: str, where: str) -> dict:
    """``{"type": "function", "function": {"name", "arguments"}}`` or the flat ``{"name", "arguments"}``."""
    accepted = '{"type": "function", "function": {"name": ..., "arguments": ...}} or {"name": ..., "arguments": ...}'
    if not isinstance(call, dict):
        raise DataError(f"{where}: {path}: expected a tool call object, found {_kind(call)}; accepted: {accepted}")
    if call.get("function") is not None:
        fn, fpath = call["function"], f"{path}.function"
        if not isinstance(fn, dict):
            raise DataError(f"{where}: {fpath}: expected an object, found {_kind(fn)}; accepted: {accepted}")
    else:
        fn, fpath = call, path
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise DataError(
            f"{where}: {fpath}.name: expected the function name as a string, found {_short(name)}; accepted: {accepted}"
        )
    out = {
        "type": "function",
        "function": {"name": name, "arguments": _arguments(fn.get("arguments"), f"{fpath}.arguments", where)},
    }
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _arguments(args: Any, path: str, where: str) -> dict:
    if args is None:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: {path}: not valid JSON ({e.msg} at char {e.pos}): {_short(args)}; "
                "accepted: a JSON object or a string holding one"
            ) from None
    if not isinstance(args, dict):
        raise DataError(f"{where}: {path}: expected a JSON object, found {_kind(args)} {_short(args)}")
    return args


def _tools(tools: Any, path: str, where: str) -> Optional[list[dict]]:
    """Tool schemas as a list (or a JSON string of one); flat schemas are wrapped as functions."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else []
        except json.JSONDecodeError as e:
            raise DataError(
                f"{where}: {path}: not valid JSON ({e.msg} at char {e.pos}); accepted: a list of tool schemas or a JSON string of one"
            ) from None
    if not isinstance(tools, list):
        raise DataError(f"{where}: {path}: expected a list of tool schemas, found {_kind(tools)}")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict):
            raise DataError(f"{where}: {path}[{j}]: expected a tool schema object, found {_kind(t)}")
        fn = t.get("function") if t.get("function") is not None else t
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(
                f'{where}: {path}[{j}]: expected {{"type": "function", "function": {{"name": ..., "parameters": ...}}}} '
                f'or {{"name": ..., "parameters": ...}}, found {_short(t)}'
            )
        out.append(t if fn is not t else {"type": "function", "function": t})
    return out or None


def _from_sharegpt(row: dict, where: str) -> Conversation:
    raw = _require(row, "conversations", where, "format 'sharegpt'")
    if not isinstance(raw, list):
        raise DataError(f"{where}: conversations: expected a list of turns, found {_kind(raw)}")
    messages = []
    if _present(row, "system"):
        if not isinstance(row["system"], str):
            raise DataError(f"{where}: system: expected a string, found {_kind(row['system'])}")
        messages.append({"role": "system", "content": row["system"]})
    accepted = ", ".join(SHAREGPT_ROLES)
    for i, turn in enumerate(raw):
        path = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where}: {path}: expected an object with 'from' and 'value', found {_kind(turn)}")
        speaker = turn.get("from")
        if speaker is None:
            raise DataError(f"{where}: {path}.from: missing; accepted: {accepted}")
        role = SHAREGPT_ROLES.get(str(speaker).lower())
        if role is None:
            raise DataError(f"{where}: {path}.from: unknown speaker {speaker!r}; accepted: {accepted}")
        value = turn.get("value")
        if str(speaker).lower() == "function_call":
            calls = value
            if isinstance(value, str):
                try:
                    calls = json.loads(value)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{where}: {path}.value: a function_call turn must hold the call as JSON "
                        f'({{"name": ..., "arguments": ...}} or a list of them), not valid JSON ({e.msg})'
                    ) from None
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": _tool_calls(calls, f"{path}.value", where)}
            )
            continue
        if value is None or not isinstance(value, str):
            raise DataError(f"{where}: {path}.value: expected a string, found {_kind(value)}")
        messages.append({"role": role, "content": value})
    tools = _tools(row.get("tools"), "tools", where)
    return _finish(messages, tools, "conversations", where)


def _from_alpaca(row: dict, where: str) -> Conversation:
    for key in ("instruction", "output"):
        _require(row, key, where, "format 'alpaca'")
    fields = {}
    for key in ("instruction", "input", "output", "system"):
        value = row.get(key)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: {key}: expected a string, found {_kind(value)} {_short(value)}")
        fields[key] = value
    prompt = fields["instruction"]
    if fields["input"]:
        prompt = f"{prompt}\n\n{fields['input']}"
    messages = [{"role": "system", "content": fields["system"]}] if fields["system"] else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": fields["output"]}]
    return {"messages": messages, "tools": None, "text": None}


def _from_text(row: dict, where: str) -> Conversation:
    text = _require(row, "text", where, "format 'text'")
    if not isinstance(text, str):
        raise DataError(f"{where}: text: expected a string, found {_kind(text)} {_short(text)}")
    if not text:
        raise DataError(f"{where}: text: empty string")
    return {"messages": None, "tools": None, "text": text}


# ---------------------------------------------------------------------------- helpers


def _finish(messages: list[dict], tools: Optional[list[dict]], field: str, where: str) -> Conversation:
    if not messages:
        raise DataError(f"{where}: {field}: empty; a conversation needs at least one user and one assistant turn")
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise DataError(
            f"{where}: {field}: no assistant turn (roles found: {roles}); "
            "training needs at least one assistant message to learn from"
        )
    return {"messages": messages, "tools": tools, "text": None}


def _require(row: dict, key: str, where: str, what: str) -> Any:
    if row.get(key) is None:
        keys = ", ".join(repr(k) for k in row) or "none"
        raise DataError(f"{where}: {key}: missing, required by {what} (fields found: {keys}); {ACCEPTED_SHAPES}")
    return row[key]


def _kind(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
