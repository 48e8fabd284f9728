"""Real chat templates and the oracle the loss masker (phalanx.data.chat) is tested against.

The oracle is the template itself. Each real template has a copy here, ``<name>.marked.jinja``, that
renders byte for byte what the original renders but wraps, in ``{% generation %}...{% endgeneration %}``,
exactly the text the model must produce for each assistant turn: everything after the assistant header
(the header is what the generation prompt writes), i.e. rendered reasoning, content, tool calls and the
end-of-turn marker with the newline the template writes right after it inside the turn. transformers
records where each generation block lands in the rendered text (``render_jinja_template(...,
return_assistant_tokens_mask=True)``); without that flag the tags render their body and nothing else, so a
marked copy is the same template. A token is trained when its character span overlaps a block.

Policies: "full" is one example, the whole conversation rendered once, trained on every assistant turn;
"per_turn" is one example per assistant message i, ``messages[:i+1]`` rendered, trained on turn i only.

Where the six templates of ``../shared/templates/`` live: the ``shared`` folder beside the repository
root, or ``$PHALANX_SHARED_TEMPLATES``. They are never copied here; the extra templates in ``real/``
are stored byte for byte as published (see real/README.md).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

HERE = Path(__file__).resolve().parent
REAL = HERE / "real"
SHARED_ENV = "PHALANX_SHARED_TEMPLATES"
IGNORE_INDEX = -100  # what phalanx.data.chat uses; restated so the oracle imports nothing from phalanx


def shared_templates_dir() -> Path:
    env = os.environ.get(SHARED_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[3] / ".." / "shared" / "templates"


# ------------------------------------------------------------------------------------------ rows

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]
CALL_ID = "a1B2c3D4e"  # Mistral's templates require 9 alphanumeric characters


def _tool_call(reasoning: Optional[str] = None, think: Optional[str] = None) -> dict:
    # The OpenAI shape as users have it: content null, arguments a JSON string.
    m = {
        "role": "assistant",
        "content": None if think is None else f"<think>\n{think}\n</think>\n\n",
        "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


def _answer(text: str, reasoning: Optional[str] = None, think: Optional[str] = None) -> dict:
    m = {"role": "assistant", "content": text if think is None else f"<think>\n{think}\n</think>\n\n{text}"}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


def _tool_row(reasoning: bool = False, think: bool = False) -> dict:
    r = (lambda s: s) if reasoning else (lambda s: None)
    t = (lambda s: s) if think else (lambda s: None)
    return {
        "messages": [
            {"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "What is the weather in Paris?"},
            _tool_call(reasoning=r("I need the weather tool."), think=t("I need the weather tool.")),
            {
                "role": "tool",
                "tool_call_id": CALL_ID,
                "name": "get_weather",
                "content": '{"temp_c": 18, "sky": "clear"}',
            },
            _answer(
                "It is 18 °C and clear in Paris.", reasoning=r("The tool says 18 C."), think=t("The tool says 18 C.")
            ),
            {"role": "user", "content": "Thanks! And tomorrow?"},
            _answer("I can only see today's weather.", reasoning=r("No forecast tool."), think=t("No forecast tool.")),
        ],
        "tools": TOOLS,
    }


def _plain_row(system: bool = True, reasoning: bool = False, think: bool = False) -> dict:
    r = (lambda s: s) if reasoning else (lambda s: None)
    t = (lambda s: s) if think else (lambda s: None)
    messages = [{"role": "system", "content": "You are a concise assistant."}] if system else []
    messages += [
        {"role": "user", "content": "Name a prime number."},
        _answer("7", reasoning=r("Any prime will do."), think=t("Any prime will do.")),
        {"role": "user", "content": "And an even one?"},
        _answer(
            "2 is the only even prime.", reasoning=r("Even and prime: only 2."), think=t("Even and prime: only 2.")
        ),
        {"role": "user", "content": "Thanks."},
        # Leading spaces and a trailing newline: Llama and Gemma trim them, ChatML keeps them.
        _answer("  You're welcome!\n", reasoning=r("\nJust acknowledge.\n"), think=t("Just acknowledge.")),
    ]
    return {"messages": messages}


def _two_assistants_row() -> dict:
    # Two assistant messages in a row (an answer sent in two parts): templates that check the role alternation
    # raise on it; the others render the second as a turn of its own, with no user message before it.
    return {
        "messages": [
            {"role": "user", "content": "Tell me two facts."},
            {"role": "assistant", "content": "Fact one."},
            {"role": "assistant", "content": "Fact two."},
            {"role": "user", "content": "More?"},
            {"role": "assistant", "content": "No."},
        ]
    }


ROWS = {
    "tool": _tool_row(),
    "plain": _plain_row(),
    "nosys": _plain_row(system=False),
    "reasoning": _plain_row(reasoning=True),  # reasoning_content on every assistant message
    "reasoning_tool": _tool_row(reasoning=True),
    "think": _plain_row(think=True),  # the reasoning inside content, as <think>...</think>
    "think_tool": _tool_row(think=True),
    "two_assistants": _two_assistants_row(),
}


def row(kind: str) -> dict:
    """A fresh copy of a test row (raw, as users write it)."""
    return json.loads(json.dumps(ROWS[kind]))


def with_text_arguments(messages: list[dict]) -> list[dict]:
    """A copy of normalised messages with each tool call's arguments as JSON text (see ``Match.arguments``)."""
    messages = json.loads(json.dumps(messages))
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    return messages


# -------------------------------------------------------------------------------- templates


def with_text_parts(messages: list[dict]) -> list[dict]:
    """A copy of normalised messages with each non-assistant message's string content, and each empty assistant
    content (a tool call's), as one text part (see ``Match.content``)."""
    return [
        {**m, "content": [{"type": "text", "text": m["content"]}]}
        if isinstance(m.get("content"), str) and (m["role"] != "assistant" or not m["content"])
        else dict(m)
        for m in messages
    ]


@dataclass(frozen=True)
class Match:
    """phalanx must produce the oracle's examples; ``auto`` is the policy multi_turn="auto" must choose.

    ``arguments``: how the template takes tool-call arguments, so how the oracle renders them: "mapping" (as
    to_conversation gives them) or "text" (JSON text: a template that concatenates them as strings fails on a
    mapping, DeepSeek-V3.1; one that writes them `| string` writes a mapping as Python's repr, InternLM2's). ``unterminated``: the assistant turns the template ends with no marker after the
    message's text (GLM-4.6 writes none: its model stops by writing the next role's token), which phalanx counts.
    ``content``: how the template takes the system, user and tool messages' content, so how the oracle renders it:
    "string" (as to_conversation gives it) or "parts" (a list of one text part: Gemma 3's first template reads the
    system prompt as ``content[0]['text']``, which a string fails).
    """

    auto: str
    arguments: str = "mapping"
    unterminated: int = 0
    content: str = "string"


@dataclass(frozen=True)
class Refuse:
    """phalanx must refuse the row with a DataError whose message matches ``pattern`` (after ``where: ``)."""

    pattern: str
    why: str


@dataclass(frozen=True)
class TemplateCase:
    name: str  # file stem of the original
    shared: bool  # in ../shared/templates (else tests/data/templates/real)
    bos: Optional[str]
    eos: Optional[str]
    pad: Optional[str]
    rows: dict = field(hash=False)  # row kind -> Match | Refuse
    specials: tuple = ()  # the model's other special tokens that the template writes but MARKER_PATTERNS misses
    marked: bool = True  # whether a marked copy exists (not for a template whose every row is refused)

    @property
    def original_path(self) -> Path:
        return (shared_templates_dir() if self.shared else REAL) / f"{self.name}.jinja"

    @property
    def marked_path(self) -> Path:
        return (HERE if self.shared else REAL) / f"{self.name}.marked.jinja"


FULL, PER_TURN = Match("full"), Match("per_turn")
# The vanished tool call (messages[2]) must be named, with the function it calls.
VANISHED_CALL = Refuse(r"messages\[2\].*get_weather|get_weather.*messages\[2\]", "the template drops the tool call")
ALTERNATION = Refuse("roles must alternate", "the template raises on two assistant messages in a row")
# Command R7B writes the next assistant header after every conversation, add_generation_prompt or not.
AMBIGUOUS_END = Refuse(
    r"messages\[\d\] \(assistant\): where this turn ends is ambiguous", "the template writes the next header itself"
)

# Hermes' and Command R+'s tool_use templates loop over tools, None in a row without them: the refusal says so.
NEEDS_TOOLS = Refuse(
    r"fails on a row without tools \(TypeError: 'NoneType' object is not iterable\).*Give the row its \"tools\" list",
    "the tool_use template loops over tools, which are None without tools",
)

# bos/eos/pad as each model's tokenizer_config.json has them. Row expectations:
# - R1-Distill renders a tool call only when content is None (to_conversation passes ""), so the call vanishes;
#   Phi-3.5 has no tool support at all (drops tool calls and tool messages).
# - Qwen3 renders the empty (or the reasoning's) think block only after the last user query and drops
#   earlier reasoning: every row is per_turn. QwQ strips <think>...</think> from all but the last turn.
# - Gemma 2 raises on a system message; Hermes' tool_use template iterates over tools (None without them).
# - Mistral Nemo drops the system prompt unless a user turn is last, and moves the tools before the last
#   user message: the assistant turns render the same, so "full". It and Gemma 2 raise on two assistant
#   messages in a row; the others render each as a turn of its own.
# The templates after these come from a trial on unseen templates (real/README.md says what makes each hard):
# - gpt-oss ends the last turn with <|return|> (trained) and every other with <|end|>, and renders the analysis
#   channel (thinking) only in the last turn and in a tool call no final answer follows: every row is per_turn.
# - Mistral Small 3.1 has no generation prompt and ignores reasoning; its alternation check never fires (the
#   list it checks is built inside a for loop, where `set` does not last), so two assistant messages pass.
# - GLM-4.6 writes no end-of-turn marker (its model stops by writing <|user|> or <|observation|>): every turn is
#   unterminated; it renders reasoning only after the last user message, so reasoning rows are per_turn.
# - DeepSeek-V3.1 concatenates tool-call arguments as strings (a mapping raises): the masker passes them as JSON
#   text. It ignores reasoning_content and cuts a <think> block from content except after a tool output.
# - MiniMax-M2 pre-fills "<think>\n" in its generation prompt: when it writes a reasoning block (only after the
#   last user message: per_turn), that "<think>\n" is the prompt's, not trained. A <think> block in content stays
#   content (its split of content happens inside a for loop, where `set` does not last): "full", and its "<think>\n"
#   is the prompt's too.
# - Command R7B: every row refused (AMBIGUOUS_END).
# - Nemotron Nano v2 writes the last assistant message apart, after "<think>\n\n" (pre-filled by its generation
#   prompt); the turns' text is the same as in the whole rendering, so "full". It strips <think> from all but the
#   last turn (think: per_turn) and writes a last message's content and tool calls as two blocks, each closed by
#   its end-of-sequence token: refused (think_tool's first message has both).
ALL_ROWS = ("plain", "nosys", "tool", "reasoning", "reasoning_tool", "think", "think_tool", "two_assistants")
CASES = [
    TemplateCase(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        True,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        {"plain": FULL, "nosys": FULL, "tool": VANISHED_CALL, "two_assistants": FULL},
    ),
    TemplateCase(
        "Qwen-Qwen2.5-7B-Instruct",
        True,
        None,
        "<|im_end|>",
        "<|endoftext|>",
        {"plain": FULL, "nosys": FULL, "tool": FULL, "two_assistants": FULL},
    ),
    TemplateCase("Qwen-Qwen3-0.6B", True, None, "<|im_end|>", "<|endoftext|>", {k: PER_TURN for k in ALL_ROWS}),
    TemplateCase(
        "meta-llama-Llama-3.1-8B-Instruct",
        True,
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        {"plain": FULL, "nosys": FULL, "tool": FULL, "two_assistants": FULL},
    ),
    TemplateCase(
        "microsoft-Phi-3.5-mini-instruct",
        True,
        "<s>",
        "<|endoftext|>",
        "<|endoftext|>",
        {"plain": FULL, "nosys": FULL, "tool": VANISHED_CALL, "two_assistants": FULL},
    ),
    TemplateCase(
        "mistralai-Mistral-Nemo-Instruct-2407",
        True,
        "<s>",
        "</s>",
        None,
        {"plain": FULL, "nosys": FULL, "tool": FULL, "two_assistants": ALTERNATION},
    ),
    # ---- tests/data/templates/real/
    TemplateCase(
        "google-gemma-2-2b-it",
        False,
        "<bos>",
        "<eos>",
        "<pad>",
        {
            "nosys": FULL,
            "plain": Refuse("System role not supported", "the template raises on a system message"),
            "tool": Refuse("System role not supported", "the template raises on a system message"),
            "two_assistants": ALTERNATION,
        },
    ),
    TemplateCase(
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
        False,
        "<|begin_of_text|>",
        "<|im_end|>",
        None,
        {"tool": FULL, "plain": NEEDS_TOOLS, "nosys": NEEDS_TOOLS, "two_assistants": NEEDS_TOOLS},
    ),
    TemplateCase(
        "Qwen-QwQ-32B",
        False,
        None,
        "<|im_end|>",
        "<|endoftext|>",
        {"plain": FULL, "nosys": FULL, "tool": FULL, "think": PER_TURN, "think_tool": PER_TURN, "two_assistants": FULL},
    ),
    TemplateCase(
        "meta-llama-Llama-3.2-3B-Instruct",
        False,
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        {"plain": FULL, "nosys": FULL, "tool": FULL, "two_assistants": FULL},
    ),
    # ---- added from the trial on unseen templates; pad left unset (the masker never reads it)
    TemplateCase(
        "openai-gpt-oss-120b",
        False,
        "<|startoftext|>",
        "<|return|>",
        None,
        {k: PER_TURN for k in ALL_ROWS},
        specials=("<|constrain|>",),
    ),
    TemplateCase(
        "mistralai-Mistral-Small-3.1-24B-Instruct-2503", False, "<s>", "</s>", None, {k: FULL for k in ALL_ROWS}
    ),
    TemplateCase(
        "GLM-4.6",
        False,
        None,
        "<|endoftext|>",
        None,
        {
            **{k: Match("full", unterminated=3) for k in ("plain", "nosys", "tool", "two_assistants")},
            **{k: Match("per_turn", unterminated=3) for k in ("reasoning", "reasoning_tool", "think", "think_tool")},
        },
        specials=(
            "[gMASK]",
            "<sop>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "<tool_response>",
            "</tool_response>",
        ),
    ),
    TemplateCase(
        "deepseek-ai-DeepSeek-V3.1",
        False,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: Match("full", arguments="text") for k in ("tool", "reasoning_tool", "think_tool")},
        },
        specials=("<think>", "</think>"),
    ),
    TemplateCase(
        "unsloth-MiniMax-M2",
        False,
        "]~!b[",
        "[e~[",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "tool", "think", "think_tool", "two_assistants")},
            **{k: PER_TURN for k in ("reasoning", "reasoning_tool")},
        },
        specials=("]~b]", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
    ),
    TemplateCase(
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
        False,
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        None,
        {k: AMBIGUOUS_END for k in ALL_ROWS},
        marked=False,
    ),
    TemplateCase(
        "NVIDIA-Nemotron-Nano-v2",
        False,
        "<s>",
        "<SPECIAL_12>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "tool", "reasoning", "reasoning_tool", "two_assistants")},
            "think": PER_TURN,
            "think_tool": Refuse(
                r"messages\[2\] \(assistant\): the chat template writes the end-of-sequence token '<SPECIAL_12>' inside this turn",
                "a last message's content and tool calls are written as two blocks, each closed by the end-of-sequence token",
            ),
        },
        specials=(
            "<SPECIAL_10>",
            "<SPECIAL_11>",
            "<think>",
            "</think>",
            "<TOOLCALL>",
            "</TOOLCALL>",
            "<AVAILABLE_TOOLS>",
            "</AVAILABLE_TOOLS>",
            "<TOOL_RESPONSE>",
            "</TOOL_RESPONSE>",
        ),
    ),
    # ---- added from a second trial on unseen templates (real/README.md)
    TemplateCase("Bielik-11B-v3.0-Instruct", False, "<s>", "<|im_end|>", None, {k: FULL for k in ALL_ROWS}),
    TemplateCase(
        "GLM-4.7-Flash",
        False,
        None,
        "<|endoftext|>",
        None,
        {
            **{k: Match("full", unterminated=3) for k in ("plain", "nosys", "tool", "two_assistants")},
            # A <think> block in content is parsed into reasoning and rendered after the '<think>' the generation
            # prompt pre-fills, as reasoning_content is: that '<think>' is not trained.
            **{k: Match("per_turn", unterminated=3) for k in ("reasoning", "reasoning_tool", "think", "think_tool")},
        },
        specials=(
            "[gMASK]",
            "<sop>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
    ),
    # Qwen3-Coder: handled before these tests; guards XML tool calls (<function=...><parameter=...>) written after a
    # header whose newline the tool call writes, and a template that ignores reasoning_content.
    TemplateCase(
        "Qwen3-Coder",
        False,
        None,
        "<|im_end|>",
        None,
        {
            k: FULL
            for k in ("plain", "nosys", "tool", "reasoning", "reasoning_tool", "think", "think_tool", "two_assistants")
        },
    ),
    # ---- added from a third trial on unseen templates (real/README.md)
    # Apriel 1.6 (llama.cpp's fixed copy): its generation prompt pre-fills 'Here are my reasoning steps:\n', which no
    # finished turn writes, and after an assistant message it writes none, so the next message's own header
    # (`\n<|begin_assistant|>\n`, after the `\n<|end|>\n` that closes the first) is not output. A turn gets its end
    # marker only once a message follows it: every turn is unterminated. Reasoning and tool-call ids are written in
    # the last message only: per_turn.
    TemplateCase(
        "Apriel-1.6-15b-Thinker-fixed",
        False,
        "<s>",
        "</s>",
        None,
        {
            **{k: Match("full", unterminated=3) for k in ("plain", "nosys", "think", "two_assistants")},
            **{k: Match("per_turn", unterminated=3) for k in ("tool", "reasoning", "reasoning_tool", "think_tool")},
        },
    ),
    # DeepSeek-V3.2 (llama.cpp's port of the official encoding): without thinking its generation prompt ends
    # `<｜Assistant｜><think></think>` (after a tool output `\n\n<think></think>`) while a finished turn writes only
    # `</think>` there: the answer follows the same `</think>` in both, so it starts the output.
    TemplateCase(
        "deepseek-ai-DeepSeek-V3.2",
        False,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        None,
        {k: FULL for k in ALL_ROWS},
        specials=("<think>", "</think>"),
    ),
    # ---- added from a fourth trial on unseen templates (real/README.md)
    # Gemma 4 writes the results of a tool call inside the calling turn, each opened by `<|tool_response>`, and ends a
    # call that nothing follows with that token, which its model stops at: trained, and the turn is terminated. The
    # generation prompt pre-fills an empty thought channel no finished turn writes; reasoning is rendered only in a
    # tool-calling message after the last user message (per_turn). think_tool left out: a content written with tool
    # calls moves behind the results once they follow, so the marked copy cannot mark that turn as one block.
    TemplateCase(
        "google-gemma-4-31B-it",
        False,
        "<bos>",
        "<eos>",
        "<pad>",
        {
            **{k: FULL for k in ("plain", "nosys", "tool", "reasoning", "think", "two_assistants")},
            "reasoning_tool": PER_TURN,
        },
        specials=(
            "<|turn>",
            "<turn|>",
            "<|tool>",
            "<tool|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            '<|"|>',
            "<|channel>",
            "<channel|>",
        ),
    ),
    # ---- added from a fifth trial on unseen templates (real/README.md)
    # Apertus writes `<|assistant_end|>`, its model's end-of-sequence token, only as the first text of a user message
    # that follows an assistant turn: that close is the turn's (trained in the whole rendering, and in a per_turn row,
    # which is then the next message's rendering cut after it). A conversation's last turn gets the close a user message
    # after it would write (the oracle probes with PROBE_USER). A tool call has none (its results follow in the same
    # assistant block, after `<|tools_suffix|>`), nor a turn another assistant message continues (no header between
    # them): those are unterminated. It ignores reasoning_content.
    TemplateCase(
        "Apertus-8B-Instruct",
        False,
        "<s>",
        "<|assistant_end|>",
        "<pad>",
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think")},
            **{k: Match("full", unterminated=1) for k in ("tool", "reasoning_tool", "think_tool", "two_assistants")},
        },
    ),
    # ---- added from a sixth trial on unseen templates (real/README.md)
    # Qwen1.5 (its template of February to April 2024, when its end-of-sequence token was <|endoftext|>) closes a
    # message with `<|im_end|>\n` only once another follows (or with the generation prompt), so its generation prompt
    # after a user message is `<|im_end|>\n<|im_start|>assistant\n`, and after an assistant message it writes only the
    # close: a second assistant message in a row writes its own `<|im_start|>assistant\n`, which is header, not output.
    # The close is not the end-of-sequence token: every turn is unterminated. It drops tool calls and reasoning.
    TemplateCase(
        "Qwen-Qwen1.5-0.5B-Chat",
        False,
        None,
        "<|endoftext|>",
        "<|endoftext|>",
        {
            **{k: Match("full", unterminated=3) for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # ---- added from a seventh trial on unseen templates (real/README.md)
    # Hunyuan 3 (Hy3) sets its own special tokens (`<｜hy_eos:opensource｜>` and the rest, built with `.format`, so
    # MARKER_PATTERNS cannot see them: listed in specials). Its generation prompt pre-fills `<think:opensource></think:
    # opensource>` (reasoning_effort no_think, the default), which a turn without reasoning writes too; a turn with
    # reasoning writes `<think:opensource>` then the reasoning, so the output starts after that opening. It writes the
    # end-of-sequence token after an answer only when a message follows (or with its own is_training), after a tool call
    # always: a conversation's last answer gets the close a user message after it would write. Reasoning is rendered
    # after the last user message only, unless tools are given (preserved_thinking): the reasoning row is per_turn, and
    # its turns, rewritten once followed (their reasoning dropped, as the same message without reasoning renders), get
    # that message's close.
    TemplateCase(
        "tencent-Hy3",
        False,
        "<｜hy_begin_of_sentence:opensource｜>",
        "<｜hy_eos:opensource｜>",
        "<｜hy_pad:opensource｜>",
        {
            **{k: FULL for k in ALL_ROWS if k != "reasoning"},
            "reasoning": PER_TURN,
        },
        specials=(
            "<｜hy_User:opensource｜>",
            "<｜hy_Assistant:opensource｜>",
            "<｜reasoning_mode:opensource｜>",
            "<think:opensource>",
            "</think:opensource>",
            "<tool_calls:opensource>",
            "</tool_calls:opensource>",
            "<tool_call:opensource>",
            "</tool_call:opensource>",
            "<tool_sep:opensource>",
            "<arg_key:opensource>",
            "</arg_key:opensource>",
            "<arg_value:opensource>",
            "</arg_value:opensource>",
            "<tool_responses:opensource>",
            "</tool_responses:opensource>",
            "<tool_response:opensource>",
            "</tool_response:opensource>",
        ),
    ),
    # DeciLM writes "### Assistant:\n" + content and a newline, and no end-of-turn marker (its end-of-sequence token
    # </s> is never written): every turn is unterminated, though a newline follows it. It drops tool calls.
    TemplateCase(
        "Deci-DeciLM-7B-instruct",
        False,
        "<s>",
        "</s>",
        None,
        {
            **{k: Match("full", unterminated=3) for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # vLLM's Mistral parallel-tools template has no generation prompt and writes the system prompt into the
    # conversation's last message when it is a user message, so every turn's view renders its context unlike its
    # prompt; an answer is " " + content + </s>, and the model writes that space too. It raises on two assistant
    # messages in a row and drops reasoning; tool calls are `[TOOL_CALLS] [...]` with the call's id.
    TemplateCase(
        "vllm-tool_chat_template_mistral_parallel",
        False,
        "<s>",
        "</s>",
        None,
        {**{k: FULL for k in ALL_ROWS if k != "two_assistants"}, "two_assistants": ALTERNATION},
    ),
    # ---- added from an eighth trial on unseen templates (real/README.md)
    # Granite 4.0 writes `<|end_of_text|>`, its bos, eos and pad token at once, after every message; a tool call is
    # `<tool_call>` JSON after the content (a newline between them only when there is content); reasoning is ignored.
    TemplateCase(
        "ibm-granite-granite-4.0",
        False,
        "<|end_of_text|>",
        "<|end_of_text|>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # Seed-OSS sets its own bos/eos (`<seed:bos>`, `<seed:eos>`) and writes a turn as `<seed:bos>assistant` and then its
    # parts (reasoning in `<seed:think>`, content trimmed, XML tool calls), each opening with "\n": the generation prompt
    # `<seed:bos>assistant\n` holds the first. A `<think>` block in content stays content.
    TemplateCase(
        "ByteDance-Seed-OSS",
        False,
        "<seed:bos>",
        "<seed:eos>",
        None,
        {k: FULL for k in ALL_ROWS},
        specials=("<seed:think>", "</seed:think>", "<seed:tool_call>", "</seed:tool_call>"),
    ),
    # LFM2.5 (8B-A1B) ships its own generation tags (its marked copy is the file itself). Pythonic tool calls
    # (`<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|>`); reasoning rendered after the last user
    # message only, and a <think> block in content cut from the turns before it: those rows are per_turn.
    TemplateCase(
        "LFM2.5-8B-A1B",
        False,
        "<|startoftext|>",
        "<|im_end|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "tool", "two_assistants")},
            **{k: PER_TURN for k in ("reasoning", "reasoning_tool", "think", "think_tool")},
        },
    ),
    # functionary v3.2: the generation prompt pre-fills the '>>>' that opens a turn's first part (`>>>all\n` + content,
    # or `>>>NAME\n` + arguments); it concatenates arguments as text (a mapping raises); reasoning is dropped.
    TemplateCase(
        "meetkai-functionary-medium-v3.2",
        False,
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: Match("full", arguments="text") for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # Devstral Small 2507 (Unsloth's template): no generation prompt; two assistant messages in a row are written
    # back to back (`Fact one.</s>Fact two.</s>`); reasoning dropped.
    TemplateCase("unsloth-mistral-Devstral-Small-2507", False, "<s>", "</s>", None, {k: FULL for k in ALL_ROWS}),
    # Mistral Small 3.2: no generation prompt; tools written before the last user message; a call's id as [CALL_ID];
    # a tool-calling message's content (and its <think> block) dropped; raises on two assistant messages in a row.
    TemplateCase(
        "Mistral-Small-3.2-24B-Instruct-2506",
        False,
        "<s>",
        "</s>",
        None,
        {**{k: FULL for k in ALL_ROWS if k != "two_assistants"}, "two_assistants": ALTERNATION},
    ),
    # Step 3.5 Flash: the generation prompt pre-fills '<think>\n'; a turn after the last user query writes it and
    # its reasoning (empty or not), one before writes neither: every row is per_turn.
    TemplateCase(
        "StepFun3.5-Flash", False, "<|begin_of_sentence|>", "<|im_end|>", None, {k: PER_TURN for k in ALL_ROWS}
    ),
    # Kimi K2 Thinking: keeps the reasoning of every assistant message after the first one without tool calls (its
    # search for the last such message keeps the first), writes `<think></think>` before the others; its tool calls
    # need list.append, which transformers' sandbox forbids.
    TemplateCase(
        "Kimi-K2-Thinking",
        False,
        "[BOS]",
        "[EOS]",  # never written: the model stops at <|im_end|> (its generation_config's eos)
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{
                k: Refuse("list.append|'append'", "tool calls need list.append")
                for k in ("tool", "reasoning_tool", "think_tool")
            },
        },
    ),
    # SmolLM3: drops tool calls; ignores reasoning_content; /no_think pre-fills an empty think block every turn writes.
    TemplateCase(
        "HuggingFaceTB-SmolLM3-3B",
        False,
        None,
        "<|im_end|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # Nemotron 3 Nano: the generation prompt pre-fills '<think>\n'; a turn with reasoning writes it, one without writes
    # '<think></think>', whose '<think>' the prompt pre-fills too (the output starts at '</think>'); reasoning kept after
    # the last user message only (truncate_history_thinking): reasoning rows are per_turn.
    TemplateCase(
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        False,
        "<s>",
        "<|im_end|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "tool", "two_assistants")},
            **{k: PER_TURN for k in ("reasoning", "reasoning_tool", "think", "think_tool")},
        },
    ),
    # Apriel 1.5 (Unsloth's template, as llama.cpp keeps it): a turn ends '\n<|end|>\n' + the end-of-sequence token; a
    # tool call's id is written in every message but the last: tool rows are per_turn. Reasoning is dropped.
    TemplateCase(
        "unsloth-Apriel-1.5",
        False,
        "<s>",
        "</s>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: PER_TURN for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # Kimi K2 (Instruct): tool-call ids built from the name and the call's index (`functions.get_weather:0`), not the
    # row's; `<|im_end|>` with no newline; a default system prompt; reasoning dropped.
    TemplateCase("moonshotai-Kimi-K2", False, "[BOS]", "[EOS]", None, {k: FULL for k in ALL_ROWS}),
    # Granite 3.3: every message `<|start_of_role|>ROLE<|end_of_role|>CONTENT<|end_of_text|>\n`; drops tool calls.
    TemplateCase(
        "ibm-granite-granite-3.3-2B-Instruct",
        False,
        "<|end_of_text|>",
        "<|end_of_text|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # ---- added from a ninth trial on unseen templates (real/README.md says where each comes from)
    # OLMo 3 Think: ends a conversation's last assistant message with its end-of-sequence token and an earlier one with
    # `<|im_end|>\n` (every row per_turn); its prompt pre-fills `<think>`, which a turn without reasoning does not write;
    # tool calls only as its own `function_calls` text field (the rows' are dropped); a default system prompt. Two
    # assistant messages in a row were refused: the context renders differently (the first one's end) and the prompt
    # pre-fills `<think>`, both at once.
    TemplateCase(
        "allenai-Olmo-3-7B-Think",
        False,
        None,
        "<|endoftext|>",
        None,
        {
            **{k: PER_TURN for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # DeepSeek-R1-0528: a user message writes the assistant header itself (`<｜User｜>...<｜Assistant｜>`), so after one the
    # generation prompt is empty; tool-call arguments concatenated as text; reasoning cut from content, tools ignored.
    TemplateCase(
        "deepseek-ai-DeepSeek-R1-0528",
        False,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: Match("full", arguments="text") for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # Qwen3 Thinking 2507: the generation prompt pre-fills '<think>\n'; the last turn after the last user query always
    # writes a think block (empty or not), an earlier one only with reasoning: every row is per_turn.
    TemplateCase(
        "Qwen-Qwen3-4B-Thinking-2507", False, None, "<|im_end|>", "<|endoftext|>", {k: PER_TURN for k in ALL_ROWS}
    ),
    # Qwen3.5: every turn after the last user query writes a think block, whose '<think>\n' the prompt pre-fills; content
    # trimmed; XML tool calls (`<function=NAME>`, `<parameter=KEY>`); its marked copy marks the thinking default.
    TemplateCase("Qwen3.5-4B", False, None, "<|im_end|>", "<|endoftext|>", {k: PER_TURN for k in ALL_ROWS}),
    # EXAONE 4.0: `[|assistant|]\n` headers (markers the patterns miss); the prompt pre-fills an empty think block that
    # every turn writes; `{% continue %}`, `role.class`, and a `[9:]` cut that eats two characters of reasoning.
    TemplateCase(
        "LGAI-EXAONE-EXAONE-4.0-32B-GGUF",
        False,
        "[BOS]",
        "[|endofturn|]",
        "[PAD]",
        {k: FULL for k in ALL_ROWS},
        specials=("[|system|]", "[|user|]", "[|assistant|]", "[|tool|]"),
    ),
    # Gemma 3: the system prompt joins the first user message; `model` role; content trimmed; no tool role (a tool
    # message breaks the alternation it checks).
    TemplateCase(
        "unsloth-gemma-3-1b-it",
        False,
        "<bos>",
        "<eos>",
        "<pad>",
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think")},
            **{
                k: Refuse(
                    "roles must alternate", "the template has no tool role: a tool message breaks the alternation"
                )
                for k in ("tool", "reasoning_tool", "think_tool")
            },
            "two_assistants": ALTERNATION,
        },
    ),
    # DeepSeek-Coder-V2: the generation prompt is 'Assistant:' and a turn 'Assistant: ' + text: the space is output.
    TemplateCase(
        "deepseek-ai-DeepSeek-Coder-V2-Lite-Instruct",
        False,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # ERNIE 4.5: a turn ends with sep_token `<|end_of_sentence|>` (not eos), read from the tokenizer with a default.
    TemplateCase(
        "baidu-ERNIE-4.5-21B-A3B-PT",
        False,
        "<s>",
        "</s>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # Hunyuan-A13B: no assistant header and no generation prompt: a turn is its text and <|eos|>; tool calls dropped.
    TemplateCase(
        "tencent-Hunyuan-A13B-Instruct",
        False,
        "<|startoftext|>",
        "<|eos|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # OLMo 3 Instruct: the last assistant message ends with the end-of-sequence token, an earlier one `<|im_end|>\n`
    # (per_turn); Pythonic tool calls `<function_calls>get_weather(city="Paris")</function_calls>`; tool results as an
    # `environment` turn.
    TemplateCase("allenai-Olmo-3-7B-Instruct", False, None, "<|endoftext|>", None, {k: PER_TURN for k in ALL_ROWS}),
    # Phi-4-mini: tools only as a system message's `tools` text (the row's are not rendered); tool calls dropped; the
    # conversation ends with eos_token (not in a turn), as Phi-3.5.
    TemplateCase(
        "microsoft-Phi-4-mini-instruct",
        False,
        "<|endoftext|>",
        "<|endoftext|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # firefunction v2: reads `functions` and `datetime`, which its callers pass to apply_chat_template: without them every
    # row is refused saying to give them with data.chat_template_kwargs (with them, every row is refused as Command
    # R7B's: it writes the next assistant header after every conversation). No marked copy.
    TemplateCase(
        "fireworks-ai-llama-3-firefunction-v2",
        False,
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        {
            k: Refuse(
                r"reads the variable 'functions', which nothing sets.*--chat_template_kwargs '\{functions: \.\.\.\}'",
                "the template reads variables its callers pass",
            )
            for k in ALL_ROWS
        },
        marked=False,
    ),
    # Command R+ tool_use: loops over tools (rows without them refused, as Hermes'); with tools, it ends every rendering
    # with an instruction turn and the next header, add_generation_prompt or not (ambiguous, as Command R7B). No marked
    # copy.
    TemplateCase(
        "CohereForAI-c4ai-command-r-plus-tool_use",
        False,
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        None,
        {
            **{k: NEEDS_TOOLS for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: AMBIGUOUS_END for k in ("tool", "reasoning_tool", "think_tool")},
        },
        marked=False,
    ),
    # DeepSeek-V4 (llama.cpp's copy): as V3.2 without thinking, the generation prompt `<｜Assistant｜></think>` is what
    # every turn writes first; reasoning written only with thinking, after the last user message; DSML tool calls (string
    # arguments parsed with a `from_json` filter transformers lacks: mappings only); tool results in a user turn.
    TemplateCase(
        "deepseek-ai-DeepSeek-V4",
        False,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # Llama 4 (Scout/Maverick): `<|header_start|>assistant<|header_end|>\n\n` headers and `<|eot|>`; the tools go into the
    # first user message (tools_in_user_message); a tool call is `<|python_start|>` + content + `<|python_end|>` + JSON
    # `{"name", "parameters"}` calls; tool results under `ipython`; a system prompt trimmed.
    TemplateCase(
        "meta-llama-Llama-4-Scout-17B-16E-Instruct",
        False,
        "<|begin_of_text|>",
        "<|eot|>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # Command A (03-2025, the template of Ollama's GGUF): without documents, an empty system turn when there is no system
    # message, `<|START_RESPONSE|>` pre-filled by the generation prompt, content stripped, and the user/assistant
    # alternation checked, so tool messages (only its documents branch writes tool calls) and two assistant messages in
    # a row are refused with its message.
    TemplateCase(
        "CohereLabs-c4ai-command-a-03-2025",
        False,
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think")},
            **{
                k: Refuse("roles must alternate", "without documents the template has no tool role")
                for k in ("tool", "reasoning_tool", "think_tool")
            },
            "two_assistants": ALTERNATION,
        },
    ),
    # Phi-4-reasoning: ships its own generation tags (its marked copy is the file itself); writes its own system prompt and
    # drops the row's (reported); `<|im_sep|>` after the role; tool calls dropped.
    TemplateCase(
        "microsoft-Phi-4-reasoning",
        False,
        "<|endoftext|>",
        "<|im_end|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # GigaChat3 10B-A1.8B (llama.cpp's copy): roles are plain text before `<|role_sep|>\n` (no role token), every
    # message ends `<|message_sep|>\n\n`; a long default "developer system" message; tools as a TypeScript namespace. A
    # tool call is a message of its own, `function call<|role_sep|>\n{"name": ..., "arguments": ...}`, right after the
    # calling assistant message (empty when it has no content): the model writes that role's header itself, so its
    # output spans two messages (llama.cpp parses it so). Reasoning dropped; a <think> block in content kept.
    TemplateCase(
        "GigaChat3-10B-A1.8B",
        False,
        "<s>",
        "</s>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # Kimi K3 (llama.cpp's copy): XML-like tags built from generic special tokens, the tag and its attributes as text
    # between them (`<|open|>message role="assistant"<|sep|>`, `<|close|>message<|sep|>`, then `<|end_of_msg|>`); the
    # generation prompt also opens the think block (`thinking`, true unless given), which every assistant message
    # writes, reasoning or not, in every turn (so "full"); content in a response block; tool calls as `<|open|>call
    # tool="get_weather" index="1"<|sep|>` with one typed argument tag each; tool results named from the call's id; a
    # thinking-effort system message by default. eos: `<|end_of_msg|>` assumed (it ends every message).
    TemplateCase(
        "Kimi-K3",
        False,
        None,
        "<|end_of_msg|>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # MiroThinker-v1 (llama.cpp's copy, as the stored ggml-org/llama.cpp has it): a block closed by the wrong end tag
    # (an `if` left open inside a `for`, line 177), so it does not compile and no row renders. As the tokenizer's
    # template, every row was refused as the row's fault ("change the row to what it accepts"); the refusal now says
    # the template is not valid jinja, with its line. No marked copy: every row is refused.
    TemplateCase(
        "MiroThinker-v1",
        False,
        None,
        "<|im_end|>",
        "<|endoftext|>",
        {
            k: Refuse(
                r"the chat template is not valid jinja \(line 177: Encountered unknown tag 'endfor'.*the fault is in the "
                r"template's text, not in the row",
                "the template does not compile",
            )
            for k in ALL_ROWS
        },
        marked=False,
    ),
    # ---- the eleventh trial
    # Ministral 3 14B Reasoning (2512): no generation prompt (the block is all a turn writes, through </s>); reasoning only
    # as `thinking` chunks of a list content (reasoning_content is dropped: reported; a <think> block in content is kept as
    # text); raises on two assistant messages in a row (its alternation check skips tool-calling messages only).
    TemplateCase(
        "mistralai-Ministral-3-14B-Reasoning-2512",
        False,
        "<s>",
        "</s>",
        None,
        {**{k: FULL for k in ALL_ROWS if k != "two_assistants"}, "two_assistants": ALTERNATION},
    ),
    # Solar Open 100B: `<|begin|>ROLE<|content|>...<|end|>`; the generation prompt `<|begin|>assistant`; a tool call turn
    # `<|tool_calls|>...<|calls|>` (its content dropped); reasoning (`reasoning`) written after the last user message as a
    # message of its own, `<|begin|>assistant<|think|>...<|end|>`, before the answer's: with `<|end|>` as end-of-sequence
    # token that turn holds it, so reasoning rows are refused, naming reasoning as the first block. Markers with a colon
    # (`<|tool_call:begin|>`) are missed by MARKER_PATTERNS.
    TemplateCase(
        "upstage-Solar-Open-100B",
        False,
        None,
        "<|end|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "tool", "think", "think_tool", "two_assistants")},
            **{
                k: Refuse(
                    r"messages\[2\] \(assistant\): the chat template writes the end-of-sequence token '<\|end\|>' inside "
                    r"this turn.*writes the message's reasoning and (content|tool calls) as blocks of their own",
                    "reasoning is written as a message of its own, closed by <|end|>",
                )
                for k in ("reasoning", "reasoning_tool")
            },
        },
        specials=(
            "<|tools:begin|>",
            "<|tools:end|>",
            "<|tool:begin|>",
            "<|tool:end|>",
            "<|tool_call:begin|>",
            "<|tool_call:name|>",
            "<|tool_call:args|>",
            "<|tool_call:end|>",
            "<|tool_response:begin|>",
            "<|tool_response:id|>",
            "<|tool_response:name|>",
            "<|tool_response:result|>",
            "<|tool_response:end|>",
        ),
    ),
    # Reka Edge: roles as plain text (`human: `, `assistant: `), every message closed by `<sep>` (its end-of-sequence
    # token); the generation prompt `assistant:` has no space, a turn writes `assistant: ` + text + `\n\n<sep>`, so the
    # space is output (as DeepSeek-Coder-V2); reasoning (reasoning_content, or a <think> block split off content) written
    # only with `enable_thinking`: dropped by default (reported); Hermes-style <tool_call> JSON.
    TemplateCase(
        "Reka-Edge",
        False,
        None,
        "<sep>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # ---- the twelfth trial (the templates in Ollama's GGUFs, as huggingface.js keeps them)
    # GLM-4-9B-chat: `[gMASK]<sop>`, then `<|ROLE|>` + metadata + `\n` + content per message, and no end-of-turn marker (the
    # model stops by writing the next role's token, as GLM-4.6): every turn unterminated, and the output starts with the
    # `\n` after the (empty) metadata. Tools only from a message's own `tools` key (the row's are not written); a message
    # with no content is skipped whole, so a tool-calling message vanishes (refused, naming the call); reasoning dropped.
    TemplateCase(
        "THUDM-glm-4-9b-chat",
        False,
        None,
        "<|endoftext|>",
        "<|endoftext|>",
        {
            **{k: Match("full", unterminated=3) for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
        specials=("[gMASK]", "<sop>", "<|user|>", "<|observation|>"),
    ),
    # EXAONE Deep 2.4B: `[|ROLE|]` + content, `[|endofturn|]` after every message but a user's, a newline between messages;
    # the generation prompt `\n[|assistant|]<thought>\n` pre-fills a thought no finished turn writes (it cuts everything
    # up to `</thought>` from content), so the output starts after `[|assistant|]`; an empty system turn when the row has
    # none; tool calls dropped.
    TemplateCase(
        "LGAI-EXAONE-EXAONE-Deep-2.4B",
        False,
        "[BOS]",
        "[|endofturn|]",
        "[PAD]",
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
        specials=("[|system|]", "[|user|]", "[|assistant|]", "<thought>", "</thought>"),
    ),
    # Aya Expanse 8B: Cohere's turn tokens, content stripped; raises on a role out of the user/assistant alternation, so
    # a tool message (it has no tool role) or two assistant messages in a row are refused with its message.
    TemplateCase(
        "CohereForAI-aya-expanse-8b",
        False,
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        "<PAD>",
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think")},
            **{k: ALTERNATION for k in ("tool", "reasoning_tool", "think_tool", "two_assistants")},
        },
    ),
    # Nemotron-Mini-4B-Instruct: writes `<extra_id_1>Assistant\n` after every conversation, add_generation_prompt or not,
    # so where a turn ends cannot be told (as Command R7B): every row refused.
    TemplateCase(
        "nvidia-Nemotron-Mini-4B-Instruct",
        False,
        "<s>",
        "</s>",
        None,
        {k: AMBIGUOUS_END for k in ALL_ROWS},
        specials=("<extra_id_0>", "<extra_id_1>"),
        marked=False,
    ),
    # ---- the thirteenth trial (llama.cpp's functionary v3.1, Ollama's GGUF templates, vLLM's tool templates)
    # functionary medium v3.1: Llama 3.1 headers; a tool call is `<function=NAME>{...}</function>` and ends with <|eom_id|>,
    # an answer with <|eot_id|> (the masker counted no end token for the call: the renderings part inside the marker).
    TemplateCase(
        "meetkai-functionary-medium-v3.1",
        False,
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # Llama 2 chat: `[INST]` turns each opened by bos, the system prompt inside the first one (`<<SYS>>`); no generation
    # prompt (the output is ' ' + content stripped + ' ' + eos after ` [/INST]`); raises on a role out of the alternation.
    TemplateCase(
        "meta-llama-Llama-2-7b-chat",
        False,
        "<s>",
        "</s>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think")},
            **{k: ALTERNATION for k in ("tool", "reasoning_tool", "think_tool", "two_assistants")},
        },
    ),
    # Phi-4: a user message writes the assistant header `<|im_start|>assistant<|im_sep|>` itself (no generation prompt),
    # so two assistant messages in a row are written back to back; tool calls and tool messages dropped.
    TemplateCase(
        "microsoft-phi-4",
        False,
        "<|endoftext|>",
        "<|im_end|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: VANISHED_CALL for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # xLAM-2 (Llama based), vLLM's template: calls as one JSON array `[{"name": ..., "arguments": ...}]`, a default
    # system prompt, content trimmed; a tool-calling message's content dropped (a <think> block there: reported).
    TemplateCase(
        "vllm-tool_chat_template_xlam_llama",
        False,
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # InternLM2(.5), vLLM's template: tools in a `system name=<|plugin|>` turn, a call as
    # `<|action_start|><|plugin|>\n{"name": ..., "arguments": ...}<|action_end|>` with the arguments through `| string`
    # (a mapping would be written as Python's repr: the masker passes JSON text), results as `environment` turns; its eos
    # </s> is never written (a turn ends <|im_end|>).
    TemplateCase(
        "vllm-tool_chat_template_internlm2_tool",
        False,
        "<s>",
        "</s>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "reasoning", "think", "two_assistants")},
            **{k: Match("full", arguments="text") for k in ("tool", "reasoning_tool", "think_tool")},
        },
    ),
    # MiniCPM3, vLLM's template: tools as Python signatures (macros with `caller()`), a call as a Python code block
    # between <|tool_call_start|> and <|tool_call_end|>, the content written after the calls; reasoning only as the
    # message's `thought` (reasoning_content dropped, reported).
    TemplateCase(
        "vllm-tool_chat_template_minicpm3",
        False,
        "<s>",
        "<|im_end|>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # ---- the fourteenth trial (a guard model's template from Ollama's GGUFs, vLLM's tool templates)
    # ShieldGemma 27B: renders only the last two messages, framed by its policy question ("Does the Chatbot Response
    # violate the above principle? ..."), written after whatever message ends the conversation: the question was trained
    # as the answer's end. Refused: an ambiguous end; its guideline comes from the system message or a variable of its own.
    TemplateCase(
        "google-shieldgemma-27b",
        False,
        "<bos>",
        "<eos>",
        "<pad>",
        {
            **{k: AMBIGUOUS_END for k in ("plain", "reasoning", "think", "tool", "reasoning_tool", "think_tool")},
            **{
                k: Refuse(r"reads the variable 'guideline', which nothing sets", "its guideline is the system message")
                for k in ("nosys", "two_assistants")
            },
        },
        marked=False,
    ),
    # HyperCLOVA X SEED Think 14B, vLLM's template: the generation prompt `<|im_start|>assistant` stops inside the header,
    # which the turn completes by what it writes (`/think\n` for reasoning, `\n` for an answer, ` -> tool/function_call\n`
    # for calls), each part a message of its own; an answer ends `<|im_end|><|endofturn|>`, a call `<|im_end|><|stop|>`
    # (counted as an end token); reasoning only after the last user or tool message (per_turn).
    TemplateCase(
        "vllm-tool_chat_template_hyperclovax_seed_think_14b",
        False,
        None,
        "<|endofturn|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "tool", "think", "think_tool", "two_assistants")},
            **{k: PER_TURN for k in ("reasoning", "reasoning_tool")},
        },
    ),
    # Muse Glimmer, vLLM's template: harmony-like `<|start|>assistant to=RECIPIENT<|message|>...<|eot|>`; a default system
    # message written only with add_generation_prompt or tools (the prompt was compared from its first character and
    # rows without a system message were refused); reasoning a `to=self` message ending `<|eom|>`; calls as
    # `<atem:function_calls>` XML.
    TemplateCase(
        "vllm-tool_chat_template_muse_glimmer",
        False,
        None,
        "<|eot|>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # ---- the fifteenth trial (vLLM's tool template for DeepSeek-R1 and its distills)
    # DeepSeek-R1, vLLM's template: a user message writes the assistant header `<｜Assistant｜>` (no generation prompt after
    # it), and the template's indentation is written inside each turn before the message (trained: the turn as rendered);
    # calls as R1-Distill's corrected template writes them, arguments `| tojson`; `...</think>` cut from content
    # (reasoning reported dropped). A second assistant message in a row has no header: refused (its generation prompt,
    # `<｜Assistant｜>` after an assistant message, is not how the turn starts).
    TemplateCase(
        "vllm-tool_chat_template_deepseekr1",
        False,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        None,
        {
            **{k: FULL for k in ALL_ROWS if k != "two_assistants"},
            "two_assistants": Refuse(
                r"messages\[2\] \(assistant\): the chat template's generation prompt .* is not how it starts",
                "a second assistant message in a row is written with no header, where the generation prompt writes one",
            ),
        },
    ),
    # ---- the sixteenth trial (Gemma 3's first template, as Ollama's gemma3:1b GGUF keeps it)
    # Gemma 3 as first published: the system prompt read as `messages[0]['content'][0]['text']` only (a string raised
    # "'str object' has no attribute 'text'" and every row with a system message was refused, telling the user to change
    # a row phalanx would flatten again): the masker now gives it the contents as text parts. No tool role.
    TemplateCase(
        "google-gemma-3-1b-it-ollama",
        False,
        "<bos>",
        "<eos>",
        "<pad>",
        {
            **{k: Match("full", content="parts") for k in ("plain", "nosys", "reasoning", "think")},
            **{
                k: Refuse(
                    r"failed on messages\[:4\] \(roles: system, user, assistant, tool\).*roles must alternate",
                    "the template has no tool role: a tool message breaks the alternation (once the system prompt "
                    "renders as a text part)",
                )
                for k in ("tool", "reasoning_tool", "think_tool")
            },
            "two_assistants": ALTERNATION,
        },
    ),
    # llama.cpp's Phi-4-mini template: tools as `<|tool|>...<|/tool|>` in the system turn, calls as
    # `<|tool_call|>{...}<|/tool_call|>` after the content, `<|end|>` ends a turn, the end-of-sequence token after a
    # conversation without a generation prompt (not trained, as Phi-3.5's). It tests `tools is defined`, which
    # transformers makes true for a row without tools (tools=None), and loops over the None: those rows were refused as a
    # Hermes-style tool_use template; now as one written for another renderer.
    TemplateCase(
        "llama-cpp-microsoft-Phi-4-mini-instruct",
        False,
        "<|endoftext|>",
        "<|endoftext|>",
        None,
        {
            **{k: FULL for k in ("tool", "reasoning_tool", "think_tool")},
            **{
                k: Refuse(
                    r"fails on a row without tools \(TypeError: 'NoneType' object is not iterable\).*tests `tools is "
                    r"defined`.*llama\.cpp's",
                    "it tests `tools is defined`, true in transformers for a row without tools (tools=None)",
                )
                for k in ("plain", "nosys", "reasoning", "think", "two_assistants")
            },
        },
        specials=("<|/tool|>", "<|/tool_call|>"),
    ),
    # The seventeenth trial (real/README.md): Command A Reasoning reads `content[0].thinking` of every assistant message,
    # which the empty content of a tool call (a string) fails: every tool-calling row was refused with its 'str object
    # has no element 0'; now the row is rendered again with contents as text parts (an empty one too), and the tool
    # results are then written as the parts it iterates. Reasoning as `<|START_THINKING|>...<|END_THINKING|>` before
    # `<|START_RESPONSE|>` or `<|START_ACTION|>`; a calling message's content dropped (a <think> block there: reasoning
    # dropped); the generation prompt is the bare header.
    TemplateCase(
        "CohereLabs-command-a-reasoning-08-2025",
        False,
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        None,
        {
            **{k: FULL for k in ALL_ROWS if k != "tool"},
            "tool": Match("full", content="parts"),
        },
    ),
    # GLM-5.1 (the seventeenth trial): as GLM-4.7-Flash, no end-of-turn marker and the generation prompt pre-fills
    # '<think>'; a turn after the last user message writes '<think>' + its reasoning (empty when it has none) +
    # '</think>', one before it '</think>' only, so '</think>' opens the output either way; reasoning taken from a
    # <think> block in content is written unstripped.
    TemplateCase(
        "zai-org-GLM-5.1",
        False,
        None,
        "<|endoftext|>",
        None,
        {
            **{k: Match("full", unterminated=3) for k in ("plain", "nosys", "tool", "two_assistants")},
            **{k: Match("per_turn", unterminated=3) for k in ("reasoning", "reasoning_tool", "think", "think_tool")},
        },
        specials=("[gMASK]", "<sop>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ),
    # The eighteenth trial (real/README.md). FunctionGemma: a call is followed by `<start_function_response>`, the token
    # its model stops at, which the calling message writes only when it ends the conversation; once a result follows, the
    # tool message writes it as its first text (the marked copy writes it in the call's block, as Apertus's end marker);
    # the answer after the results continues the same model turn (no header: the generation prompt after a tool message
    # is empty); arguments in its own `key:<escape>value<escape>` syntax; reasoning ignored.
    TemplateCase(
        "google-functiongemma-270m-it",
        False,
        "<bos>",
        "<eos>",
        "<pad>",
        {k: FULL for k in ALL_ROWS},
        specials=(
            "<start_function_call>",
            "<end_function_call>",
            "<start_function_response>",
            "<end_function_response>",
            "<start_function_declaration>",
            "<end_function_declaration>",
            "<escape>",
            "<start_of_image>",
        ),
    ),
    # poolside Laguna XS.2: ships generation tags that hold the `<assistant>\n` header its generation prompt writes (the
    # marked copy moves them after it); the prompt pre-fills `</think>` (thinking off, the default), which a turn writes
    # before its text only when it has no reasoning; every turn writes its reasoning (`<think>\n...\n</think>\n`) and
    # ends `</assistant>\n` (`</assistant>` is an end token, not the end-of-sequence token `〈|EOS|〉` the template opens
    # with); a default system message.
    TemplateCase(
        "poolside-Laguna-XS.2",
        False,
        "〈|EOS|〉",
        "〈|EOS|〉",
        None,
        {k: FULL for k in ALL_ROWS},
        specials=(
            "<system>",
            "</system>",
            "<user>",
            "</user>",
            "<assistant>",
            "</assistant>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
    ),
    # Cohere2MoE (North Mini Code): the generation prompt pre-fills `<|START_THINKING|>` (reasoning on, the default),
    # which a turn writes only with reasoning (one without starts `<|START_TEXT|>`); tool-call ids regenerated from 0; a
    # calling message's content dropped (a <think> block there counted as dropped reasoning); a long platform preamble.
    # With reasoning off its prompt pre-fills an empty `<|START_THINKING|><|END_THINKING|>`, with `skip_thinking`
    # `<|START_THINKING|>` where no turn writes reasoning: every row was refused (tests/data/test_chat.py).
    TemplateCase(
        "Cohere2MoE",
        False,
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        None,
        {k: FULL for k in ALL_ROWS},
    ),
    # OpenBMB MiniCPM5 1B: Qwen3's layout without the empty think block (a turn after the last user query writes
    # `<think>\n...\n</think>\n\n` only with reasoning, which the generation prompt does not pre-fill: reasoning rows
    # per_turn); calls as `<function name="..."><param name="...">...</param></function>`, a value holding `<`, `&` or a
    # newline in CDATA; a `<tool_sep>` in content meant to place each call inside the text, whose `set` in a `for` does
    # not last, so the text after the first separator is dropped (refused as dropped content).
    TemplateCase(
        "openbmb-MiniCPM5-1B",
        False,
        "<s>",
        "<|im_end|>",
        None,
        {
            **{k: FULL for k in ("plain", "nosys", "tool", "two_assistants")},
            **{k: PER_TURN for k in ("reasoning", "reasoning_tool", "think", "think_tool")},
        },
    ),
    # Qwen3.8 (TRL's copy of the model's own): `preserve_thinking` defaults to true, so every turn writes its think
    # block (`<think>\n` + reasoning, empty or not, + `\n</think>\n\n`), whatever follows: every row full, the
    # `<think>\n` the generation prompt pre-fills left out; a `<think>` block in content is not read (the turn writes an
    # empty block, then the content's); a reasoning-effort system message by default; a greeting or a mid-conversation
    # system message raises.
    TemplateCase("trl-Qwen3.8", False, None, "<|im_end|>", "<|endoftext|>", {k: FULL for k in ALL_ROWS}),
]
CASE = {c.name: c for c in CASES}


def original_template(case: Union[TemplateCase, str]) -> str:
    case = CASE[case] if isinstance(case, str) else case
    path = case.original_path
    if not path.is_file():
        if case.shared:
            raise AssertionError(
                f"the real chat template {path.name} is missing: expected the shared templates folder at "
                f"{path.parent.resolve()} (the 'shared' folder beside the repository root); set {SHARED_ENV} "
                "to the folder that holds the real *.jinja templates if it lives elsewhere"
            )
        raise AssertionError(f"the real chat template {path} is missing")
    return path.read_text(encoding="utf-8")


def marked_template(case: Union[TemplateCase, str]) -> str:
    case = CASE[case] if isinstance(case, str) else case
    return case.marked_path.read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------ tokenizer

MARKER_PATTERNS = (
    r"<\|[A-Za-z0-9_]+\|>",  # <|im_start|> <|eot_id|> <|user|> <|python_tag|> ...
    r"<｜[^｜'\"\s]+｜>",  # DeepSeek's full-width bars: <｜User｜> <｜tool▁calls▁begin｜> ...
    r"\[/?[A-Z][A-Z_]*\]",  # Mistral: [INST] [/INST] [TOOL_CALLS] [AVAILABLE_TOOLS] ...
    r"</?(?:start_of_turn|end_of_turn|tool_call|tool_response|tools|think)>",  # Gemma, Qwen, Hermes
)


def template_markers(template_text: str) -> list[str]:
    """The special markers a template writes, in order of first appearance."""
    found: dict[str, int] = {}
    for pattern in MARKER_PATTERNS:
        for m in re.finditer(pattern, template_text):
            found.setdefault(m.group(0), m.start())
    return sorted(found, key=found.get)


def _case_for(template_text: str) -> Optional[TemplateCase]:
    for case in CASES:
        for path in (case.original_path, case.marked_path):
            if path.is_file() and path.read_text(encoding="utf-8") == template_text:
                return case
    return None


_UNSET = object()


def build_tokenizer(template_text: str, bos_token=_UNSET, eos_token=_UNSET, pad_token=_UNSET, corpus: tuple = ()):
    """A real fast tokenizer (byte-level BPE trained here in milliseconds) for ``template_text``.

    Its added special tokens are every marker the template writes plus bos/eos/pad; bos/eos/pad default to
    what the model has when the template is one of CASES (original or marked), else to none.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    case = _case_for(template_text)
    bos = (case.bos if case else None) if bos_token is _UNSET else bos_token
    eos = (case.eos if case else None) if eos_token is _UNSET else eos_token
    pad = (case.pad if case else None) if pad_token is _UNSET else pad_token
    extra = list(case.specials) if case else []
    specials = list(dict.fromkeys([t for t in (bos, eos, pad) if t] + template_markers(template_text) + extra))

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [template_text, json.dumps(ROWS, ensure_ascii=False), *corpus]
    bpe.train_from_iterator(texts * 3, trainer)
    kwargs = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)) if v}
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, **kwargs)
    tok.chat_template = template_text
    return tok


# --------------------------------------------------------------------------------------- oracle


class OracleError(AssertionError):
    """The marked template does not mark one block per assistant turn: a bug in the marked copy."""


def _plain(messages: list[dict]) -> list[dict]:
    # What apply_chat_template does first: drop the keys whose value is None.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def render_marked(
    tokenizer, marked: str, messages: list[dict], tools: Optional[list]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation (no generation prompt) and the character span of each generation block."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = _plain(messages)
    rendered, indices = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=marked,
        return_assistant_tokens_mask=True,
        add_generation_prompt=False,
        **tokenizer.special_tokens_map,
    )
    text, spans = rendered[0], [tuple(s) for s in indices[0]]
    turns = sum(m["role"] == "assistant" for m in messages)
    if len(spans) != turns:
        raise OracleError(f"{len(spans)} generation blocks for {turns} assistant turns in {text!r}")
    return text, spans


def labelled(tokenizer, text: str, spans: list[tuple[int, int]]) -> dict[str, list[int]]:
    """Tokenize ``text`` in one pass; a token is trained when its characters overlap a span."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
        hit = any(a < e and s < max(b, a + 1) for s, e in spans if e > s)
        labels.append(token if hit else IGNORE_INDEX)
    return {"input_ids": list(enc["input_ids"]), "labels": labels}


PROBE_USER = {"role": "user", "content": "Next question."}


def oracle_spans(tokenizer, marked: str, messages: list[dict], tools: Optional[list], policy: str):
    """``[(text, trained_spans)]``, one per example of ``policy``."""
    if policy == "full":
        text, spans = render_marked(tokenizer, marked, messages, tools)
        if messages and messages[-1]["role"] == "assistant":  # its close, as a user message after it extends it
            text, last = _closed_by_next(tokenizer, marked, messages, tools, len(messages) - 1, text, spans)
            spans = spans[:-1] + last
        return [(text, spans)]
    if policy == "per_turn":
        out = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                text, spans = render_marked(tokenizer, marked, messages[: i + 1], tools)
                out.append(_closed_by_next(tokenizer, marked, messages, tools, i, text, spans))
        return out
    raise ValueError(f"policy must be 'full' or 'per_turn', got {policy!r}")


def _closed_by_next(
    tokenizer, marked: str, messages: list[dict], tools: Optional[list], i: int, text: str, spans: list
):
    """Turn i's per_turn example: ``messages[:i+1]`` rendered, trained on its block (the last one; earlier turns are
    context). Where the next message's rendering extends that block (Apertus's marked copy writes the
    `<|assistant_end|>` its template writes as a following user message's first text in the turn's block), the example
    is the next message's rendering cut at the block's end: the turn as the model writes it, stop included. A
    conversation's last message is followed by a probe user message (`PROBE_USER`) instead."""
    start, end = spans[-1]
    following_messages = messages[: i + 2] if i + 1 < len(messages) else messages[: i + 1] + [PROBE_USER]
    following, after = render_marked(tokenizer, marked, following_messages, tools)
    s, e = after[len(spans) - 1]
    if s == start and e > end and following.startswith(text[:end]):
        return following[:e], [(s, e)]
    # The following message may rewrite the turn (Hunyuan 3 drops an answer's reasoning once one follows): when it then
    # renders as the same message without reasoning does, that message's close is the turn's, after the turn's text.
    bare = [*messages[:i], _without_reasoning(messages[i])]
    if bare[-1] != messages[i]:
        try:  # a template may not take the message without its reasoning (Command A Reasoning: empty content, a call)
            bare_text, bare_spans = render_marked(tokenizer, marked, bare, tools)
            bare_following, bare_after = render_marked(tokenizer, marked, bare + following_messages[i + 1 :], tools)
        except OracleError:
            raise
        except Exception:  # noqa: BLE001 - then it is not rewritten into that message
            return text, spans[-1:]
        (bs, be), (s, e) = bare_spans[-1], bare_after[len(spans) - 1]
        if bare_following == following and s == bs and e > be and bare_text[be:] == text[end:]:
            if bare_following.startswith(bare_text[:be]):
                return text[:end] + bare_following[be:e], [(start, end + e - be)]
    return text, spans[-1:]


def _without_reasoning(message: dict) -> dict:
    """The message without reasoning: its reasoning keys, and a <think>...</think> block opening its content."""
    bare = {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning", "thinking")}
    content = bare.get("content") or ""
    if isinstance(content, str) and content.lstrip().startswith("<think>") and "</think>" in content:
        bare["content"] = content[content.rindex("</think>") + len("</think>") :].lstrip()
    return bare


def oracle_examples(
    tokenizer, marked_template: str, messages: list[dict], tools: Optional[list], policy: str
) -> list[dict]:
    """The examples phalanx must produce for ``messages`` (normalised, as to_conversation returns them)."""
    return [
        labelled(tokenizer, text, spans)
        for text, spans in oracle_spans(tokenizer, marked_template, messages, tools, policy)
    ]


def trained_texts(
    tokenizer, marked_template: str, messages: list[dict], tools: Optional[list], policy: str
) -> list[list[str]]:
    """The trained character spans' text, per example (what the expectations file pins)."""
    return [
        [text[s:e] for s, e in spans]
        for text, spans in oracle_spans(tokenizer, marked_template, messages, tools, policy)
    ]


def turns_render_alike(tokenizer, marked_template: str, messages: list[dict], tools: Optional[list]) -> bool:
    """Whether every assistant turn renders the same with and without what follows it ("auto" then picks "full")."""
    full = trained_texts(tokenizer, marked_template, messages, tools, "full")[0]
    per_turn = [spans[0] for spans in trained_texts(tokenizer, marked_template, messages, tools, "per_turn")]
    return full == per_turn


@lru_cache(maxsize=None)
def expected_trained() -> dict:
    """The hand-checked trained text of every matched (template, row), per policy."""
    return json.loads((HERE / "expected_trained.json").read_text(encoding="utf-8"))
