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
        "tool_calls": [{"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}],
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
            {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "{\"temp_c\": 18, \"sky\": \"clear\"}"},
            _answer("It is 18 °C and clear in Paris.", reasoning=r("The tool says 18 C."), think=t("The tool says 18 C.")),
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
        _answer("2 is the only even prime.", reasoning=r("Even and prime: only 2."), think=t("Even and prime: only 2.")),
        {"role": "user", "content": "Thanks."},
        # Leading spaces and a trailing newline: Llama and Gemma trim them, ChatML keeps them.
        _answer("  You're welcome!\n", reasoning=r("\nJust acknowledge.\n"), think=t("Just acknowledge.")),
    ]
    return {"messages": messages}


ROWS = {
    "tool": _tool_row(),
    "plain": _plain_row(),
    "nosys": _plain_row(system=False),
    "reasoning": _plain_row(reasoning=True),  # reasoning_content on every assistant message
    "reasoning_tool": _tool_row(reasoning=True),
    "think": _plain_row(think=True),  # the reasoning inside content, as <think>...</think>
    "think_tool": _tool_row(think=True),
}


def row(kind: str) -> dict:
    """A fresh copy of a test row (raw, as users write it)."""
    return json.loads(json.dumps(ROWS[kind]))


# -------------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class Match:
    """phalanx must produce the oracle's examples; ``auto`` is the policy multi_turn="auto" must choose."""

    auto: str


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

    @property
    def original_path(self) -> Path:
        return (shared_templates_dir() if self.shared else REAL) / f"{self.name}.jinja"

    @property
    def marked_path(self) -> Path:
        return (HERE if self.shared else REAL) / f"{self.name}.marked.jinja"


FULL, PER_TURN = Match("full"), Match("per_turn")
# The vanished tool call (messages[2]) must be named, with the function it calls.
VANISHED_CALL = Refuse(r"messages\[2\].*get_weather|get_weather.*messages\[2\]", "the template drops the tool call")

# bos/eos/pad as each model's tokenizer_config.json has them. Row expectations:
# - R1-Distill renders a tool call only when content is None (to_conversation passes ""), so the call vanishes;
#   Phi-3.5 has no tool support at all (drops tool calls and tool messages).
# - Qwen3 renders the empty (or the reasoning's) think block only after the last user query and drops
#   earlier reasoning: every row is per_turn. QwQ strips <think>...</think> from all but the last turn.
# - Gemma 2 raises on a system message; Hermes' tool_use template iterates over tools (None without them).
# - Mistral Nemo drops the system prompt unless a user turn is last, and moves the tools before the last
#   user message: the assistant turns render the same, so "full".
CASES = [
    TemplateCase(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", True, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
        {"plain": FULL, "nosys": FULL, "tool": VANISHED_CALL},
    ),
    TemplateCase("Qwen-Qwen2.5-7B-Instruct", True, None, "<|im_end|>", "<|endoftext|>", {"plain": FULL, "nosys": FULL, "tool": FULL}),
    TemplateCase(
        "Qwen-Qwen3-0.6B", True, None, "<|im_end|>", "<|endoftext|>",
        {k: PER_TURN for k in ("plain", "nosys", "tool", "reasoning", "reasoning_tool", "think", "think_tool")},
    ),
    TemplateCase("meta-llama-Llama-3.1-8B-Instruct", True, "<|begin_of_text|>", "<|eot_id|>", None, {"plain": FULL, "nosys": FULL, "tool": FULL}),
    TemplateCase(
        "microsoft-Phi-3.5-mini-instruct", True, "<s>", "<|endoftext|>", "<|endoftext|>",
        {"plain": FULL, "nosys": FULL, "tool": VANISHED_CALL},
    ),
    TemplateCase("mistralai-Mistral-Nemo-Instruct-2407", True, "<s>", "</s>", None, {"plain": FULL, "nosys": FULL, "tool": FULL}),
    # ---- tests/data/templates/real/
    TemplateCase(
        "google-gemma-2-2b-it", False, "<bos>", "<eos>", "<pad>",
        {
            "nosys": FULL,
            "plain": Refuse("System role not supported", "the template raises on a system message"),
            "tool": Refuse("System role not supported", "the template raises on a system message"),
        },
    ),
    TemplateCase(
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", False, "<|begin_of_text|>", "<|im_end|>", None,
        {
            "tool": FULL,
            "plain": Refuse("not iterable", "the tool_use template loops over tools, which are None without tools"),
            "nosys": Refuse("not iterable", "the tool_use template loops over tools, which are None without tools"),
        },
    ),
    TemplateCase(
        "Qwen-QwQ-32B", False, None, "<|im_end|>", "<|endoftext|>",
        {"plain": FULL, "nosys": FULL, "tool": FULL, "think": PER_TURN, "think_tool": PER_TURN},
    ),
    TemplateCase("meta-llama-Llama-3.2-3B-Instruct", False, "<|begin_of_text|>", "<|eot_id|>", None, {"plain": FULL, "nosys": FULL, "tool": FULL}),
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
    specials = list(dict.fromkeys([t for t in (bos, eos, pad) if t] + template_markers(template_text)))

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


def render_marked(tokenizer, marked: str, messages: list[dict], tools: Optional[list]) -> tuple[str, list[tuple[int, int]]]:
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


def oracle_spans(tokenizer, marked: str, messages: list[dict], tools: Optional[list], policy: str):
    """``[(text, trained_spans)]``, one per example of ``policy``."""
    if policy == "full":
        text, spans = render_marked(tokenizer, marked, messages, tools)
        return [(text, spans)]
    if policy == "per_turn":
        out = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                text, spans = render_marked(tokenizer, marked, messages[: i + 1], tools)
                out.append((text, spans[-1:]))  # turn i's block is the last one; earlier turns are context
        return out
    raise ValueError(f"policy must be 'full' or 'per_turn', got {policy!r}")


def oracle_examples(tokenizer, marked_template: str, messages: list[dict], tools: Optional[list], policy: str) -> list[dict]:
    """The examples phalanx must produce for ``messages`` (normalised, as to_conversation returns them)."""
    return [labelled(tokenizer, text, spans) for text, spans in oracle_spans(tokenizer, marked_template, messages, tools, policy)]


def trained_texts(tokenizer, marked_template: str, messages: list[dict], tools: Optional[list], policy: str) -> list[list[str]]:
    """The trained character spans' text, per example (what the expectations file pins)."""
    return [[text[s:e] for s, e in spans] for text, spans in oracle_spans(tokenizer, marked_template, messages, tools, policy)]


def turns_render_alike(tokenizer, marked_template: str, messages: list[dict], tools: Optional[list]) -> bool:
    """Whether every assistant turn renders the same with and without what follows it ("auto" then picks "full")."""
    full = trained_texts(tokenizer, marked_template, messages, tools, "full")[0]
    per_turn = [spans[0] for spans in trained_texts(tokenizer, marked_template, messages, tools, "per_turn")]
    return full == per_turn


@lru_cache(maxsize=None)
def expected_trained() -> dict:
    """The hand-checked trained text of every matched (template, row), per policy."""
    return json.loads((HERE / "expected_trained.json").read_text(encoding="utf-8"))
