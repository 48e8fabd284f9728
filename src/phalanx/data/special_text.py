"""A special token's text written in a row is text: only the chat template's own markup becomes control tokens.

A tokenizer reads the text of its special tokens as those tokens wherever it meets it. Rendered and tokenized as one
string, a user message that quotes `<|im_end|>` closes its turn there, and an answer that mentions `</s>` or
`<|endoftext|>` teaches the model to stop (or pad) in the middle of a sentence. So the row's own strings are
*shielded* before the template sees them: each special token's text becomes a run of one stand-in character per
token, of the same length, so every position the masker finds in the rendering holds in the real text; the rendering
is then encoded with the template's markup as tokens and the shielded runs as the characters they were
(split_special_tokens). transformers' `apply_chat_template(sanitize_control_tokens=True)` does the same for a prompt,
but wraps the tokens in markers (every position after one moves) and returns ids without offsets, which the masker's
character spans need.

What is shielded: in system, user and tool messages and the tool schemas, every special token (the tokenizer's
special tokens map and added tokens marked special); in an answer, only the sequence tokens (begin, end, padding,
unknown): the markup tokens an answer holds (`<think>`, `[TOOL_CALLS]`, `<|python_tag|>`) are ones the model
generates. Added tokens that are not special (`<think>`, `<tool_call>` in Qwen's and DeepSeek's tokenizers) are never
shielded, and neither is a token the template itself reads in the row's text (shield_for_template).
`data.special_token_text: token` shields nothing, for rows that write a model's markup by hand.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from phalanx.errors import DataError

SPECIAL_TOKEN_TEXT = ("text", "token")
# Tangut, a script of 12th-century Xixia: no chat dataset writes it (a row that does is refused), and, unlike a
# private-use character, a template that prints a mapping the Python way (repr) writes its letters as they are.
_SHIELD_BASE = 0x17000


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts the tokenizer reads as special tokens, longer than one character (a one-character token's text is
    ordinary text in any row), longest first."""
    names = {str(t) for t in getattr(tokenizer, "all_special_tokens", None) or []}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    names |= {str(t.content) for t in decoder.values() if getattr(t, "special", False)}
    return tuple(sorted((n for n in names if len(n) > 1), key=lambda n: (-len(n), n)))


def sequence_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's named sequence tokens (begin, end, padding, unknown, separator, ...): no answer writes one."""
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    return tuple(str(t) for t in (getattr(tokenizer, name, None) for name in names) if t)


@functools.lru_cache(maxsize=16)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(re.escape(t) for t in tokens))


@dataclass
class Shield:
    """The special tokens a row's strings held, and what they became: run character -> token text."""

    tokens: dict[str, str]
    counts: dict[str, int] = field(default_factory=dict)  # token text -> occurrences in the row

    def restore(self, text: str, where: str) -> tuple[str, list[tuple[int, int]]]:
        """`text` (a rendering of the shielded row) with each run back as the token texts it stood for, and where they
        are: those ranges are ordinary text. A run the template cut (it sliced a string) is refused: no text stands
        there that the row wrote."""
        for char, token in self.tokens.items():
            if json.dumps(char)[1:-1] in text:  # tojson(ensure_ascii=True) wrote it as \\uXXXX escapes
                raise DataError(
                    f"{where}: the chat template writes the row's text {token!r} escaped as JSON's \\u sequences, which "
                    "phalanx cannot encode as written; edit the row to leave that text out, or set "
                    "data.special_token_text: token (the row's special-token text read as tokens)"
                )
        ranges: list[tuple[int, int]] = []
        parts: list[str] = []
        last = 0
        for run in self._runs().finditer(text):
            token = self.tokens[run.group(1)]
            length = run.end() - run.start()
            if length % len(token):
                raise DataError(
                    f"{where}: the chat template cut the text {token!r} that the row holds (it slices or splits the "
                    "row's strings), so the rendering cannot be encoded as written; edit the row to leave that text "
                    "out, or set data.special_token_text: token (the row's special-token text read as tokens)"
                )
            parts += [text[last : run.start()], token * (length // len(token))]
            ranges.append((run.start(), run.end()))
            last = run.end()
        parts.append(text[last:])
        return "".join(parts), ranges

    def readable(self, text: str) -> str:
        """`text` with every run back as the token texts it stood for, a cut one as far as it goes (for messages)."""

        def back(run: re.Match) -> str:
            token, length = self.tokens[run.group(1)], run.end() - run.start()
            return token * (length // len(token)) + token[: length % len(token)]

        return self._runs().sub(back, text)

    def _runs(self) -> re.Pattern:
        return re.compile("([" + "".join(self.tokens) + "])\\1*")


def shield_for_template(
    tokenizer: Any,
    messages: list[dict],
    tools: Optional[list],
    where: str,
    template_kwargs: Optional[dict[str, Any]] = None,
    generation_prompt: bool = False,
) -> tuple[list[dict], Optional[list], Optional[Shield]]:
    """`shield`, less the tokens the chat template reads in the row's text: GLM-4.7 splits an answer's content at
    `</think>` (a special token of its tokenizer) to write the reasoning before it as a reasoning block, which it
    cannot do with the text shielded. A token is shielded only where the rendering with it shielded, restored, is the
    rendering of the row as it is."""
    shielded = shield(tokenizer, messages, tools, where)
    if shielded[2] is None:
        return shielded
    original = _render(tokenizer, messages, tools, template_kwargs, generation_prompt)
    if original is None:  # the template refuses the row: the masker says why, with the row shielded or not
        return shielded
    kept = []
    for token in shielded[2].counts:
        one = shield(tokenizer, messages, tools, where, (token,))
        rendered = _render(tokenizer, one[0], one[1], template_kwargs, generation_prompt)
        try:
            if rendered is not None and one[2] is not None and one[2].restore(rendered, where)[0] == original:
                kept.append(token)
        except DataError:
            continue
    if len(kept) == len(shielded[2].counts):
        return shielded
    return shield(tokenizer, messages, tools, where, tuple(kept)) if kept else (messages, tools, None)


def _render(
    tokenizer: Any,
    messages: list[dict],
    tools: Optional[list],
    template_kwargs: Optional[dict],
    generation_prompt: bool,
) -> Optional[str]:
    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False, **(template_kwargs or {})
        )
    except Exception:  # noqa: BLE001 - any template error: the masker renders the row again and says it
        return None
    return out if isinstance(out, str) else out[0]


def shield(
    tokenizer: Any, messages: list[dict], tools: Optional[list], where: str, only: Optional[tuple[str, ...]] = None
) -> tuple[list[dict], Optional[list], Optional[Shield]]:
    """The messages and tools with each special token's text shielded (of `only`, when given), and the Shield that
    restores it; the same objects and None when no string of the row holds one."""
    tokens = special_token_texts(tokenizer)
    if only is not None:
        tokens = tuple(t for t in tokens if t in only)
    if not tokens:
        return messages, tools, None
    runs = {token: chr(_SHIELD_BASE + k) for k, token in enumerate(tokens)}
    ends = set(sequence_tokens(tokenizer))
    everywhere, in_answers = _pattern(tokens), _pattern(tuple(t for t in tokens if t in ends))
    counts: dict[str, int] = {}

    def shielded(value: Any, pattern: re.Pattern) -> Any:
        if isinstance(value, str):
            if not pattern.pattern or not pattern.search(value):
                return value
            for match in pattern.finditer(value):
                counts[match.group()] = counts.get(match.group(), 0) + 1
            return pattern.sub(lambda m: runs[m.group()] * len(m.group()), value)
        if isinstance(value, dict):  # keys are the format's names, never the row's words
            return {key: shielded(item, pattern) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [shielded(item, pattern) for item in value]
        return value

    # An answer is what the model writes: the markup tokens it holds (<think>, [TOOL_CALLS], <|python_tag|>) are ones
    # the model generates. Only the sequence tokens (end, begin, padding) are never written inside one.
    new_messages = [shielded(m, in_answers if m.get("role") == "assistant" else everywhere) for m in messages]
    new_tools = shielded(tools, everywhere) if tools is not None else None
    if not counts:
        return messages, tools, None
    used = set(runs.values())
    if any(char in used for text in _strings((messages, tools)) for char in text if ord(char) >= _SHIELD_BASE):
        raise DataError(
            f"{where}: the row holds letters of the Tangut script (U+17000..) that phalanx uses to write special-token "
            "text as text; remove them, or set data.special_token_text: token"
        )
    return new_messages, new_tools, Shield({runs[t]: t for t in counts}, counts)


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def encode(
    tokenizer: Any, text: str, as_text: list[tuple[int, int]]
) -> tuple[list[int], Optional[list[tuple[int, int]]]]:
    """Ids of `text` as the tokenizer reads it, except the ranges `as_text` (special-token text the row wrote), encoded
    as ordinary text; with each id's character offsets (None for a slow tokenizer, which has none). A fast tokenizer
    reads the whole text once, as inference does, and the tokens it made of each range (its special tokens, each
    matched whole before the text is split) are replaced: everything else is tokenized exactly as without a range."""
    if not getattr(tokenizer, "is_fast", False):
        bounds = sorted({0, len(text), *(x for r in as_text for x in r)})
        ids: list[int] = []
        for a, b in zip(bounds, bounds[1:]):
            if (a, b) in as_text:
                ids += as_text_ids(tokenizer, text[a:b])
            else:
                ids += tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        return ids, None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    for a, b in reversed(as_text):  # from the end, so the indices before a range stay valid
        inside = [k for k, (x, y) in enumerate(offsets) if x < b and y > a]
        if not inside:
            continue
        first, last = inside[0], inside[-1] + 1
        start, end = min(a, offsets[first][0]), max(b, offsets[last - 1][1])  # a token that took blank space with it
        plain = as_text_ids(tokenizer, text[start:end])
        ids[first:last] = plain
        offsets[first:last] = [(start, end)] * len(plain)
    return ids, offsets


def as_text_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as ordinary text, no added token matched. Encoded after a newline that is then dropped, where the
    newline's ids lead, so a SentencePiece tokenizer does not give it the word-start space of a string's beginning
    (transformers' sanitize_control_tokens does the same)."""
    newline = tokenizer("\n", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    led = list(tokenizer("\n" + text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if newline and led[: len(newline)] == newline:
        return led[len(newline) :]
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
