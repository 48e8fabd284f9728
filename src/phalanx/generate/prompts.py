"""Read the prompts of a generation job, in the formats training reads, and render them as the model will see them.

A prompt row is any training row (OpenAI ``messages`` with ``tools``, ShareGPT, Alpaca, plain
``text``) or a plain question (``{"question": ...}`` / ``{"prompt": ...}``, or a line of a .txt
file). Chat rows are normalised by the same code as training data, so the generated records
train without conversion. A chat row may end with assistant turns (a training file used as
prompts): they are the reference answers and are dropped, so the model answers the last user
or tool message. A ``text`` row is continued as plain text, as training treats text rows.

Each prompt's id is its position among the prompts (0-based; blank lines are not counted).
"""

from __future__ import annotations

import codecs
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from phalanx.config.chat_templates import template_text
from phalanx.data.chat import PART_REPR, as_text_parts, template_refused
from phalanx.data.formats import to_conversation
from phalanx.data.sources import (
    ACCEPTED_PATHS,
    DATA_FILE_SUFFIXES,
    bundled_dataset_path,
    folder_data_files,
    is_disk_dataset,
    iter_rows,
)
from phalanx.data.special_text import encode, shield_for_template
from phalanx.errors import DataError

BUNDLED = "bundled:health-agent"
ACCEPTED_PROMPTS = (
    'accepted prompt rows: a chat row {"messages": [...], "tools": [...]} (or ShareGPT "conversations") whose '
    'last non-assistant message is answered; {"question": ...} or {"prompt": ...} (optionally with "system"); '
    'Alpaca {"instruction": ..., "input": ...}; {"text": ...} (continued as plain text); or a .txt file with '
    "one question per line"
)


@dataclass(frozen=True)
class Prompt:
    id: int
    where: str  # "prompts.jsonl line 3": every error about the prompt starts with it
    messages: Optional[list[dict]]  # a chat prompt, ending with the turn to answer
    tools: Optional[list[dict]]
    text: Optional[str]  # a plain-text prompt to continue (messages is None)
    input_ids: tuple[int, ...]


def read_prompts(
    source: str,
    tokenizer: Any,
    num_questions: Optional[int] = None,
    warn: Callable[[str], None] = print,
    template_kwargs: Optional[dict[str, Any]] = None,
) -> list[Prompt]:
    """The first `num_questions` prompts of `source` (a path or 'bundled:health-agent'), tokenized; `template_kwargs`:
    variables for the chat template (e.g. enable_thinking), as training rendered its rows with."""
    rows = _iter_source(source)
    prompts: list[Prompt] = []
    for where, row in rows:
        if num_questions is not None and len(prompts) == num_questions:
            break
        messages, tools, text = parse_prompt_row(row, where)
        if prompts and (text is None) != (prompts[0].text is None):
            kinds = {True: "a plain-text row (continued as text)", False: "a chat prompt"}
            raise DataError(
                f"{where}: {kinds[text is not None]}, but {prompts[0].where} is {kinds[prompts[0].text is not None]}; "
                "training reads one format per dataset, so a prompt file holds either chat prompts (messages, "
                'questions, ShareGPT, Alpaca) or {"text": ...} rows, not both'
            )
        prompts.append(
            Prompt(
                len(prompts),
                where,
                messages,
                tools,
                text,
                tuple(render_prompt(tokenizer, messages, tools, text, where, template_kwargs)),
            )
        )
    if not prompts:
        raise DataError(f"{source}: no prompts; {ACCEPTED_PROMPTS}")
    if num_questions is not None and len(prompts) < num_questions:
        warn(
            f"warning: --num_questions {num_questions}, but {source} holds only {len(prompts)} prompts; using all of them"
        )
    return prompts


def _iter_source(source: str):
    if source == BUNDLED:
        return iter_rows(bundled_dataset_path(), kind="path")
    path = Path(source)
    accepted = f"{ACCEPTED_PATHS}, or a .txt file of one question per line"
    if not path.exists():
        raise DataError(f"--prompts {path}: no such file or folder; {accepted}")
    if path.suffix == ".txt" and path.is_file():
        return _iter_txt(path)
    # What training's reader would refuse listing training's file types, which leave out .txt, and not by the flag:
    if path.is_file() and path.suffix not in DATA_FILE_SUFFIXES:
        raise DataError(f"--prompts {path}: unsupported file type '{path.suffix or '(none)'}'; {accepted}")
    if path.is_dir() and not folder_data_files(path) and not is_disk_dataset(path):
        txt = sorted(p.name for p in path.glob("*.txt"))
        held = f" (its {', '.join(txt[:3])} must be given as a file: --prompts {path / txt[0]})" if txt else ""
        raise DataError(f"--prompts {path}: a folder with no *.jsonl or *.parquet files{held}; {accepted}")
    return iter_rows(path, kind="path")


def _iter_txt(path: Path):
    try:
        data = path.read_bytes()
        lines = data.removeprefix(codecs.BOM_UTF8).split(b"\n")  # a Windows editor's byte-order mark is no question
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}") from None
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path} line {number}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the line); "
                "save the file as UTF-8"
            ) from None
        if line.strip():
            yield f"{path} line {number}", {"question": line}


def parse_prompt_row(row: dict, where: str) -> tuple[Optional[list[dict]], Optional[list[dict]], Optional[str]]:
    """(messages, tools, text) of one row; exactly one of messages and text is set."""
    if row.get("messages") is not None or row.get("conversations") is not None:
        return _chat_prompt(row, where)
    for key in ("question", "prompt"):
        if row.get(key) is not None:
            return _question(row, key, where), None, None
    if row.get("instruction") is not None:
        return _alpaca(row, where), None, None
    if row.get("text") is not None:
        conv = to_conversation(row, where, "text")
        return None, None, conv["text"]
    keys = ", ".join(repr(k) for k in row) or "none"
    raise DataError(f"{where}: cannot tell what to prompt with from the fields ({keys}); {ACCEPTED_PROMPTS}")


def _chat_prompt(row: dict, where: str) -> tuple[list[dict], Optional[list[dict]], None]:
    key = "messages" if row.get("messages") is not None else "conversations"
    raw = row[key]
    if isinstance(raw, list):
        # Training rows must hold an assistant turn and prompts need not: validate with a placeholder
        # answer appended (errors about the real turns keep their indices), then take it off again.
        placeholder = {"role": "assistant", "content": ""} if key == "messages" else {"from": "gpt", "value": ""}
        conv = to_conversation({**row, key: [*raw, placeholder]}, where)
        messages = conv["messages"][:-1]
    else:
        conv = to_conversation(row, where)  # raises the format's own error for a non-list
        messages = list(conv["messages"])
    roles = ", ".join(m["role"] for m in messages) or "none"
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # reference answers: the model writes its own
    if not any(m["role"] in ("user", "tool") for m in messages):
        raise DataError(
            f"{where}: {key}: no user message to answer (roles found: {roles}); "
            "a chat prompt needs a user (or tool) message before any final assistant turns"
        )
    return messages, conv["tools"], None


def _question(row: dict, key: str, where: str) -> list[dict]:
    messages = []
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise DataError(f"{where}: system: expected a string, found {type(system).__name__}")
        messages.append({"role": "system", "content": system})
    question = row[key]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: {key}: expected a non-empty string, found {json.dumps(question)[:60]}")
    return messages + [{"role": "user", "content": question}]


def _alpaca(row: dict, where: str) -> list[dict]:
    fields = {}
    for key in ("instruction", "input", "system"):
        value = row.get(key)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: {key}: expected a string, found {type(value).__name__}")
        fields[key] = value
    if not fields["instruction"].strip():
        raise DataError(f"{where}: instruction: empty string")
    question = fields["instruction"] + (f"\n\n{fields['input']}" if fields["input"] else "")
    system = [{"role": "system", "content": fields["system"]}] if fields["system"] else []
    return system + [{"role": "user", "content": question}]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _with_text_parts(tokenizer: Any, messages: list[dict], tools: Optional[list[dict]], template_kwargs) -> Any:
    """The prompt rendered with each non-assistant message's content as one text part, as training renders a row the
    string fails on (Gemma 3's first template reads the system prompt as `content[0]['text']`); None where that fails
    too, or where the template prints the parts as they are (it did not want them)."""
    try:
        rendered = tokenizer.apply_chat_template(
            as_text_parts(messages), tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
    except Exception:  # noqa: BLE001 - then the string's error is the one to say
        return None
    return None if PART_REPR in (rendered if isinstance(rendered, str) else rendered[0]) else rendered


def render_prompt(
    tokenizer: Any,
    messages: Optional[list[dict]],
    tools: Optional[list[dict]],
    text: Optional[str],
    where: str,
    template_kwargs: Optional[dict[str, Any]] = None,
) -> list[int]:
    """Token ids the model continues: the chat template with its generation prompt, or the plain text."""
    # add_special_tokens=False as in training: templates write their own BOS.
    if text is not None:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids
    if has_chat_template(tokenizer):
        # A special token's text in the prompt is text, as training encodes its rows (data.special_text): a prompt that
        # quotes <|im_end|> does not close its turn.
        messages, tools, shielded = shield_for_template(tokenizer, messages, tools, where, template_kwargs, True)
        try:
            rendered = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
            )
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, jinja) are the row's problem
            rendered = _with_text_parts(tokenizer, messages, tools, template_kwargs)
            if rendered is None:
                raise template_refused(
                    where, "this prompt", messages, e, template_text(tokenizer.chat_template)
                ) from None
        if not isinstance(rendered, str):
            rendered = rendered[0]
        if shielded is not None:
            rendered, as_text = shielded.restore(rendered, where)
            return encode(tokenizer, rendered, as_text)[0]
    else:
        rendered = plain_transcript(messages, tools)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def plain_transcript(messages: list[dict], tools: Optional[list[dict]]) -> str:
    """The fallback for tokenizers without a chat template: 'role: content' lines, then 'assistant: '."""
    lines = [f"tools: {json.dumps(tools, ensure_ascii=False)}"] if tools else []
    for m in messages:
        content = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            content += (" " if content else "") + json.dumps(call["function"], ensure_ascii=False)
        lines.append(f"{m['role']}: {content}")
    return "\n".join(lines) + "\nassistant: "


def prompts_digest(prompts: list[Prompt]) -> str:
    """A hash of what the model is asked: every prompt's conversation (or text) and its token ids, in order."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(
            json.dumps([p.messages, p.tools, p.text, list(p.input_ids)], sort_keys=True, ensure_ascii=False).encode()
        )
        h.update(b"\n")
    return h.hexdigest()
