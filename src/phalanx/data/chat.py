"""Render a conversation with its chat template and mark the tokens the loss trains on.

Template-agnostic: there is no list of known templates. Every position comes from rendering the
conversation (and a few variations of it) with the template itself, and every position is
checked; a row whose trained text cannot be located with certainty is refused with the reason.

For assistant message i, the *turn view* is ``render(messages[:i+1])``, the conversation as it
stands once that message is written. In it the turn's output (what the model must produce:
rendered reasoning, content, tool calls, end-of-turn marker) is located as:

- start: the end of the generation prompt ``render(messages[:i], add_generation_prompt=True)``
  when the view starts with it: what the prompt pre-fills is never trained, even when the message's
  reasoning (as ``reasoning_content`` or as a ``<think>`` block opening its content) renders it too
  (QwQ's and Nemotron 3's ``<think>\n``); only an answer whose own words start earlier starts there.
  A generation prompt that also pre-fills the start of an answer the finished turn does not render
  (DeepSeek-R1-Distill's ``<｜Assistant｜><think>\\n``) is accepted when it covers
  everything before the first character the message itself decides (found by rendering a sentinel
  message in its place), or when it ends with exactly the text the
  turn writes before that character (DeepSeek-V3.2: prompt ``<｜Assistant｜><think></think>``, turn
  ``<｜Assistant｜></think>answer``); the output then starts there. When the
  context before the turn renders differently in the view (Mistral's moved system prompt, an
  earlier turn's dropped reasoning), the output starts after the generation prompt's header,
  which must lead into the message's text. An assistant message that opens the conversation (a greeting) has
  the empty conversation as its context, which transformers will not render: the template renders it directly,
  and where it cannot (it reads messages[0]), the output starts after the generation prompt's header, which must
  then lead into the message's text.
- end: the end of the view, less the trailer the template writes after whatever message ends a
  conversation (Phi-3.5's final ``<|endoftext|>``: the context rendered without and with a
  generation prompt part there). Checked against the view followed by a user message: it may part
  earlier only inside the message's own text (the turn is rewritten once followed: Qwen3) or
  before text written only after a final assistant message (gpt-oss's ``<|return|>``, trained;
  Gemma 4's ``<|tool_response>`` after a last tool call, which opens the result the caller writes);
  parting anywhere else means the end is ambiguous (Command R writes the next header even without a
  generation prompt) and the row is refused. A part inside a special token or a marker
  (`<|START_TEXT|>`, `[TOOL_CALLS]`, whether or not the tokenizer has it as a token) snaps to its start.
  A turn the template ends with nothing of its own may be closed by the next message: when that
  message's rendering opens with the end-of-sequence token (Apertus writes ``<|assistant_end|>`` as a
  following user message's first text), the token is the turn's stop and is trained with it (in a
  per_turn row, the next message's rendering cut after it). A conversation's last message is probed with a
  user message after it, and its close is added after it.

How a conversation with several assistant turns becomes rows (``data.multi_turn``):

- ``full``: one row, the whole conversation rendered once. Each turn's output must be found in
  it: at the same place when the view is a prefix of the whole rendering, else at the single
  occurrence that covers the characters the message decides (the part of the rendering that
  changes when its text is replaced by a sentinel). Templates that move other text (Mistral puts
  the system prompt and tools next to the last user message) pass this way.
- ``per_turn``: one row per assistant message, its turn view, trained on its output only: each
  row is the context the model saw when it wrote that turn. This is what templates that rewrite
  earlier turns need (Qwen3 drops past reasoning and the empty think block once a later user
  query exists, so the whole rendering does not hold what the model wrote).
- ``auto``: full when every turn is found in the whole rendering, else per_turn.

The text the template renders is checked too: an assistant message whose content, tool call name
or argument does not appear in its located output was dropped by the template (DeepSeek-R1-Distill's
own template renders tool calls only when content is None) and is refused, never trained as an
empty turn; so is a message with empty content for which the template writes nothing, not even an end-of-turn
marker (GLM-4-9B skips it).

A template that raises on the row may read a message's content as OpenAI's list of parts, which phalanx joins into
one string (Gemma 3's first template takes the system prompt as ``content[0]['text']``): the row is rendered again with
each system, user and tool message's content as one text part, and refused with the template's error where that fails
too. Likewise a template that needs a tool message's `name` (FunctionGemma's), which OpenAI's tool messages lack (they
name the call they answer, `tool_call_id`): the row is rendered again with each named after that call's function.

Labels are the input ids on target tokens and -100 elsewhere; the shift by one happens in the
loss, not here.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from phalanx.config.chat_templates import (
    SANDBOX,
    sandbox_gap,
    template_text,
    unset_special_token,
    unset_template_variable,
)
from phalanx.data.formats import REASONING_KEYS, Conversation
from phalanx.data.special_text import SPECIAL_TOKEN_TEXT, Shield, as_text_ids, encode, shield_for_template
from phalanx.errors import DataError

IGNORE_INDEX = -100
MULTI_TURN_POLICIES = ("auto", "full", "per_turn")
# Private-use characters: no template writes them and no content starts with them, so the first
# character where a rendering with the sentinel differs is exactly where the message's own text starts.
SENTINEL = "\ue000phalanx-sentinel\ue001"


@dataclass
class Tokenized:
    """The rows one conversation becomes, and how."""

    examples: list[dict[str, list[int]]]  # each {"input_ids", "labels"}
    policy: str  # "full", "per_turn" or "text"
    reasoning_dropped: int = 0  # assistant messages with reasoning the template does not render
    system_dropped: bool = False  # a system prompt the template does not render (Mistral's, unless a user turn is last)
    tools_dropped: bool = False  # tool schemas given with the row that the template does not render (R1-Distill's)
    unterminated: int = 0  # trained turns the template ends with no marker after the text (nothing teaches a stop)
    notes: list[str] = field(default_factory=list)  # why auto chose per_turn
    # the marker that ends a trained turn when it is no token of this tokenizer and the turn trains no end-of-sequence
    # token (Llama 3's <|eot_id|> with a ChatML tokenizer): marker -> turns; the model learns no stop it can take
    foreign_end_markers: dict[str, int] = field(default_factory=dict)
    # the token that ends a trained turn when it is a token of this tokenizer but not its end-of-sequence token (ChatML's
    # <|im_end|> under a base model's <|endoftext|>, Llama 3.1's <|eom_id|> after a tool call): token -> turns. Whether
    # generation stops at it is the model's generation config's to say (data.prepare.add_template_notes).
    end_tokens: dict[str, int] = field(default_factory=dict)
    # special tokens' text the row's own strings hold, encoded as ordinary text (data.special_text): text -> occurrences
    special_texts: dict[str, int] = field(default_factory=dict)


@dataclass
class _Turn:
    index: int  # position of the assistant message in the conversation
    view: str  # render(messages[:index + 1])
    start: int  # the output is view[start:end]
    end: int
    own_end: int  # where the message's own text ends; only blank space after it up to end: no end-of-turn marker
    # (for a tool call, its text ends with the calls when the turn then opens the tool result: Gemma 4)
    close: str = ""  # the end-of-sequence token the next message writes first, right after the turn (Apertus)
    # The template writes nothing but blank space after the message's own text (DeciLM ends a turn with the newline
    # before the next `### User:`; an end-of-sequence token that is blank, RWKV's "\n\n", is a stop): none to learn,
    # unless a close follows.
    unmarked: bool = False

    @property
    def output(self) -> str:
        return self.view[self.start : self.end]

    def example(self) -> tuple[str, tuple[int, int]]:
        """The turn's per_turn row and its trained span: the view, or with a close the view up to the turn's end and
        the close (the next message's rendering cut after it: what the model wrote, stop included)."""
        if self.close:
            return self.view[: self.end] + self.close, (self.start, self.end + len(self.close))
        return self.view, (self.start, self.end)


def tokenize_conversation(
    tokenizer: Any,
    conv: Conversation,
    where: str,
    multi_turn: str = "auto",
    template_kwargs: Optional[dict[str, Any]] = None,
    special_token_text: str = "text",
) -> Tokenized:
    """The rows (``{"input_ids", "labels"}``) of one normalised conversation or plain text row. `template_kwargs`:
    variables every rendering passes to the template (data.chat_template_kwargs, e.g. Qwen3's enable_thinking).
    `special_token_text`: "text" encodes a special token's text in the row's own strings as ordinary text, "token" as
    the token (data.special_token_text)."""
    if conv.get("text") is not None:
        return Tokenized([_tokenize_text(tokenizer, conv["text"])], "text")
    if multi_turn not in MULTI_TURN_POLICIES:
        raise ValueError(f"multi_turn must be one of {MULTI_TURN_POLICIES}, not {multi_turn!r}")
    if special_token_text not in SPECIAL_TOKEN_TEXT:
        raise ValueError(f"special_token_text must be one of {SPECIAL_TOKEN_TEXT}, not {special_token_text!r}")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"{where}: the tokenizer ({name}) has no chat template, so chat rows cannot be rendered; "
            "use a model whose tokenizer ships one (an instruct/chat model), pass --chat_template FILE|NAME, "
            'or give plain {"text": ...} rows'
        )
    if special_token_text == "token":
        return _tokenize_variants(tokenizer, conv, where, multi_turn, template_kwargs, None)
    messages, tools, shielded = shield_for_template(
        tokenizer, conv["messages"], conv.get("tools"), where, template_kwargs
    )
    if shielded is None:
        return _tokenize_variants(tokenizer, conv, where, multi_turn, template_kwargs, None)
    try:
        shielded_conv = {**conv, "messages": messages, "tools": tools}
        return _tokenize_variants(tokenizer, shielded_conv, where, multi_turn, template_kwargs, shielded)
    except DataError as error:  # it quotes the rendering: with the row's text as written
        raise DataError(shielded.readable(str(error))) from None


def _tokenize_variants(
    tokenizer: Any,
    conv: Conversation,
    where: str,
    multi_turn: str,
    template_kwargs: Optional[dict[str, Any]],
    shielded: Optional[Shield],
) -> Tokenized:
    """The conversation's rows, from the first form of it the template takes."""
    # Tool call arguments go to the template as a mapping (most write `arguments | tojson`). A template that
    # concatenates them as text (DeepSeek-V3.1) fails on a mapping, and one that prints the value (`| string`)
    # writes Python's repr: both get the JSON text instead, as the data wrote it.
    # A template that reads a message's content as OpenAI's list of parts (Gemma 3's first template takes the system
    # prompt as `messages[0]['content'][0]['text']`) fails on the string phalanx makes of it: when the template raised,
    # the conversation is rendered again with each non-assistant message's content as one text part. Where that fails
    # too, further on in the row (a tool message Gemma 3 has no role for), its error is the one to fix.
    # A template that reads a tool message's `name` (FunctionGemma's raises "Invalid tool response: 'name' must be
    # provided") fails on OpenAI's tool messages, which name only the call they answer (`tool_call_id`): when the
    # template raised, the conversation is rendered again with each such message named after that call's function.
    as_text = _with_text_arguments(conv)
    named = _with_tool_names(conv)
    variants = [(as_text, False, False), (conv, True, True), (as_text, True, True)]
    if named is not None:
        named_text = _with_text_arguments(named)
        variants += [(named, False, True), (named_text, False, True), (named, True, True), (named_text, True, True)]
    try:
        result, texts = _tokenize_chat(tokenizer, conv, where, multi_turn, template_kwargs, shield=shielded)
    except DataError as error:
        refusal = error
        for variant, parts, when_raised in variants:
            if variant is None or (when_raised and not isinstance(error, _TemplateRaised)):
                continue
            try:
                result, texts = _tokenize_chat(
                    tokenizer, variant, where, multi_turn, template_kwargs, parts, shield=shielded
                )
            except DataError as later:
                if when_raised and isinstance(later, _TemplateRaised) and later.messages > _refusal_at(refusal):
                    refusal = later
                continue
            if not (parts and any(PART_REPR in text for text in texts)):  # not the list printed as Python's repr
                return result
        raise refusal from None
    if as_text is not None and _writes_python_mappings(conv, texts):
        try:
            return _tokenize_chat(tokenizer, as_text, where, multi_turn, template_kwargs, shield=shielded)[0]
        except DataError:
            pass
    return result


def _tokenize_chat(
    tokenizer: Any,
    conv: Conversation,
    where: str,
    multi_turn: str,
    template_kwargs: Optional[dict[str, Any]],
    text_parts: bool = False,
    shield: Optional[Shield] = None,
) -> tuple[Tokenized, list[str]]:
    renderer = _Renderer(tokenizer, conv["messages"], conv.get("tools"), where, template_kwargs, text_parts)
    turns = [_locate_turn(renderer, i) for i, m in enumerate(conv["messages"]) if m["role"] == "assistant"]
    dropped = sum(_check_rendered(renderer, turn, where) for turn in turns)
    notes: list[str] = []
    if multi_turn in ("auto", "full"):
        full = renderer.prefix(len(conv["messages"]), False)
        spans, problem = _locate_in_full(renderer, full, turns)
        if spans is not None:
            full, spans = _close_last(full, spans, turns, len(conv["messages"]))
            # A turn is terminated when the template ends it, or when the next message's close (the end-of-sequence
            # token it writes first) follows it in the whole rendering and is trained with it.
            unterminated = sum(t.unmarked and e - s == t.end - t.start for t, (s, e) in zip(turns, spans))
            return Tokenized(
                [_tokenize_spans(tokenizer, full, spans, shield, where)],
                "full",
                dropped,
                _system_dropped(conv["messages"], [full]),
                _tools_dropped(conv.get("tools"), [full]),
                unterminated,
                **_end_markers(renderer, turns),
                special_texts=dict(shield.counts) if shield else {},
            ), [full]
        if multi_turn == "full":
            raise DataError(
                f"{where}: multi_turn 'full': {problem}. The template rewrites earlier turns once later ones "
                "exist, so the whole conversation's rendering does not hold what the model wrote then. Use "
                "multi_turn 'per_turn' (one row per assistant turn, each rendered as the model saw it) or 'auto'."
            )
        notes.append(problem)
    examples = [
        _tokenize_spans(tokenizer, text, [span], shield, where) for text, span in (turn.example() for turn in turns)
    ]
    views = [turn.view for turn in turns]
    return Tokenized(
        examples,
        "per_turn",
        dropped,
        _system_dropped(conv["messages"], views),
        _tools_dropped(conv.get("tools"), views),
        sum(turn.unmarked and not turn.close for turn in turns),
        notes,
        **_end_markers(renderer, turns),
        special_texts=dict(shield.counts) if shield else {},
    ), views


def _end_markers(r: _Renderer, turns: list[_Turn]) -> dict[str, dict[str, int]]:
    """The marker that ends each trained turn that trains no end-of-sequence token, counted (marker -> turns) in one of
    two: where it is no token of this tokenizer (the template was written for another tokenizer, and the model is
    taught to end its answers with text that generation does not stop on: Tokenized.foreign_end_markers), and where it
    is a token (Tokenized.end_tokens: a stop only if the model's generation config lists it). As Tokenized's keywords."""
    eos = getattr(r.tokenizer, "eos_token", None)
    tokens = set(r.specials())
    foreign: dict[str, int] = {}
    ended_by: dict[str, int] = {}
    for turn in turns:
        if turn.close or (eos and eos in turn.output):
            continue
        markers = MARKER.findall(turn.view[turn.own_end : turn.end])
        if markers:
            counts = ended_by if markers[-1] in tokens else foreign
            counts[markers[-1]] = counts.get(markers[-1], 0) + 1
    return {"foreign_end_markers": foreign, "end_tokens": ended_by}


def _with_text_arguments(conv: Conversation) -> Optional[Conversation]:
    """The conversation with every tool call's arguments as JSON text; None when it has no tool call."""
    if not any(m.get("tool_calls") for m in conv["messages"]):
        return None
    messages = copy.deepcopy(conv["messages"])
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    return {**conv, "messages": messages}


def _refusal_at(error: DataError) -> int:
    """How many messages the rendering the template raised on held (0 for another refusal)."""
    return error.messages if isinstance(error, _TemplateRaised) else 0


def _with_tool_names(conv: Conversation) -> Optional[Conversation]:
    """The conversation with each tool message that has no `name` named after the function of the call its
    `tool_call_id` answers (an earlier assistant message's); None when no such message can be named."""
    names: dict[str, str] = {}
    messages = copy.deepcopy(conv["messages"])
    named = False
    for message in messages:
        for call in message.get("tool_calls") or []:
            if call.get("id"):
                names[str(call["id"])] = call["function"]["name"]
        if message["role"] == "tool" and not message.get("name") and message.get("tool_call_id") in names:
            message["name"] = names[message["tool_call_id"]]
            named = True
    return {**conv, "messages": messages} if named else None


def as_text_parts(messages: list[dict]) -> list[dict]:
    """The messages with each system, user and tool message's string content as one text part (`[{"type": "text",
    "text": ...}]`, as OpenAI's API takes it too). Assistant messages keep their string: the turn is located by
    replacing its text, and a template that reads parts there reads them for the others too. An empty one (a tool
    call's) becomes one empty part: Command A Reasoning's template reads `content[0].thinking` of every assistant
    message, which a string has unless it is empty."""
    return [
        {**m, "content": [{"type": "text", "text": m["content"]}]}
        if isinstance(m.get("content"), str) and (m.get("role") != "assistant" or not m["content"])
        else m
        for m in messages
    ]


# How a template that prints a message's content as it is writes a list of text parts: then it did not want parts.
PART_REPR = "{'type': 'text', 'text': "


def _writes_python_mappings(conv: Conversation, texts: list[str]) -> bool:
    calls = [c["function"]["arguments"] for m in conv["messages"] for c in m.get("tool_calls") or []]
    return any(args and isinstance(args, dict) and any(repr(args) in text for text in texts) for args in calls)


# ---------------------------------------------------------------------------- rendering


def template_refused(where: str, subject: str, messages: list[dict], error: Exception, template: str = "") -> DataError:
    """The error for a row a chat template raises on (a role it lacks, the order of roles, a missing field): the
    template's own message, and what to do. For training rows and generation prompts alike; `template`: its text (to
    tell a variable it expects from its caller from a function it lacks)."""
    variable = unset_template_variable(error, template)
    if variable:  # not the row's fault either: no row renders until it is given
        return DataError(
            f"{where}: the chat template reads the variable '{variable}', which nothing sets ({error}): it expects it "
            "from whoever renders it (transformers passes the messages, tools, add_generation_prompt and the "
            "tokenizer's special tokens, phalanx data.chat_template_kwargs too), so no row renders without it. Give "
            f"it with data.chat_template_kwargs (--chat_template_kwargs '{{{variable}: ...}}'; what it holds is the "
            "template's to say: see the model's card), or use a template that does not need it (--chat_template FILE)"
        )
    token = unset_special_token(error)
    if token:  # not the row's fault: no row renders with this tokenizer
        return DataError(
            f"{where}: the chat template reads {token}, which this tokenizer does not have (transformers "
            f"hands a template the tokenizer's special tokens; its error: {error}), so no row renders. The template was "
            f"written for a tokenizer with a {token}: use the tokenizer of the model it belongs to (--model_name), a "
            "template written for this one (--chat_template FILE|NAME), or give its text with data.chat_template_kwargs "
            f"(--chat_template_kwargs '{{{token}: \"...\"}}', as the model's card writes it; this tokenizer then "
            "writes it as ordinary text)"
        )
    import jinja2

    said = str(error).rstrip(".")  # the sentence goes on: "...message.." read as a typo
    if isinstance(error, jinja2.TemplateSyntaxError):  # it does not compile: no row renders, whatever it holds
        line = f"line {error.lineno}: " if error.lineno else ""
        return DataError(
            f"{where}: the chat template is not valid jinja ({line}{said}), so no row "
            "renders: the fault is in the template's text, not in the row. Fix the template (the tokenizer's "
            "chat_template, or the file given), or use one that compiles (--chat_template FILE|NAME)"
        )
    return DataError(
        f"{where}: the chat template failed on {subject} "
        f"(roles: {', '.join(m['role'] for m in messages) or 'none'}): {type(error).__name__}: {said}. The template "
        "does not take the row as it is: change the row to what it accepts (its error says what: a role it "
        "lacks, the order of roles, a missing field) or use a template that takes it (--chat_template FILE|NAME)"
    )


# A template's test for tools that transformers passes whether or not the row has any (tools=None is defined).
DEFINED_TOOLS = re.compile(r"\btools\s+is\s+defined\b")


class _TemplateRaised(DataError):
    """The template raised on a rendering of the row's first `messages` messages (its own error, said as
    template_refused says it)."""

    def __init__(self, message: str, messages: int) -> None:
        super().__init__(message)
        self.messages = messages


class _Renderer:
    """Renders variations of one conversation with the tokenizer's template; prefixes are cached."""

    def __init__(
        self,
        tokenizer: Any,
        messages: list[dict],
        tools: Optional[list[dict]],
        where: str,
        template_kwargs: Optional[dict[str, Any]] = None,
        text_parts: bool = False,
    ) -> None:
        self.tokenizer, self.messages, self.tools, self.where = tokenizer, messages, tools, where
        self.template_kwargs = template_kwargs or {}
        self.text_parts = text_parts  # every rendering gives the template non-assistant contents as text parts
        self._prefixes: dict[tuple[int, bool], str] = {}
        self._specials: Optional[list[str]] = None
        self._canonical: Optional[tuple[str, str]] = None
        self._turn_header: Optional[str] = None

    def prefix(self, n: int, generation_prompt: bool) -> str:
        key = (n, generation_prompt)
        if key not in self._prefixes:
            self._prefixes[key] = self.render(self.messages[:n], generation_prompt)
        return self._prefixes[key]

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self._apply(messages, generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception, jinja) are the row's problem
            template = template_text(getattr(self.tokenizer, "chat_template", None))
            gap = None if unset_template_variable(e, template) else sandbox_gap(e)
            if gap:
                raise self._sandbox_refusal(messages, gap) from None
            if self.tools and self._renders_with_empty_tools(messages, generation_prompt):
                raise DataError(
                    f"{self.where}: {template_name(self.tokenizer)} fails on the row's tools ({type(e).__name__}: {e}) "
                    "and renders the same messages without them: it reads something of the tools that the row's "
                    "lack (its error names it: Command R+'s tool_use template writes each parameter's description), or "
                    "reads them in another shape (phalanx hands them over as the row has them). Give the row's "
                    '"tools" what the template reads, or use a template that takes them as they are '
                    "(--chat_template FILE|NAME)."
                ) from None
            if not self.tools and self._renders_with_empty_tools(messages, generation_prompt):
                failed = f"{template_name(self.tokenizer)} fails on a row without tools ({type(e).__name__}: {e})"
                if DEFINED_TOOLS.search(template):  # llama.cpp's Phi-4-mini template: not one for tool rows only
                    raise DataError(
                        f"{self.where}: {failed} and renders the same messages once tools are given: it tests `tools is "
                        "defined`, which transformers makes true for every row (it passes tools=None to a row without "
                        "them), and then reads the None as a list of tools. It was written for a renderer that leaves "
                        "tools undefined (llama.cpp's), not for transformers: use a template written for transformers "
                        '(the model\'s own: --chat_template FILE|NAME), or give every row a "tools" list.'
                    ) from None
                raise DataError(
                    f"{self.where}: {failed} and renders the same messages once tools are given: it is written for "
                    'conversations with tools (a "tool_use" template: Hermes\', Command R+\'s). Give the row its "tools" '
                    "list, or use the model's template for conversations without tools (--chat_template FILE|NAME)."
                ) from None
            refusal = template_refused(self.where, f"messages[:{len(messages)}]", messages, e, template)
            raise _TemplateRaised(str(refusal), len(messages)) from None

    def _renders_with_empty_tools(self, messages: list[dict], generation_prompt: bool) -> bool:
        """Whether the template renders `messages` given an empty list of tools: then the row's tools are what it fails
        on, in a shape it does not read, or their absence: one that loops over `tools` fails on the None a row without
        tools passes (Hermes' and Command R+'s tool_use templates)."""
        try:
            self.tokenizer.apply_chat_template(
                as_text_parts(messages) if self.text_parts else messages,
                tools=[],
                add_generation_prompt=generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            )
        except Exception:  # noqa: BLE001 - then the tools are not what it lacks
            return False
        return True

    def _sandbox_refusal(self, messages: list[dict], gap: str) -> DataError:
        """The error for a rendering that needs what transformers' sandbox lacks: the template as a whole when a plain
        exchange fails too (no row renders), else this row, which takes a path through the template that others do not
        (Hunyuan-A13B calls dict.update only when the first message is empty; Kimi K2 Thinking list.append only for
        tool calls): then the row, not the template, is what to change."""
        template = template_name(self.tokenizer)
        plain = [{"role": "user", "content": SENTINEL}, {"role": "assistant", "content": SENTINEL}]
        try:
            self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=False, tokenize=False, **self.template_kwargs
            )
        except Exception:  # noqa: BLE001 - whatever fails here, the row cannot tell the template apart from itself
            return DataError(
                f"{self.where}: {template} cannot be rendered by transformers: {gap} ({SANDBOX}). Use a template "
                "written for transformers (--chat_template FILE)."
            )
        if self.tools and self._renders_with_empty_tools(messages, False):
            # llama.cpp's DeepSeek-R1 template writes `tools | map(...) | tojson` only when there are tools: the messages
            # were blamed, though each renders without the tools.
            return DataError(
                f"{self.where}: {template} fails on the row's tools: {gap} ({SANDBOX}). It renders the same messages "
                "without them, so the step it cannot take is on the path it takes for tools: use a template that "
                "renders tools in transformers (--chat_template FILE), or leave the tools out of these rows."
            )
        # The first message whose rendering fails is the one that takes that path.
        k = next((n for n in range(1, len(messages)) if self.try_render(messages[:n], False) is None), len(messages))
        return DataError(
            f"{self.where}: {template} fails on messages[{k - 1}] ({messages[k - 1]['role']}; roles so far: "
            f"{', '.join(m['role'] for m in messages[:k])}): {gap} ({SANDBOX}). It renders a plain user and assistant "
            "exchange, so the step it cannot take is on a path only some rows take (something this message has: empty "
            "content, a tool call, a role or field, or the row's tools): change the row to avoid it, or use a template "
            "that does not need it there (--chat_template FILE)."
        )

    def try_render(self, messages: list[dict], generation_prompt: bool) -> Optional[str]:
        """A probe rendering; None when the template refuses it (the caller then cannot be certain)."""
        try:
            return self._apply(messages, generation_prompt)
        except Exception:  # noqa: BLE001
            return None

    def _apply(self, messages: list[dict], generation_prompt: bool) -> str:
        if not messages:
            return self._empty(generation_prompt)
        if self.text_parts:
            messages = as_text_parts(messages)
        out = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False, **self.template_kwargs
        )
        return out if isinstance(out, str) else out[0]  # some versions hand back a list for batched input

    def _empty(self, generation_prompt: bool) -> str:
        """The empty conversation, the context of an assistant message that opens one (a greeting before the user's
        first message): transformers' apply_chat_template refuses to render it, so the template renders it here as
        apply_chat_template would (the tokenizer's special tokens, the tools and data.chat_template_kwargs)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = self.tokenizer.get_chat_template(None, self.tools)
        variables = {**getattr(self.tokenizer, "special_tokens_map", {}), **self.template_kwargs}
        rendered, _ = render_jinja_template(
            conversations=[[]],
            tools=self.tools,
            chat_template=template,
            add_generation_prompt=generation_prompt,
            **variables,
        )
        return rendered[0]

    def canonical_contexts(self) -> tuple[str, str]:
        """A one-user-message conversation rendered without and with a generation prompt."""
        if self._canonical is None:
            user = [{"role": "user", "content": SENTINEL}]
            without, with_prompt = self.try_render(user, False), self.try_render(user, True)
            self._canonical = (without, with_prompt) if without is not None and with_prompt is not None else ("", "")
        return self._canonical

    def assistant_header(self) -> str:
        """What the generation prompt adds after a user message ('' when the template cannot say)."""
        without, with_prompt = self.canonical_contexts()
        return with_prompt[_common_prefix(without, with_prompt) :]

    def turn_header(self) -> str:
        """The part of assistant_header() that a finished assistant turn writes too, before its text (Apriel 1.6's
        prompt adds 'Here are my reasoning steps:\\n' after `<|begin_assistant|>\\n`, which no finished turn writes)."""
        if self._turn_header is None:
            header = self.assistant_header()
            _, with_prompt = self.canonical_contexts()
            user = {"role": "user", "content": SENTINEL}
            turn = self.try_render([user, {"role": "assistant", "content": SENTINEL}], False)
            if header and turn is not None:
                shared = _snap_back(turn, _common_prefix(with_prompt, turn), self.specials())
                header = header[: max(0, shared - (len(with_prompt) - len(header)))]
            self._turn_header = header
        return self._turn_header

    def turn_lead(self) -> str:
        """What a finished assistant turn writes before its text after a user message, beyond what the conversation
        ending with that user message writes after it ('' when the template cannot say)."""
        user = {"role": "user", "content": SENTINEL}
        second = SENTINEL.replace("sentinel", "sentinel-2")
        context, _ = self.canonical_contexts()
        turn = self.try_render([user, {"role": "assistant", "content": second}], False)
        if not context or turn is None or turn.count(second) != 1 or SENTINEL not in context:
            return ""
        before = turn[: turn.index(second)]
        after_user, ends = (
            before[before.rindex(SENTINEL) + len(SENTINEL) :],
            context[context.rindex(SENTINEL) + len(SENTINEL) :],
        )
        return after_user[len(ends) :] if after_user.startswith(ends) else ""

    def specials(self) -> list[str]:
        """The tokenizer's special and added tokens longer than one character (a position inside one snaps)."""
        if self._specials is None:
            added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            names = {str(t) for t in getattr(self.tokenizer, "all_special_tokens", [])}
            names |= {getattr(t, "content", str(t)) for t in added.values()}
            self._specials = sorted((s for s in names if len(s) > 1), key=len, reverse=True)
        return self._specials


def template_name(tokenizer: Any) -> str:
    """The chat template a tokenizer carries, named for messages: the --chat_template value it was loaded with
    (phalanx.models.load records it), else its model's."""
    source = getattr(tokenizer, "chat_template_source", None)
    if source:
        return f"the chat template {source!r} (data.chat_template)"
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"


def _locate_turn(r: _Renderer, i: int) -> _Turn:
    """Where assistant message i's output lies in its turn view (see the module docstring)."""
    unrendered = _empty_context_error(r) if i == 0 else None
    if unrendered is None:
        context = r.prefix(i, False)
        prompt = _from_context(r.prefix(i, True), context)
    else:  # the template's own refusal of the row comes first (Mistral's alternation check, Hermes' tools)
        r.prefix(len(r.messages), False)
        context = prompt = ""
    view = _opening_view(r) if i == 0 else r.prefix(i + 1, False)
    probe = r.try_render(r.messages[:i] + [{"role": "assistant", "content": SENTINEL}], False)
    if probe is None:
        raise DataError(
            f"{r.where}: messages[{i}] (assistant): the chat template fails on a plain assistant message "
            "in its place, so where the message's own text starts cannot be located"
        )
    own = _common_prefix(view, probe)  # first character the message decides
    own_end = len(view) - _common_suffix(view, probe, len(view) - own)  # and its last
    # Where the turn's end marker shares its tail with a plain message's (functionary v3.1 ends a tool call with
    # <|eom_id|>, an answer with <|eot_id|>), the renderings part inside it: the marker is the template's, not text.
    own_end = max(own, _snap_back(view, own_end, r.specials()))
    # The same message with only its text replaced keeps what the template writes around reasoning and tool calls
    # (reasoning given in content as a <think> block too): where that probe parts from the view is where the
    # message's own words start.
    shaped = r.try_render(r.messages[:i] + [_sentinel_like(r.messages[i], keep_reasoning=True)], False)
    words = _common_prefix(view, shaped) if shaped is not None else own
    start = _output_start(r, i, prompt, context, view, own, words)
    if unrendered is not None:
        _check_opening_header(r, view, start, unrendered)
    end = _output_end(r, i, prompt, context, view, own_end)
    _check_no_end_of_sequence_inside(r, i, view, start, end)
    eos = getattr(r.tokenizer, "eos_token", None)
    text = view[start:end].rstrip()
    if end == own_end and eos and text.endswith(eos) and len(text) > len(eos):
        # The probe, a plain message, may end without the end-of-sequence token this turn writes (Hunyuan 3 closes a
        # tool call with it always, an answer only once a message follows): the token is a stop, not the message's.
        own_end = start + len(text) - len(eos)
    if end == own_end:
        own_end = _tool_result_opened(r, i, view, start, end)
    tail = view[own_end:end]
    unmarked = not tail.strip() and not (eos and not eos.strip() and eos in tail)
    return _Turn(i, view, start, end, own_end, _closed_by_next(r, i, view, end) if end == own_end else "", unmarked)


def _opening_view(r: _Renderer) -> str:
    """The turn view of an assistant message that opens the conversation: the message alone. A template may take the
    whole row but not that (Qwen3.5's raises 'No user query found in messages' on a conversation without a user
    message); the row was then refused as one the template does not take, quoting an error the row does not have."""
    try:
        return r.prefix(1, False)
    except _TemplateRaised:
        if len(r.messages) < 2 or r.try_render(r.messages, False) is None:
            raise
        try:
            r._apply(r.messages[:1], False)
        except Exception as e:  # noqa: BLE001 - the template's own error, said in the refusal
            error = f"{type(e).__name__}: {str(e).rstrip('.')}"
        else:  # pragma: no cover - it failed a moment ago
            raise
        raise _TemplateRaised(
            f"{r.where}: messages[0] (assistant): the conversation opens with an assistant message, and the chat "
            f"template renders the whole row but not that message alone ({error}): the conversation as it stood when "
            "the message was written, which phalanx renders to find what the model wrote, so where that turn ends "
            "cannot be located. Start the row with the user (or system) message the assistant answers, or leave the "
            "opening assistant message out.",
            1,
        ) from None


def _empty_context_error(r: _Renderer) -> Optional[Exception]:
    """Why the template cannot render the empty conversation, the context of an assistant message that opens one (a
    greeting before the user's first message), or None when it can. Many cannot: they read messages[0] to look for a
    system message (Qwen's, Llama's)."""
    for generation_prompt in (False, True):
        try:
            r._empty(generation_prompt)
        except Exception as e:  # noqa: BLE001 - whatever it raises, that context is unknown
            return e
    return None


def _check_opening_header(r: _Renderer, view: str, start: int, error: Exception) -> None:
    """An opening assistant message whose context the template cannot render starts after the header its generation
    prompt writes after a user message (Qwen writes its default system prompt, then `<|im_start|>assistant\n`);
    without that header right before its output, where the turn starts cannot be located, and it is refused naming
    the message (it was refused as a template failure at messages[:0])."""
    for header in (r.assistant_header(), r.turn_header()):
        if header.strip() and view.endswith(header, 0, start):
            return
    raise DataError(
        f"{r.where}: messages[0] (assistant): the conversation opens with an assistant message, and the chat template "
        f"cannot render the empty conversation before it ({type(error).__name__}: {error}) nor writes the assistant "
        "header of its generation prompt right before the message's text, so where that turn starts cannot be "
        "located. Start the row with the user (or system) message the assistant answers, or leave the opening "
        "assistant message out."
    )


def _from_context(prompt: str, context: str) -> str:
    """The generation prompt from where it writes the context on: Muse Glimmer (vLLM's template) writes a default
    system message before the whole conversation only with add_generation_prompt (or tools), so the prompt holds the
    context after text of its own, and what follows the context is its header. Compared from the first character, the
    two parted at the system message and every row without one was refused."""
    if not context or prompt.startswith(context):
        return prompt
    at = prompt.find(context)
    return prompt[at:] if at > 0 else prompt


def _closed_by_next(r: _Renderer, i: int, view: str, end: int) -> str:
    """The end-of-sequence token (with any blank space before it) that the next message writes first, right after
    a turn the template ends with nothing of its own, or "".

    Apertus closes an assistant turn only once a user message follows: that message opens with `<|assistant_end|>`,
    the model's end-of-sequence token, before its own `<|user_start|>`. The model stops by writing it, so it is the
    turn's output: trained in the whole rendering, and added to the turn's per_turn row (whose view ends before it).
    A conversation's last message is followed by a probe user message instead, and its close is added after it in the
    whole rendering as in its per_turn row: a single-turn row is all last message (Hunyuan 3, too, writes its
    end-of-sequence token after an answer only once a message follows, unless its own `is_training` is set).
    """
    eos = getattr(r.tokenizer, "eos_token", None)
    if not eos:
        return ""
    after = r.messages[i + 1 : i + 2] or [{"role": "user", "content": SENTINEL}]
    try:
        following = (
            r.prefix(i + 2, False) if i + 1 < len(r.messages) else r.try_render(r.messages[: i + 1] + after, False)
        )
    except DataError:
        return ""
    close = _close_after(following, view[:end], eos)
    bare = _without_reasoning(r.messages[i])
    if close or following is None or bare == r.messages[i]:
        return close
    # The message that follows may rewrite this turn: Hunyuan 3 drops an answer's reasoning once a message follows it
    # (its is_training keeps both). When the turn then renders exactly as the same message without its reasoning,
    # that message's close, found the same way, is this turn's.
    bare_view = r.try_render(r.messages[:i] + [bare], False)
    if bare_view is None or r.try_render(r.messages[:i] + [bare] + after, False) != following:
        return ""
    trailer = view[end:]
    if not bare_view.endswith(trailer):
        return ""
    return _close_after(following, bare_view[: len(bare_view) - len(trailer)], eos)


def _close_after(following: Optional[str], turn: str, eos: str) -> str:
    """The end-of-sequence token (with any blank space before it) that `following` writes right after `turn`, or ""."""
    if following is None or not following.startswith(turn):
        return ""
    rest = following[len(turn) :]
    blank = len(rest) - len(rest.lstrip())
    return rest[: blank + len(eos)] if rest.startswith(eos, blank) else ""


def _without_reasoning(message: dict) -> dict:
    """The message without its reasoning (the keys, and a `<think>...</think>` block opening its content)."""
    bare = {k: v for k, v in message.items() if k not in REASONING_KEYS}
    block, answer = _think_block(bare.get("content") or "")
    if block:
        bare["content"] = answer
    return bare


def _tool_result_opened(r: _Renderer, i: int, view: str, start: int, end: int) -> int:
    """Where a tool-calling turn that ends unlike a plain one starts to open the tool result, or `end`.

    Gemma 4 ends a last tool call with `<|tool_response>`, the token its model stops at (the caller writes the result
    after it), where a plain turn ends `<turn|>`. That this opens a tool result, unlike the closing of the calls
    (GLM's `</tool_call>`, Apriel's `]</tool_calls>`, after which the model writes a stop of its own), shows in the
    template: the turn ends with tokens that it writes before every tool result (found as the text that precedes both
    of two results rendered after the turn)."""
    call = (r.messages[i].get("tool_calls") or [None])[-1]
    if call is None or not getattr(r.tokenizer, "is_fast", False):
        return end
    first, second = SENTINEL, SENTINEL.replace("sentinel", "sentinel-2")
    results = [
        {"role": "tool", "content": text, "name": call["function"]["name"]}
        | ({"tool_call_id": call["id"]} if call.get("id") is not None else {})
        for text in (first, second)
    ]
    two = r.try_render(r.messages[: i + 1] + results, False)
    if two is None or two.count(first) != 1 or two.count(second) != 1:
        return end
    before_first, before_second = two[: two.index(first)], two[: two.index(second)]
    opening = before_second[len(before_second) - _common_suffix(before_first, before_second, len(before_first)) :]
    opening_ids = r.tokenizer(opening, add_special_tokens=False)["input_ids"]
    enc = r.tokenizer(view[:end], add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets, found = enc["input_ids"], enc["offset_mapping"], end
    for k in range(len(ids) - 1, -1, -1):
        if offsets[k][0] < start or not _contains(opening_ids, ids[k:]):
            break
        if view[offsets[k][0] : end].strip():
            found = offsets[k][0]
    return found


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[j : j + len(part)] == part for j in range(len(seq) - len(part) + 1))


def _check_no_end_of_sequence_inside(r: _Renderer, i: int, view: str, start: int, end: int) -> None:
    """A model stops at its end-of-sequence token: a turn that holds one before its end could never be generated
    (Nemotron writes content and tool calls as two assistant blocks, each closed by it)."""
    eos = getattr(r.tokenizer, "eos_token", None)
    at = view.find(eos, start, end) if eos else -1
    if at >= 0 and view[at + len(eos) : end].strip():
        written = _texts_holding(r.messages[i], eos)
        if written:  # the row's own text holds the token, not the template's markup
            raise DataError(
                f"{r.where}: messages[{i}] (assistant): its {' and '.join(written)} holds the text of the "
                f"end-of-sequence token {eos!r}, which the tokenizer reads as that token (data.special_token_text is "
                "'token'): a model stops there and could never generate what follows it. Leave special_token_text at "
                "'text' (the row's words encoded as written), edit the row (remove or reword that text), or skip such "
                "rows (--on_bad_row skip)."
            )
        # Name the parts the message has: the template writes some of them as blocks of their own, each closed by the
        # token (Nemotron: content, then tool calls; Solar Open: reasoning, then the answer). "Split content and tool
        # calls" alone misled where the first block is the reasoning.
        message = r.messages[i]
        parts = [
            name
            for name, present in (
                ("reasoning", any(message.get(key) for key in REASONING_KEYS)),
                ("content", bool(message.get("content"))),
                ("tool calls", bool(message.get("tool_calls"))),
            )
            if present
        ]
        advice = (
            f"use another template (--chat_template), or, if the model does not stop at {eos!r}, give its tokenizer "
            "the end-of-sequence token it stops at."
        )
        if len(parts) > 1:  # only then are there blocks to give messages of their own
            advice = (
                f"it writes the message's {' and '.join(parts)} as blocks of their own, each closed by that token. "
                f"Give each part its own assistant message (or leave out the reasoning), {advice}"
            )
        raise DataError(
            f"{r.where}: messages[{i}] (assistant): the chat template writes the end-of-sequence token {eos!r} inside "
            f"this turn ({_short(view[start:end])}), so a model could never generate what follows it: {advice}"
        )


def _texts_holding(message: dict, token: str) -> list[str]:
    """Which of an assistant message's own texts (content, reasoning, tool-call names and arguments) hold `token`."""
    found = [key for key in ("content", "reasoning_content") if token in str(message.get(key) or "")]
    calls = message.get("tool_calls") or []
    if any(token in json.dumps(call, ensure_ascii=False) for call in calls):
        found.append("tool calls")
    return found


def _output_start(r: _Renderer, i: int, prompt: str, context: str, view: str, own: int, words: int) -> int:
    if view.startswith(prompt):
        # An answer may itself begin like the end of a pre-filling prompt ("<think>\n..."): it starts at its own words.
        start = min(len(prompt), words)
        # After an assistant message some templates write no generation prompt, and the turn writes its own header
        # (Apriel): the output starts after the header a generation prompt writes after a user message, or after the
        # part of it a finished turn writes when that prompt also pre-fills the answer (Apriel 1.6).
        # That header may begin with the closing of the message before it, which a prompt after an assistant message
        # writes already (Qwen1.5 closes a message with `<|im_end|>\n` only once one follows: its header after a user
        # message is `<|im_end|>\n<|im_start|>assistant\n`): a header that ends past the prompt counts.
        end = _header_end(view, r.assistant_header(), start, own)
        if end < 0 and r.turn_header().strip():
            end = _header_end(view, r.turn_header(), start, own)
        return end if end >= 0 else start
    shared = _common_prefix(prompt, view)
    if shared >= own:
        # The prompt covers the view up to the message's own text and pre-fills more (DeepSeek-R1-Distill's
        # "<think>\n", which the finished turn does not render): the output starts at the message's own text.
        return own
    # The context before the turn renders differently (Mistral writes the system prompt only into a last user
    # message, Hermes closes a last tool message differently, Kimi and gpt-oss drop an earlier turn's reasoning).
    # Certain only when the view leads into the message with the header the generation prompt writes: the output
    # starts after the last such header, and what the template writes between it and the message's text (an
    # empty think block, a channel name) is the model's to write.
    opens = _common_prefix(prompt, context)  # where the generation prompt starts adding to the context
    header = prompt[opens:]
    # The header may start before the part where the view and the prompt differ, as long as it reaches into it
    # (Bielik leaves a tool output unclosed before an assistant turn: `}<|im_start|>` vs the prompt's `}<|im_end|>`
    # part inside `<|im_`): any occurrence that ends in the shared part belongs to the context.
    at = view.rfind(header, max(0, shared - len(header) + 1), own) if header else own
    if at < 0:
        # The view renders the context as the prompt does and starts the turn with part of the prompt's header, then
        # writes something else where the prompt opens a reasoning block (the same message with reasoning renders
        # the whole prompt): GLM-4.7's prompt ends `<|assistant|><think>`, its turn without reasoning is
        # `<|assistant|></think>7`; Nemotron 3's prompt ends `<think>\n`, the turn `<think></think>7`. The output
        # starts where they part: the rest is what the model writes for a turn without reasoning.
        part = _snap_back(view, shared, r.specials())
        if opens < part <= own and _prompt_opens_reasoning(r, i, prompt):
            return part
        # Or the prompt writes other text there but ends with exactly what the view writes between that point and the
        # message's own text (DeepSeek-V3.2 without thinking: the prompt ends `<｜Assistant｜><think></think>`, a turn
        # is `<｜Assistant｜></think>7`): the message's text follows the same text in both, so the output starts at it.
        if opens < part < own and prompt[part:].endswith(view[part:own]):
            return own
        # Or the prompt's header pre-fills text no finished turn writes, after the part of it a finished turn writes
        # (`turn_header`), and the view parts from the prompt right after that part or inside it: the output starts
        # after it. Cohere2MoE's prompt pre-fills, after `<|CHATBOT_TOKEN|>`, an empty reasoning block
        # (`<|START_THINKING|><|END_THINKING|>`) with reasoning off, and `<|START_THINKING|>` with `skip_thinking`, where
        # no turn writes reasoning; the turn writes `<|START_TEXT|>` there. OLMo 3 Think ends a conversation's last
        # assistant message with its end-of-sequence token, an earlier one with `<|im_end|>\n`, and its prompt is
        # `<|im_start|>assistant\n<think>`: a second assistant message in a row opens with the part of the header a
        # finished turn writes, `<|im_start|>assistant\n`, whose end the context renders differently.
        # That part must be the assistant's own header, which the conversation before a turn does not write (ChatML's
        # `<|im_start|>` opens the user's message too: a prompt `<|im_start|>model\n` is not how `<|im_start|>assistant\n`
        # starts a turn).
        lead = r.turn_header()
        if lead.strip() and lead != header and header.startswith(lead) and lead not in r.canonical_contexts()[0]:
            at = view.rfind(lead, max(0, part - len(lead)), own)
            if at >= 0:
                return at + len(lead)
    if at < 0:
        raise DataError(
            f"{r.where}: messages[{i}] (assistant): the chat template's generation prompt (add_generation_prompt=True) "
            f"is not how it starts the assistant turn it then renders ({_divergence(prompt, view)}), so the start of "
            "the assistant's output cannot be located. Use a template whose generation prompt matches how it renders "
            "assistant turns (--chat_template)."
        )
    if header:
        return at + len(header)
    # A template with no generation prompt at all (not even after a user message): the output is everything the turn
    # writes before the message's text too (Mistral's " " before an answer), as when the view starts with the prompt.
    lead = "" if r.assistant_header() else r.turn_lead()
    return own - len(lead) if lead and view.endswith(lead, 0, own) else own


def _header_end(view: str, header: str, start: int, own: int) -> int:
    """The end of the last `header` in the view that ends past `start` and no later than `own` (it may begin before
    `start`), or -1."""
    if not header or own <= start:
        return -1
    at = view.rfind(header, max(0, start - len(header) + 1), own)
    return at + len(header) if at >= 0 else -1


def _prompt_opens_reasoning(r: _Renderer, i: int, prompt: str) -> bool:
    """Whether message i, given reasoning, renders everything the generation prompt writes (then what the prompt adds
    past the message's own rendering opens the reasoning block)."""
    probe = dict(r.messages[i], reasoning_content=SENTINEL)
    rendered = r.try_render(r.messages[:i] + [probe], False)
    return rendered is not None and rendered.startswith(prompt)


def _output_end(r: _Renderer, i: int, prompt: str, context: str, view: str, own_end: int) -> int:
    """The view less the trailer a template writes after whatever message ends a conversation (Phi-3.5's final
    <|endoftext|>: the context rendered without and with a generation prompt part there), checked against the
    view followed by a user message, which must part from it where that trailer starts."""
    if (i > 0 and r.messages[i - 1]["role"] == "assistant") or (i == 0 and not context and not prompt):
        # A generation prompt after an assistant message may rewrite it (gpt-oss ends a final answer differently):
        # the trailer comes from a conversation that ends with a user message instead; so it does for an opening
        # assistant message whose (empty) context the template cannot render.
        context, prompt = r.canonical_contexts()
        prompt = _from_context(prompt, context)
    trailer = context[_snap_back(context, _common_prefix(context, prompt), r.specials()) :]
    if not view.endswith(trailer) or len(view) - len(trailer) < own_end:
        raise DataError(
            f"{r.where}: messages[{i}] (assistant): the chat template ends a conversation with {trailer!r} after a user "
            f"message but not after this assistant turn ({_short(view[-80:])}), so where the turn ends cannot be located."
        )
    end = len(view) - len(trailer)
    followed = r.try_render(r.messages[: i + 1] + [{"role": "user", "content": SENTINEL}], False)
    if followed is None:
        return end
    part = _snap_back(view, _common_prefix(view, followed), r.specials())
    if part < own_end and _instruction_after(r, view, own_end, end, followed):
        raise DataError(
            f"{r.where}: messages[{i}] (assistant): where this turn ends is ambiguous: the template writes "
            f"{_short(view[own_end:end])} after the message's text when it ends the conversation, text that a following "
            "message's rendering does not keep after it: an instruction written after whatever message ends a "
            "conversation, even without add_generation_prompt (a guard model's template, ShieldGemma's, frames the "
            "last messages as a question for the model to answer), so it is no part of the assistant's output and "
            "the turn cannot be masked with certainty. Use the chat template of a model that writes the assistant's "
            "turns (--chat_template)."
        )
    if part < own_end or part == end:
        return end  # the following message rewrites this turn (Qwen3, Mistral): it cannot contradict, nor confirm
    if part < end and not followed.endswith(view[part:end] + trailer):
        return end  # text written only after a final assistant message is its own (gpt-oss's <|return|>)
    raise DataError(
        f"{r.where}: messages[{i}] (assistant): where this turn ends is ambiguous: the template writes "
        f"{view[own_end:]!r} after the message's text when it ends the conversation, and a following message's "
        f"rendering keeps only {view[own_end:part]!r} of that ({_divergence(view, followed)}): the template writes "
        "text after whatever message ends a conversation even without add_generation_prompt (the next header, or an "
        "instruction turn as Command R's tool-use templates do), so it cannot be masked with certainty. Use a "
        "template that honours add_generation_prompt (--chat_template)."
    )


def _instruction_after(r: _Renderer, view: str, own_end: int, end: int, followed: str) -> bool:
    """Whether a turn ends with words (not only markers and blank space) that the rendering with a message after it
    does not write after the message's text. A following message that rewrites the turn (Qwen3 drops reasoning)
    still closes it as before; ShieldGemma renders only the last two messages, framed by its policy question, so the
    question after an answer is gone once a message follows: it is the prompt's, not the turn's end."""
    tail = view[own_end:end]
    words = tail
    for token in r.specials():
        words = words.replace(token, "")
    if not MARKER.sub("", words).strip():
        return False
    return view[max(0, own_end - 1) : end] not in followed


def _locate_in_full(r: _Renderer, full: str, turns: list[_Turn]) -> tuple[Optional[list[tuple[int, int]]], str]:
    """Each turn's output span in the whole rendering, or None and why one cannot be found with certainty."""
    spans: list[tuple[int, int]] = []
    floor = 0  # spans are in order and do not overlap
    for turn in turns:
        if full.startswith(turn.view[: turn.end]):  # the same text up to the turn's end: the same place
            end = turn.end + (len(turn.close) if turn.close and full.startswith(turn.close, turn.end) else 0)
            spans.append((turn.start, end))
            floor = end
            continue
        out, i = turn.output, turn.index
        probe_messages = list(r.messages)
        probe_messages[i] = _sentinel_like(r.messages[i])
        probe = r.try_render(probe_messages, False)
        if probe is None:
            return None, f"messages[{i}] (assistant) cannot be located: the template fails once its text is replaced"
        lo = _common_prefix(full, probe)
        hi = len(full) - _common_suffix(full, probe, min(len(full), len(probe)) - lo)
        found = [x for x in _occurrences(full, out, floor) if x <= lo and x + len(out) >= hi]
        if len(found) != 1:
            view = turn.view[: turn.end]
            how = (
                f"its output is found {len(found)} times where the message is"
                if found
                else "it renders differently once later messages follow it"
            )
            return None, f"messages[{i}] (assistant): {how} ({_divergence(view, full)})"
        end = found[0] + len(out)
        end += len(turn.close) if turn.close and full.startswith(turn.close, end) else 0
        spans.append((found[0], end))
        floor = end
    return spans, ""


def _close_last(
    full: str, spans: list[tuple[int, int]], turns: list[_Turn], n_messages: int
) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering with the close of a last assistant message put after its output (only the template's
    trailer follows it there), as its per_turn row has it; unchanged when it has none."""
    if not turns or not turns[-1].close or turns[-1].index != n_messages - 1:
        return full, spans
    (start, end), close = spans[-1], turns[-1].close
    if full.startswith(close, end):
        return full, spans
    return full[:end] + close, spans[:-1] + [(start, end + len(close))]


def _sentinel_like(message: dict, keep_reasoning: bool = False) -> dict:
    """The message with its own text replaced by the sentinel, keeping its shape (content or tool calls). With
    `keep_reasoning`, its reasoning stays, given as a key or as a `<think>...</think>` block opening the content."""
    probe = copy.deepcopy(message)
    for key in () if keep_reasoning else REASONING_KEYS:
        probe.pop(key, None)
    content = message.get("content") or ""
    block, answer = _think_block(content) if keep_reasoning else ("", content)
    if answer.strip() or not message.get("tool_calls"):
        probe["content"] = block + SENTINEL
    elif block:
        probe["content"] = content  # reasoning and nothing else: the tool call's name is replaced instead
    for call in probe.get("tool_calls") or []:  # some templates ignore the content of a tool-calling message
        call["function"]["name"] = SENTINEL
    return probe


def _think_block(content: str) -> tuple[str, str]:
    """A content that opens with reasoning (`<think>...</think>`) split into that block, with the blank space after
    it, and the answer; ("", content) when it does not. The opening tag may be missing (DeepSeek-R1-style output
    saved as generated, after a prompt that pre-filled `<think>\n`: `reasoning</think>answer`), as templates that
    split content at `</think>` read it (GLM-4.7-Flash, Qwen3)."""
    if "</think>" not in content:
        return "", content
    if not content.lstrip().startswith("<think>") and "<think>" in content:
        return "", content
    cut = content.rindex("</think>") + len("</think>")
    rest = content[cut:]
    cut += len(rest) - len(rest.lstrip())
    return content[:cut], content[cut:]


# ---------------------------------------------------------------------------- checks


def _check_rendered(r: _Renderer, turn: _Turn, where: str) -> bool:
    """Refuse an assistant message whose text the template dropped; True if only its reasoning was dropped."""
    message, out, i = r.messages[turn.index], turn.output, turn.index
    content = message.get("content") or ""
    answer = content.split("</think>")[-1].strip()
    if answer and answer not in out:
        # It may render the start of the text and drop the rest (MiniCPM5's keeps the text before the first
        # `<tool_sep>`, meant to place a call there): the refusal says which part is missing, not that all of it is.
        kept = _longest_prefix_in(answer, out)
        what = (
            f"part of its content: it renders {_short(answer[:kept])} and drops what follows ({_short(answer[kept:])})"
            if any(c.isalnum() for c in answer[:kept])  # words of it, not a stray `<` the template writes too
            else f"its content ({_short(answer)})"
        )
        raise DataError(
            f"{where}: messages[{i}] (assistant): the chat template dropped {what}: "
            f"the rendered turn reads {_short(out)}. Use a template that renders it (--chat_template FILE|NAME)."
        )
    for j, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        missing = None if fn["name"] in out else f"name {fn['name']!r}"
        if missing is None:
            missing = next(
                (
                    f"argument {text!r}"
                    for text in _argument_texts(fn.get("arguments"))
                    if not any(form in out for form in _json_forms(text) + _python_forms(text))
                ),
                None,
            )
        if missing is not None:
            template = template_text(r.tokenizer.chat_template)
            hint = (
                " DeepSeek's templates of this family (R1-Distill's, V2.5's, V3's) render tool calls only when "
                'content is None (phalanx passes ""); for the R1-Distill models (Qwen 1.5B-32B, Llama-8B) a '
                "corrected copy ships as --chat_template deepseek-r1-distill (for another model, correct its template "
                "the same way)."
                if "<｜tool▁calls▁begin｜>" in template
                else ""
            )
            if "tool_calls" not in template:
                # Phi-3.5's, Gemma 2's, ERNIE 4.5's: no tool-call format at all, so no template fix can come from the row.
                hint += (
                    " This template never reads tool_calls: it has no way to write a call. Use the model's template "
                    "for tools if it has one, or write the call into the message's content as the model writes it "
                    "(its card says how), or leave tool-calling rows out (--on_bad_row skip)."
                )
            if fn["name"] not in out and _written_once_followed(r, i, j):
                hint += (
                    " The template writes it once another message follows: it renders the conversation's last "
                    "assistant message without its tool calls, so the turn as the model writes it cannot be rendered."
                )
            if j > 0:  # the calls before it passed this check
                hint += (
                    f" It writes the turn's first {j} call{'s' if j > 1 else ''}, not this one: it renders fewer calls "
                    "per assistant message than the row has (GigaChat 3 renders tool_calls[0] only). Give each call an "
                    "assistant message of its own, each followed by its tool result, or use a template that renders "
                    "parallel calls."
                )
            if call.get("id") and str(call["id"]) in out and fn["name"] not in out:
                hint += (
                    f" The template writes the call's id ({call['id']!r}) where the name belongs: it expects ids "
                    "that carry the name (Kimi's are functions.NAME:INDEX)."
                )
            raise DataError(
                f"{where}: messages[{i}].tool_calls[{j}]: the chat template dropped the tool call's {missing}: "
                f"the rendered turn reads {_short(out)}. Use a template that renders tool calls "
                f"(--chat_template FILE|NAME).{hint}"
            )
    if not out.strip() and not turn.close:
        # An empty message (content "", no tool calls) trains its stop where the template writes one; GLM-4-9B skips
        # the message and Seed-OSS writes its header only: the turn was left untrained without a word (a per_turn row
        # with no trained token, a full row without it).
        raise DataError(
            f"{where}: messages[{i}] (assistant): the chat template writes nothing for this turn (not even an "
            f"end-of-turn marker; its content is {_short(content)}{', with reasoning' if _reasoning(message) else ''}"
            "), so there is nothing to train it on. Give the message the text the model should write, leave it out "
            "(with the user message it answers), or use a template that writes an empty turn (--chat_template "
            "FILE|NAME)."
        )
    reasoning = message.get("reasoning_content")
    if reasoning is None and "</think>" in content:
        reasoning = content.split("</think>")[0].split("<think>")[-1]
    return bool(reasoning and reasoning.strip() and reasoning.strip() not in out)


def _longest_prefix_in(text: str, rendered: str) -> int:
    """The length of the longest start of `text` that `rendered` holds (a start it holds has every shorter one too)."""
    low, high = 0, len(text)
    while low < high:
        mid = (low + high + 1) // 2
        if text[:mid] in rendered:
            low = mid
        else:
            high = mid - 1
    return low


def _reasoning(message: dict) -> str:
    return next((message[key] for key in REASONING_KEYS if message.get(key)), "")


def _written_once_followed(r: _Renderer, i: int, j: int) -> bool:
    """Whether tool call j of message i, missing from its turn view, is written once the next message follows (vLLM's
    Nemotron JSON template writes a conversation's last assistant message apart, with its content only): its name,
    replaced by the sentinel, shows in that rendering."""
    if i + 1 >= len(r.messages):
        return False
    probe = copy.deepcopy(r.messages[i])
    probe["tool_calls"][j]["function"]["name"] = SENTINEL
    rendered = r.try_render(r.messages[:i] + [probe, r.messages[i + 1]], False)
    return rendered is not None and SENTINEL in rendered


def _system_dropped(messages: list[dict], texts: list[str]) -> bool:
    """True when a system prompt appears in none of the rows: the model would train without it."""
    for message in messages:
        prompt = (message.get("content") or "").strip() if message["role"] == "system" else ""
        if prompt and not any(prompt in text for text in texts):
            return True
    return False


def _tools_dropped(tools: Optional[list[dict]], texts: list[str]) -> bool:
    """True when a tool's schema (its description, else its parameters) appears in none of the rows."""
    for tool in tools or []:
        fn = tool.get("function", tool)
        mark = fn.get("description") or json.dumps(fn.get("parameters") or {})[1:-1] or ""
        if mark.strip() and not any(any(form in text for form in _json_forms(mark)) for text in texts):
            return True
    return False


def _argument_texts(arguments: Any) -> Iterator[str]:
    """Keys and scalar values of a tool call's arguments, as text."""
    if isinstance(arguments, dict):
        for key, value in arguments.items():
            yield str(key)
            yield from _argument_texts(value)
    elif isinstance(arguments, list):
        for value in arguments:
            yield from _argument_texts(value)
    elif isinstance(arguments, str):
        yield arguments
    else:  # a number, true/false or null; templates that print the mapping itself write Python's True/None
        yield json.dumps(arguments)


def _python_forms(text: str) -> tuple[str, ...]:
    return {"true": ("True",), "false": ("False",), "null": ("None",)}.get(text, ())


def _json_forms(text: str) -> tuple[str, ...]:
    """How a template may write a string: as it is, JSON-escaped, or JSON-escaped the HTML-safe way (jinja tojson)."""
    escaped = json.dumps(text)[1:-1]
    safe = escaped.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("'", "\\u0027")
    return text, escaped, safe, json.dumps(text, ensure_ascii=False)[1:-1]


# ---------------------------------------------------------------------------- tokens


def _tokenize_spans(
    tokenizer: Any, text: str, spans: list[tuple[int, int]], shield: Optional[Shield] = None, where: str = ""
) -> dict[str, list[int]]:
    """`text` (a rendering, of a shielded row when `shield` is given) as ids, labelled on the tokens in `spans`."""
    # add_special_tokens=False everywhere: templates write their own BOS; adding one would double it.
    spans = [s for s in spans if s[1] > s[0]]
    as_text: list[tuple[int, int]] = []
    if shield is not None:
        text, as_text = shield.restore(text, where)
    if getattr(tokenizer, "is_fast", False):
        # Tokenize the whole text as inference will, and keep each token that overlaps a span.
        ids, offsets = encode(tokenizer, text, as_text)
        labels, k = [], 0
        for token, (a, b) in zip(ids, offsets or []):
            while k < len(spans) and spans[k][1] <= a:  # spans are sorted and disjoint
                k += 1
            inside = k < len(spans) and spans[k][0] < max(b, a + 1)  # zero-width tokens count at their start
            labels.append(token if inside else IGNORE_INDEX)
        return {"input_ids": ids, "labels": labels}
    # Slow tokenizers have no offsets: tokenize segment by segment, so target tokens are exact.
    bounds = sorted({0, len(text), *(x for span in [*spans, *as_text] for x in span)})
    segments = [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)]
    literal = [any(s <= a and b <= e for s, e in as_text) for a, b in segments]
    plain = [text[a:b] for (a, b), lit in zip(segments, literal) if not lit]
    read = iter(tokenizer(plain, add_special_tokens=False)["input_ids"] if plain else [])
    ids, labels = [], []
    for (a, b), lit in zip(segments, literal):
        piece = as_text_ids(tokenizer, text[a:b]) if lit else next(read)
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


# ---------------------------------------------------------------------------- strings


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    n = 0
    limit = min(limit, len(a), len(b))
    while n < limit and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


# A template's markup, whether or not the tokenizer has it as one token: <|START_TEXT|>, <｜Assistant｜>, </think>,
# [TOOL_CALLS], [/INST]. Angle brackets hold no blank space or bracket; square ones hold capitals, `_` and a leading `/`.
MARKER = re.compile(r"<[^<>\s]{1,64}>|\[/?[A-Z][A-Z_]{1,31}\]")


def _snap_back(text: str, pos: int, specials: list[str]) -> int:
    """``pos``, or the start of a special token or marker that ``pos`` falls inside. Markers count with a tokenizer
    that lacks them too: Cohere's generation prompt ends `<|START_THINKING|>` where a finished turn writes
    `<|START_TEXT|>`, and without the marker snap the turn's output started at `EXT|>` (the model was taught to end a
    marker it never saw begin)."""
    best = pos
    for token in specials:
        for start in range(max(0, pos - len(token) + 1), pos):
            if text.startswith(token, start):
                best = min(best, start)
                break
    for marker in MARKER.finditer(text, max(0, pos - 65), pos + 65):
        if marker.start() < pos < marker.end():
            best = min(best, marker.start())
    return best


def _occurrences(text: str, part: str, start: int) -> Iterator[int]:
    if not part:
        return
    x = text.find(part, start)
    while x != -1:
        yield x
        x = text.find(part, x + 1)


def _divergence(a: str, b: str) -> str:
    n = _common_prefix(a, b)
    start = max(0, n - 20)
    return f"they part at character {n}: {a[start : n + 40]!r} vs {b[start : n + 40]!r}"


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
