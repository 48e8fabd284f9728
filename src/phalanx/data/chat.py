"""Render a conversation with the tokenizer's own chat template and mark the tokens the loss trains on.

Template-agnostic by construction: no list of known templates. For every assistant turn i the
template renders ``messages[:i]`` with the generation prompt (what the model sees before it
answers) and ``messages[:i+1]`` without it; the characters in between are exactly what the
model must produce for that turn: its content, its rendered tool calls and the end-of-turn
marker. Both renderings must be prefixes of the whole conversation's rendering; a template
that rewrites earlier turns once later ones exist is refused, because the spans would not line
up with the text the model trains on.

Labels are the input ids on target tokens and -100 elsewhere; the shift by one happens in the
loss, not here.
"""

from __future__ import annotations

from typing import Any, Optional

from phalanx.data.formats import Conversation
from phalanx.errors import DataError

IGNORE_INDEX = -100


def tokenize_conversation(tokenizer: Any, conv: Conversation, where: str) -> dict[str, list[int]]:
    """``{"input_ids", "labels"}`` for one normalised conversation (or plain text row)."""
    if conv.get("text") is not None:
        return _tokenize_text(tokenizer, conv["text"])
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"{where}: the tokenizer ({name}) has no chat template, so chat rows cannot be rendered; "
            "use a model whose tokenizer ships one (an instruct/chat model), set tokenizer.chat_template, "
            "or give plain {\"text\": ...} rows"
        )
    text, spans = render_with_spans(tokenizer, conv["messages"], conv.get("tools"), where)
    return _tokenize_spans(tokenizer, text, spans)


def render_with_spans(
    tokenizer: Any, messages: list[dict], tools: Optional[list[dict]], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of its assistant turns."""
    full = _render(tokenizer, messages, tools, False, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], tools, True, where)
        turn = _render(tokenizer, messages[: i + 1], tools, False, where)
        if not turn.startswith(prompt):
            before = _render(tokenizer, messages[:i], tools, False, where)
            if not turn.startswith(before):
                raise _unstable(where, i, before, turn)
            raise DataError(
                f"{where}: the chat template is not prefix-stable at messages[{i}] (assistant): its generation "
                f"prompt (add_generation_prompt=True) is not how it starts the assistant turn it then renders "
                f"({_divergence(prompt, turn)}), so the assistant tokens cannot be located. "
                "Use a template whose generation prompt matches how it renders assistant turns."
            )
        if not full.startswith(turn):
            raise _unstable(where, i + 1, turn, full)
        if len(turn) > len(prompt):
            spans.append((len(prompt), len(turn)))
    return full, _merge(spans)


def _render(tokenizer: Any, messages: list[dict], tools: Optional[list[dict]], generation_prompt: bool, where: str) -> str:
    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception, jinja) are the row's problem
        raise DataError(
            f"{where}: the tokenizer's chat template failed on messages[:{len(messages)}] "
            f"(roles: {', '.join(m['role'] for m in messages) or 'none'}): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(out, str):  # some versions hand back a list for batched input
        out = out[0]
    return out


def _tokenize_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> dict[str, list[int]]:
    # add_special_tokens=False everywhere: templates write their own BOS; adding one would double it.
    if getattr(tokenizer, "is_fast", False):
        # Tokenize the whole text as inference will, and keep each token that overlaps a span.
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, labels, k = enc["input_ids"], [], 0
        for token, (a, b) in zip(ids, enc["offset_mapping"]):
            while k < len(spans) and spans[k][1] <= a:  # spans are sorted and disjoint
                k += 1
            inside = k < len(spans) and spans[k][0] < max(b, a + 1)  # zero-width tokens count at their start
            labels.append(token if inside else IGNORE_INDEX)
        return {"input_ids": list(ids), "labels": labels}
    # Slow tokenizers have no offsets: tokenize segment by segment, so target tokens are exact.
    bounds = sorted({0, len(text), *(x for span in spans for x in span)})
    segments = [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)]
    ids, labels = [], []
    pieces = tokenizer([text[a:b] for a, b in segments], add_special_tokens=False)["input_ids"] if segments else []
    for (a, b), piece in zip(segments, pieces):
        ids += piece
        inside = any(s <= a and b <= e for s, e in spans)
        labels += piece if inside else [IGNORE_INDEX] * len(piece)
    return {"input_ids": ids, "labels": labels}


def _tokenize_text(tokenizer: Any, text: str) -> dict[str, list[int]]:
    """Plain text trains on every token; EOS closes it, BOS (when the tokenizer has one) opens it."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    labels = list(ids)
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
        labels.insert(0, IGNORE_INDEX)  # nothing predicts the first token
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
        labels.append(eos)
    return {"input_ids": ids, "labels": labels}


def _unstable(where: str, n: int, prefix: str, longer: str) -> DataError:
    return DataError(
        f"{where}: the chat template is not prefix-stable: the rendering of messages[:{n}] changes once later "
        f"messages are added ({_divergence(prefix, longer)}); templates that rewrite earlier turns (e.g. drop the "
        "reasoning of past assistant turns, move the tools next to the last user message, or count the turns) "
        "cannot be masked turn by turn. Use a prefix-stable template, or split the conversation into one row "
        "per assistant turn."
    )


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _divergence(prefix: str, text: str) -> str:
    n = 0
    while n < len(prefix) and n < len(text) and prefix[n] == text[n]:
        n += 1
    start = max(0, n - 20)
    return f"they part at character {n}: {prefix[start:n + 40]!r} vs {text[start:n + 40]!r}"
