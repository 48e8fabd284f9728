"""The loss mask covers exactly the assistant turns, whatever the chat template, and nothing else."""

from __future__ import annotations

import copy

import pytest

from helpers import chatml_bpe_tokenizer, trained_runs
from phalanx.data.chat import IGNORE_INDEX, tokenize_conversation
from phalanx.data.collate import pad_batch
from phalanx.data.formats import to_conversation
from phalanx.errors import DataError

WHERE = "train.jsonl line 3"


def exchange(*turns: str | tuple[str, str]) -> dict:
    """A row of messages taking turns, the user's first; an assistant turn given as (content, reasoning) carries its
    reasoning as reasoning_content."""
    messages = []
    for i, turn in enumerate(turns):
        content, reasoning = turn if isinstance(turn, tuple) else (turn, None)
        message = {"role": ("user", "assistant")[i % 2], "content": content}
        messages.append({**message, "reasoning_content": reasoning} if reasoning is not None else message)
    return {"messages": messages}


def weather_call_row(arguments: dict) -> dict:
    """A question, a get_weather call (no content), its result and the answer."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ]
    }


def masked(tok, row: dict):
    """The row tokenized with `tok`'s template, and the trained text of its first example, run by run."""
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    return result, target_runs(tok, result.examples[0])


# Llama-3 style: header tokens, tool calls as {"name", "parameters"} JSON, tool results as ipython.
LLAMA3 = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Functions: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}"
    "{{ {'name': tc.function.name, 'parameters': tc.function.arguments} | tojson }}{% endfor %}"
    "{% else %}{{ m.content | trim }}{% endif %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# [INST] style: no generation prompt at all, the answer is followed by the EOS special token.
INST = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<<SYS>>{{ m.content }}<</SYS>>"
    "{% elif m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unsupported role ' + m.role) }}{% endif %}"
    "{% endfor %}"
)


def one(tokenized):
    """The single row a conversation became under multi_turn 'full' (or a text row)."""
    assert tokenized.policy in ("full", "text") and len(tokenized.examples) == 1, tokenized
    return tokenized.examples[0]


target_runs = trained_runs


CHATML_TARGETS = [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n',
    "ASSISTANT-ONE It is 18C.<|im_end|>\n",
    "ASSISTANT-TWO You're welcome.<|im_end|>\n",
]


def _assert_only_assistant(text: str):
    for other in ("SYSTEM-TEXT", "USER-ONE", "USER-TWO", "TOOL-RESULT", 'get_weather", "description'):
        assert other not in text


def test_chatml_multi_turn_tool_calls_mask_exactly_the_assistant_turns(tokenizer, tool_row):
    conv = to_conversation(tool_row, WHERE)
    result = one(tokenize_conversation(tokenizer, conv, WHERE))
    assert target_runs(tokenizer, result) == CHATML_TARGETS
    _assert_only_assistant("".join(target_runs(tokenizer, result)))
    # The input is exactly the template's text: tools rendered, no special token added (no BOS/EOS twice).
    rendered = tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
    assert tokenizer.decode(result["input_ids"]) == rendered
    assert '# Tools\n{"type": "function"' in rendered
    assert tokenizer.eos_token_id not in result["input_ids"]
    assert not tokenize_conversation(tokenizer, conv, WHERE).tools_dropped


def test_a_different_template_masks_correctly_too(make_tokenizer, tool_row):
    tok = make_tokenizer(LLAMA3)
    result = one(tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE))
    assert target_runs(tok, result) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "ASSISTANT-ONE It is 18C.<|eot_id|>",
        "ASSISTANT-TWO You're welcome.<|eot_id|>",
    ]
    assert tok.decode(result["input_ids"]).startswith(
        "<|start_header_id|>system<|end_header_id|>\n\nFunctions: get_weather"
    )


def test_inst_template_without_generation_prompt_trains_on_answer_and_eos(make_tokenizer):
    tok = make_tokenizer(INST)
    row = {
        "conversations": [
            {"from": "system", "value": "SYSTEM-TEXT"},
            {"from": "human", "value": "USER-ONE"},
            {"from": "gpt", "value": "ASSISTANT-ONE"},
            {"from": "human", "value": "USER-TWO"},
            {"from": "gpt", "value": "ASSISTANT-TWO"},
        ]
    }
    result = one(tokenize_conversation(tok, to_conversation(row, WHERE), WHERE))
    assert target_runs(tok, result) == [" ASSISTANT-ONE</s>", " ASSISTANT-TWO</s>"]
    assert result["labels"][-1] == tok.eos_token_id  # EOS is a real special token here, and a target


def test_alpaca_row_through_chatml(tokenizer):
    conv = to_conversation({"instruction": "Add", "input": "1 and 2", "output": "3", "system": "math"}, WHERE)
    result = one(tokenize_conversation(tokenizer, conv, WHERE))
    assert target_runs(tokenizer, result) == ["3<|im_end|>\n"]


@pytest.fixture
def fast_tokenizer(chatml, tool_row):
    """A real fast (Rust) byte-level BPE tokenizer, trained here in milliseconds, with special tokens."""
    import json

    tok = chatml_bpe_tokenizer([chatml, json.dumps(tool_row)] * 5)
    tok.chat_template = chatml
    return tok


def test_fast_tokenizer_uses_offsets_and_masks_the_same_text(fast_tokenizer, tool_row):
    assert fast_tokenizer.is_fast
    conv = to_conversation(tool_row, WHERE)
    result = one(tokenize_conversation(fast_tokenizer, conv, WHERE))
    assert target_runs(fast_tokenizer, result) == CHATML_TARGETS
    # One pass over the whole text: the ids are what inference would see.
    rendered = fast_tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
    assert result["input_ids"] == fast_tokenizer(rendered, add_special_tokens=False)["input_ids"]


NUMBERED = "<conversation of {{ messages | length }} messages>\n"  # rewrites the start whenever a turn is added


def test_template_that_rewrites_other_text_trains_on_the_whole_rendering(make_tokenizer, chatml, tool_row):
    """Each turn's view differs from the whole rendering at its first line; the outputs are found all the same."""
    tok = make_tokenizer(NUMBERED + chatml)
    result = tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)
    assert result.policy == "full"
    assert target_runs(tok, result.examples[0]) == CHATML_TARGETS
    assert tok.decode(result.examples[0]["input_ids"]).startswith("<conversation of 7 messages>")


def test_generation_prompt_that_does_not_match_assistant_turns_is_refused(make_tokenizer, chatml, tool_row):
    tok = make_tokenizer(
        chatml.replace(
            "{% if add_generation_prompt %}<|im_start|>assistant", "{% if add_generation_prompt %}<|im_start|>model"
        )
    )
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)
    msg = str(info.value)
    assert msg.startswith(
        f"{WHERE}: messages[2] (assistant): the chat template's generation prompt (add_generation_prompt=True)"
    )
    assert "<|im_start|>model" in msg and "<|im_start|>assistant" in msg  # where the renderings part


def test_tokenizer_without_chat_template(make_tokenizer, tool_row):
    with pytest.raises(DataError, match=rf"^{WHERE}: the tokenizer \(ByT5Tokenizer\) has no chat template"):
        tokenize_conversation(make_tokenizer(None), to_conversation(tool_row, WHERE), WHERE)


def test_template_errors_become_data_errors(make_tokenizer, tool_row):
    with pytest.raises(DataError, match=rf"^{WHERE}: the chat template failed .*unsupported role tool") as info:
        tokenize_conversation(make_tokenizer(INST), to_conversation(tool_row, WHERE), WHERE)
    assert str(info.value).endswith(
        "change the row to what it accepts (its error says what: a role it lacks, the order "
        "of roles, a missing field) or use a template that takes it (--chat_template FILE|NAME)"
    )


def test_a_template_that_does_not_compile_is_blamed_not_the_row(make_tokenizer, chatml, chat_row):
    """A tokenizer's own template with a block closed by the wrong end tag (a copy of MiroThinker-v1's leaves an `if`
    open inside a `for`) fails on every row before it renders anything: the refusal told the user to change the row."""
    broken = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}\n{% endfor %}" + chatml
    with pytest.raises(DataError) as info:
        tokenize_conversation(make_tokenizer(broken), to_conversation(chat_row(1), WHERE), WHERE)
    message = str(info.value)
    assert message.startswith(
        f"{WHERE}: the chat template is not valid jinja (line 2: Encountered unknown tag 'endfor'. You probably made "
        "a nesting mistake."
    )
    assert "innermost block that needs to be closed is 'if'" in message
    assert "the fault is in the template's text, not in the row" in message and "change the row" not in message
    assert message.endswith("or use one that compiles (--chat_template FILE|NAME)")


@pytest.mark.parametrize(
    "needs,missing",
    [
        ("{% set seen = [] %}{% for m in messages %}{% set _ = seen.append(m.role) %}{% endfor %}", "append"),
        ("{{ today() }}", "it reads 'today', which transformers' apply_chat_template does not define"),
        ("{% if messages is nonempty %}{% endif %}", "it uses the jinja test 'nonempty', which transformers"),
        ("{{ messages[0].content | from_json }}", "it uses the jinja filter 'from_json', which transformers"),
        ("{{ messages | map(attribute='role') | tojson }}", "it hands tojson a generator (jinja's map, select"),
        (
            "{% for m in messages %}{% set m.seen = true %}{% endfor %}",  # MiroThinker-v1 marks messages so
            "it sets an attribute of a message, a tool or another mapping ({% set x.name = ... %}), which jinja allows "
            "only on an object made with namespace()",
        ),
    ],
)
def test_a_template_that_needs_what_transformers_lacks_is_named_with_what_it_lacks(
    make_tokenizer, chatml, chat_row, needs, missing
):
    """Templates written for another engine (llama.cpp's minja, vLLM) fail on every row: the refusal names the
    template (the --chat_template value it was loaded with, else the model's) and what transformers does not have."""
    tok = make_tokenizer(needs + chatml)
    tok.chat_template_source = "mine.jinja"  # as phalanx.models.load records --chat_template
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE)
    message = str(info.value)
    assert message.startswith(f"{WHERE}: the chat template 'mine.jinja' (data.chat_template) cannot be rendered by")
    assert missing in message and "transformers renders chat templates in a sandboxed jinja2 environment" in message

    del tok.chat_template_source
    with pytest.raises(DataError, match=rf"^{WHERE}: the chat template of ByT5Tokenizer cannot be rendered"):
        tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE)


def test_a_template_that_needs_what_transformers_lacks_only_for_tools_blames_the_tools(
    make_tokenizer, chatml, tool_row
):
    """llama.cpp's DeepSeek-R1 template writes `tools | map(...) | tojson` only when a row has tools: the refusal blamed
    messages[0], which renders without them."""
    tok = make_tokenizer("{% if tools %}{{ tools | map(attribute='function') | tojson }}{% endif %}" + chatml)
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)
    assert str(info.value).startswith(
        f"{WHERE}: the chat template of ByT5Tokenizer fails on the row's tools: it hands tojson a generator"
    )
    assert "renders the same messages without them" in str(info.value) and "messages[0]" not in str(info.value)


def test_a_template_that_needs_what_transformers_lacks_only_on_some_rows_refuses_the_row_not_the_template(
    make_tokenizer, chatml, chat_row
):
    """Hunyuan-A13B calls dict.update only when the first message is empty: rows without one render, so the refusal
    names the message that takes that path and says to change the row, not that the template cannot be rendered."""
    needs = (
        "{% set context = {'has_head': true} %}"
        "{% if messages[0].content == '' %}{% set _ = context.update({'has_head': false}) %}{% endif %}"
    )
    tok = make_tokenizer(needs + chatml)
    assert tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE).policy == "full"
    row = chat_row(1)
    row["messages"].insert(0, {"role": "system", "content": ""})
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    message = str(info.value)
    assert message.startswith(
        f"{WHERE}: the chat template of ByT5Tokenizer fails on messages[0] (system; roles so far: system): it does "
        "something the sandbox forbids (access to attribute 'update' of 'dict' object is unsafe.)"
    )
    assert "It renders a plain user and assistant exchange" in message and "change the row to avoid it" in message
    assert "cannot be rendered by transformers" not in message


def test_a_template_that_reads_a_variable_nothing_sets_is_refused_saying_how_to_give_it(
    make_tokenizer, chatml, chat_row
):
    """firefunction v2 writes `... + functions + ... + datetime`, which its callers pass to apply_chat_template: the
    refusal says to give them with data.chat_template_kwargs (not that transformers lacks them), and so they render."""
    tok = make_tokenizer("{{ 'Functions: ' + functions }}" + chatml)
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE)
    message = str(info.value)
    assert message.startswith(f"{WHERE}: the chat template reads the variable 'functions', which nothing sets")
    assert "Give it with data.chat_template_kwargs (--chat_template_kwargs '{functions: ...}'" in message
    assert "does not define" not in message and "cannot be rendered by transformers" not in message
    given = tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE, template_kwargs={"functions": "[]"})
    assert given.policy == "full"


def test_a_template_that_fails_on_the_rows_tools_is_refused_saying_so(make_tokenizer, chatml, tool_row):
    """Command R+'s tool_use template writes `'): ' + param_fields.description` for each parameter: tools whose
    parameters have none fail with "'dict object' has no attribute 'description'". The same messages render without
    the tools, so the refusal points at the tools, not at the roles or messages."""
    needs = "{% for t in tools or [] %}{% for k, v in t.function.parameters.properties | items %}{{ k + ': ' + v.description }}{% endfor %}{% endfor %}"
    tok = make_tokenizer(needs + chatml)
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)
    message = str(info.value)
    assert message.startswith(
        f"{WHERE}: the chat template of ByT5Tokenizer fails on the row's tools (UndefinedError: 'dict object' has no "
        "attribute 'description') and renders the same messages without them"
    )
    assert 'Give the row\'s "tools" what the template reads' in message
    tool_row["tools"][0]["function"]["parameters"]["properties"]["city"]["description"] = "City name"
    assert tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE).policy == "full"


def test_a_template_that_tests_tools_is_defined_is_refused_as_written_for_another_renderer(
    make_tokenizer, chatml, chat_row
):
    """llama.cpp's Phi-4-mini template writes its tools when `tools is defined`, as llama.cpp leaves them undefined
    for a row without tools; transformers passes tools=None, so every such row fails on the loop. It was refused as a
    "tool_use" template written for conversations with tools (Hermes'), which it is not."""
    tok = make_tokenizer(
        "{% if tools is defined %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}" + chatml
    )
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE)
    message = str(info.value)
    assert "fails on a row without tools (TypeError: 'NoneType' object is not iterable)" in message
    assert "tests `tools is defined`, which transformers makes true for every row (it passes tools=None" in message
    assert "llama.cpp's" in message and "tool_use" not in message


def test_a_template_that_reads_a_special_token_the_tokenizer_lacks_is_refused_naming_the_token(
    make_tokenizer, chatml, chat_row
):
    """functionary writes `bos_token + ...`: with a tokenizer that has no bos (ByT5's, Qwen's) every row fails. The
    refusal says the tokenizer lacks it, not that transformers does (it hands a template the tokenizer's tokens)."""
    tok = make_tokenizer("{{ bos_token + '' }}" + chatml)
    assert tok.bos_token is None
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE)
    message = str(info.value)
    assert message.startswith(f"{WHERE}: the chat template reads bos_token, which this tokenizer does not")
    assert "use the tokenizer of the model it belongs to (--model_name)" in message
    assert "transformers' apply_chat_template does not define" not in message
    # Given as a template variable, as the refusal says, the rows render (the text is then ordinary tokens).
    assert "--chat_template_kwargs '{bos_token: \"...\"}'" in message
    kwargs = {"bos_token": "<s>"}
    given = tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE, template_kwargs=kwargs)
    assert given.policy == "full" and tok.decode(given.examples[0]["input_ids"]).startswith("<s>")
    tok.add_special_tokens({"bos_token": "<s>"})  # the same template renders once the tokenizer has one
    assert tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE).policy == "full"


def test_plain_text_trains_on_every_token_and_ends_with_eos(make_tokenizer):
    tok = make_tokenizer(None)  # text rows need no chat template
    result = one(tokenize_conversation(tok, to_conversation({"text": "héllo world"}, WHERE), WHERE))
    assert result["labels"] == result["input_ids"]
    assert result["input_ids"][-1] == tok.eos_token_id and result["input_ids"].count(tok.eos_token_id) == 1
    assert tok.decode(result["input_ids"]) == "héllo world</s>"


def test_pad_batch_right_pads_to_the_longest():
    batch = pad_batch(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], pad_token_id=0
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert {t.dtype for t in batch.values()} == {__import__("torch").long}


# ---------------------------------------------------------------------------- templates that are not prefix-stable

# Qwen3's habit: the think block is rendered only for assistant turns after the last user message.
REWRITES_PAST_TURNS = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user %}<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REASONING_ROW = {
    "messages": [
        {"role": "user", "content": "USER-ONE"},
        {"role": "assistant", "content": "ANSWER-ONE", "reasoning_content": "WHY-ONE"},
        {"role": "user", "content": "USER-TWO"},
        {"role": "assistant", "content": "ANSWER-TWO", "reasoning_content": "WHY-TWO"},
    ]
}


def test_template_that_rewrites_past_turns_trains_one_row_per_turn(make_tokenizer):
    tok = make_tokenizer(REWRITES_PAST_TURNS)
    conv = to_conversation(REASONING_ROW, WHERE)
    result = tokenize_conversation(tok, conv, WHERE)  # auto
    assert result.policy == "per_turn" and result.reasoning_dropped == 0
    assert "messages[1] (assistant): it renders differently once later messages follow it" in result.notes[0]
    first, second = result.examples
    assert target_runs(tok, first) == ["<think>\nWHY-ONE\n</think>\n\nANSWER-ONE<|im_end|>\n"]
    assert target_runs(tok, second) == ["<think>\nWHY-TWO\n</think>\n\nANSWER-TWO<|im_end|>\n"]
    # The second row's context is the first turn as the template renders it later: reasoning gone, not trained.
    assert tok.decode(second["input_ids"]).startswith(
        "<|im_start|>user\nUSER-ONE<|im_end|>\n<|im_start|>assistant\nANSWER-ONE<|im_end|>\n<|im_start|>user\nUSER-TWO"
    )
    assert tokenize_conversation(tok, conv, WHERE, "per_turn").examples == result.examples
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, conv, WHERE, "full")
    msg = str(info.value)
    assert msg.startswith(f"{WHERE}: multi_turn 'full': messages[1] (assistant): it renders differently")
    assert "WHY-ONE" in msg and "multi_turn 'per_turn'" in msg


def test_reasoning_the_template_does_not_render_is_counted(tokenizer):
    result = tokenize_conversation(tokenizer, to_conversation(REASONING_ROW, WHERE), WHERE)
    assert result.policy == "full" and result.reasoning_dropped == 2
    assert target_runs(tokenizer, result.examples[0]) == ["ANSWER-ONE<|im_end|>\n", "ANSWER-TWO<|im_end|>\n"]


# DeepSeek-R1-Distill's habit: the generation prompt pre-fills "<think>\n", the finished turn has no think block,
# and reasoning before </think> is cut from the content.
PREFILLS_THINK = (
    "{% for m in messages %}{% if m.role == 'user' %}<U>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<A>{{ m.content.split('</think>')[-1] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<A><think>\n{% endif %}"
)


def test_generation_prompt_that_prefills_the_answer_trains_from_the_header(make_tokenizer):
    result, runs = masked(
        make_tokenizer(PREFILLS_THINK), exchange("Q1", "<think>\nhmm</think>A1", "Q2", "<think>\nunclosed")
    )
    assert result.policy == "full" and result.reasoning_dropped == 1
    # "<think>\n" at the start of the second answer is the answer's own text, though the prompt pre-fills the same.
    assert runs == ["A1</s>", "<think>\nunclosed</s>"]


# Phi-3.5's habit: an end-of-text token after the last turn, only without a generation prompt; it shares "<"
# with the next header, so the part position falls inside it and snaps back to its start.
TRAILER = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)


def test_conversation_trailer_is_not_trained(make_tokenizer, chat_row):
    tok = make_tokenizer(TRAILER)
    row = {
        "messages": chat_row(1)["messages"]
        + [{"role": "user", "content": "again"}, {"role": "assistant", "content": "B"}]
    }
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    example = result.examples[0]
    assert target_runs(tok, example) == ["fine 1<|end|>\n", "B<|end|>\n"]
    assert example["input_ids"][-1] == tok.eos_token_id and example["labels"][-1] == IGNORE_INDEX


def test_an_end_of_turn_marker_the_tokenizer_lacks_is_counted_unless_a_stop_is_trained(make_tokenizer):
    """Llama 3's <|eot_id|> through a byte-level tokenizer is ten ordinary tokens, and the tokenizer's end-of-sequence
    token is trained nowhere: generation never stops. Counted per marker (the data summary says so); not when the turn
    trains the end-of-sequence token ([INST]'s eos_token) or the tokenizer has the marker as a token."""
    row = exchange("Q1", "A1", "Q2", "A2")
    assert masked(make_tokenizer(LLAMA3), row)[0].foreign_end_markers == {"<|eot_id|>": 2}
    assert masked(make_tokenizer(INST), row)[0].foreign_end_markers == {}
    own = make_tokenizer(LLAMA3)
    own.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    assert masked(own, row)[0].foreign_end_markers == {}


def test_an_end_of_turn_token_that_is_not_the_end_of_sequence_token_is_counted(make_tokenizer, chatml):
    """A base model's tokenizer (Qwen2.5's: eos <|endoftext|>) under ChatML: every answer ends with <|im_end|>, a token
    of its own. Counted per token (whether the model stops at it is its generation config's to say); not where it is
    the end-of-sequence token, and never as a marker the tokenizer lacks."""
    row = exchange("Q1", "A1", "Q2", "A2")
    base = make_tokenizer(chatml)
    base.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    result = masked(base, row)[0]
    assert result.end_tokens == {"<|im_end|>": 2} and result.foreign_end_markers == {}
    per_turn = tokenize_conversation(base, to_conversation(row, WHERE), WHERE, "per_turn")
    assert per_turn.policy == "per_turn" and per_turn.end_tokens == {"<|im_end|>": 2}
    instruct = make_tokenizer(chatml)
    instruct.add_special_tokens({"eos_token": "<|im_end|>"})
    assert masked(instruct, row)[0].end_tokens == {}


# Llama 3.1's (and functionary v3.1's) habit: a tool call ends with <|eom_id|>, an answer with <|eot_id|>.
LLAMA3_EOM = LLAMA3.replace(
    "{% else %}{{ m.content | trim }}{% endif %}<|eot_id|>",
    "<|eom_id|>{% else %}{{ m.content | trim }}<|eot_id|>{% endif %}",
)


def test_a_tool_call_ended_by_another_token_than_an_answer_counts_that_token(make_tokenizer, tool_row):
    """functionary v3.1 ends a tool call with <|eom_id|>, a plain message with <|eot_id|> (the end-of-sequence token):
    the turn's own text was taken to end where the two renderings part, inside the marker (`_id|>` is common to both),
    so no marker was found after it and <|eom_id|> went uncounted (nothing said the model might never stop there)."""
    tok = make_tokenizer(LLAMA3_EOM)
    tok.add_special_tokens({"eos_token": "<|eot_id|>", "additional_special_tokens": ["<|eom_id|>"]})
    result, runs = masked(tok, tool_row)
    assert runs[0].endswith("<|eom_id|>") and runs[-1].endswith("<|eot_id|>")
    assert result.end_tokens == {"<|eom_id|>": 1} and result.unterminated == 0


# Cohere2's habit: the generation prompt opens a thinking block, a finished turn without reasoning opens its text
# instead; the two part inside a marker this (byte-level) tokenizer does not have as a token.
OPENS_ANOTHER_MARKER = (
    "{% for m in messages %}<|TURN|>{% if m.role == 'user' %}<|USER|>{{ m.content }}{% else %}<|BOT|>"
    "{% if m.reasoning_content %}<|START_THINKING|>{{ m.reasoning_content }}<|END_THINKING|>{% endif %}"
    "<|START_TEXT|>{{ m.content }}<|END_TEXT|>{% endif %}<|END_OF_TURN|>{% endfor %}"
    "{% if add_generation_prompt %}<|TURN|><|BOT|><|START_THINKING|>{% endif %}"
)


def test_a_turn_that_parts_from_the_prompt_inside_a_marker_trains_the_whole_marker(make_tokenizer):
    """The output started where the two renderings part, `<|START_T` | `EXT|>`: the model was taught to finish a
    marker it never saw begin. It starts at the marker, whether or not the tokenizer has it as one token."""
    _, runs = masked(make_tokenizer(OPENS_ANOTHER_MARKER), exchange("Q1", "A1", "Q2", "A2"))
    assert runs == ["<|START_TEXT|>A1<|END_TEXT|><|END_OF_TURN|>", "<|START_TEXT|>A2<|END_TEXT|><|END_OF_TURN|>"]


# Mistral's habit: no assistant header, the system prompt written only into a last user message (so never in a
# conversation that ends with an answer).
SYSTEM_IN_LAST_USER = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST]"
    "{% if loop.last and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content }}</s>{% endif %}{% endfor %}"
)


def test_system_prompt_moved_or_dropped_by_the_template(make_tokenizer, tools):
    tok = make_tokenizer(SYSTEM_IN_LAST_USER)
    row = {
        "tools": tools,
        "messages": [
            {"role": "system", "content": "SYSTEM-TEXT"},
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "OK"},
            {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "OK"},
        ],
    }
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert result.policy == "full" and result.system_dropped and result.tools_dropped  # this template writes no tools
    assert tok.decode(result.examples[0]["input_ids"]) == "[INST]U1[/INST]OK</s>[INST]U2[/INST]OK</s>"
    assert target_runs(tok, result.examples[0]) == ["OK</s>", "OK</s>"]


def test_identical_answers_are_located_at_their_own_turns(make_tokenizer, chatml):
    """The views differ from the whole rendering, and the same output occurs twice: each turn gets its own."""
    tok = make_tokenizer(NUMBERED + chatml)
    row = exchange("U1", "OK", "OK", "OK")
    example = one(tokenize_conversation(tok, to_conversation(row, WHERE), WHERE))
    text = tok.decode(example["input_ids"])
    trained = "".join("^" if label != IGNORE_INDEX else "." for label in example["labels"])
    assert text == (
        "<conversation of 4 messages>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nOK<|im_end|>\n"
        "<|im_start|>user\nOK<|im_end|>\n<|im_start|>assistant\nOK<|im_end|>\n"
    )
    first = text.index("assistant\nOK") + len("assistant\n")
    second = text.rindex("assistant\nOK") + len("assistant\n")
    expected = ["."] * len(text)
    for start in (first, second):
        expected[start : start + len("OK<|im_end|>\n")] = "^" * len("OK<|im_end|>\n")
    assert trained == "".join(expected)  # ByT5: one token per character here


def test_template_that_drops_tool_calls_or_arguments_is_refused(make_tokenizer, chatml, tool_row):
    no_calls = chatml.replace("{% for tc in m.tool_calls or [] %}", "{% for tc in [] %}")
    with pytest.raises(
        DataError,
        match=r"^train.jsonl line 3: messages\[2\]\.tool_calls\[0\]: the chat template dropped "
        r"the tool call's name 'get_weather'",
    ):
        tokenize_conversation(make_tokenizer(no_calls), to_conversation(tool_row, WHERE), WHERE)
    # One with no tool-call format at all (Phi-3.5's, Gemma 2's) is said to be so, with the ways on.
    plain = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(DataError, match=r"name 'get_weather'.*This template never reads tool_calls.*--on_bad_row skip"):
        tokenize_conversation(make_tokenizer(plain), to_conversation(tool_row, WHERE), WHERE)
    # One that writes the first call only (GigaChat 3): the second of two parallel calls is said to be the one too many.
    first_only = chatml.replace("{% for tc in m.tool_calls or [] %}", "{% for tc in (m.tool_calls or [])[:1] %}")
    parallel = copy.deepcopy(tool_row)
    call = parallel["messages"][2]["tool_calls"][0]
    parallel["messages"][2]["tool_calls"].append({**call, "function": {**call["function"], "name": "get_time"}})
    with pytest.raises(
        DataError, match=r"tool_calls\[1\]: .*name 'get_time'.*It writes the turn's first 1 call, not this one"
    ):
        tokenize_conversation(make_tokenizer(first_only), to_conversation(parallel, WHERE), WHERE)
    parallel["messages"][2]["tool_calls"][1] = {
        **call,
        "function": {**call["function"], "arguments": '{"city": "Rome"}'},
    }
    with pytest.raises(DataError, match=r"tool_calls\[1\]: .*argument 'Rome'.*It writes the turn's first 1 call, not"):
        tokenize_conversation(make_tokenizer(first_only), to_conversation(parallel, WHERE), WHERE)
    no_arguments = chatml.replace("{{ tc.function.arguments | tojson }}", "{}")
    with pytest.raises(DataError, match=r"dropped the tool call's argument 'city'"):
        tokenize_conversation(make_tokenizer(no_arguments), to_conversation(tool_row, WHERE), WHERE)
    no_content = chatml.replace("<|im_start|>assistant\n{{ m.content }}", "<|im_start|>assistant\n")
    with pytest.raises(
        DataError, match=r"messages\[4\] \(assistant\): the chat template dropped its content \('ASSISTANT-ONE"
    ):
        tokenize_conversation(make_tokenizer(no_content), to_conversation(tool_row, WHERE), WHERE)


def test_content_a_template_renders_only_in_part_is_refused_naming_the_part_it_drops():
    """MiniCPM5's template places each call at a `<tool_sep>` in the message's text, building the text in a `for` whose
    `set`s do not last: it writes the text before the first separator and drops the rest. The refusal said the template
    dropped the whole content, while the rendered turn it quotes begins with that text; it now names what is kept and
    what is dropped (and, with nothing of it kept, the content as before)."""
    from data.templates import REAL, build_tokenizer

    tok = build_tokenizer((REAL / "openbmb-MiniCPM5-1B.jinja").read_text(encoding="utf-8"))
    row = weather_call_row({"city": "Paris"})
    row["messages"][1]["content"] = "Let me check.<tool_sep> Then I answer."
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert str(info.value).startswith(
        f"{WHERE}: messages[1] (assistant): the chat template dropped part of its content: it renders "
        "'Let me check.' and drops what follows ('<tool_sep> Then I answer.'): the rendered turn reads "
        '\'Let me check.\\n<function name="get_weather">'
    ), str(info.value)
    row["messages"][1]["content"] = "<tool_sep>"
    with pytest.raises(
        DataError, match=r"messages\[1\] \(assistant\): the chat template dropped its content \('<tool_sep>'\)"
    ):
        tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)


def test_a_template_that_needs_a_tool_message_name_gets_the_function_its_call_id_names():
    """OpenAI's tool messages name only the call they answer (`tool_call_id`); FunctionGemma's template raises
    "Invalid tool response: 'name' must be provided" without a `name`, and every such row was refused as one to change.
    Where the template raises, the row is rendered again with each tool message named after its call's function; a
    message whose id answers no call keeps the template's refusal."""
    from data.templates import REAL, build_tokenizer

    tok = build_tokenizer((REAL / "google-functiongemma-270m-it.jinja").read_text(encoding="utf-8"))
    row = weather_call_row({"city": "Paris"})
    assert "name" not in row["messages"][2]
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert target_runs(tok, one(result)) == [
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call><start_function_response>",
        "Sunny.<end_of_turn>\n",
    ]
    assert "<start_function_response>response:get_weather{value:<escape>sunny<escape>}" in tok.decode(
        one(result)["input_ids"]
    )
    row["messages"][2]["tool_call_id"] = "c9"  # answers no call: nothing to name it after
    with pytest.raises(DataError, match=r"the chat template failed on messages\[:3\].*'name' must be provided"):
        tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)


# gpt-oss's habit: a final answer ends with <|return|>, the same answer followed by more ends with <|end|>.
FINAL_ONLY_MARKER = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
    "{% if m.role == 'assistant' and loop.last %}<|return|>{% else %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"
)
# Command R's habit: the assistant header is written after the last message whether or not a prompt is asked for.
ALWAYS_WRITES_HEADER = "{% for m in messages %}<SOT><{{ m.role }}>{{ m.content }}<EOT>{% endfor %}<SOT><assistant>"
# GLM's habit: no end-of-turn marker; the next header is the model's stop.
NO_END_MARKER = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"


def test_text_written_only_after_a_final_answer_is_its_own(make_tokenizer, chat_row):
    tok = make_tokenizer(FINAL_ONLY_MARKER)
    row = {
        "messages": chat_row(1)["messages"]
        + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "B"}]
    }
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert result.policy == "per_turn"  # "fine 1<|return|>" is not in the whole rendering, which has "<|end|>" there
    assert [target_runs(tok, ex) for ex in result.examples] == [["fine 1<|return|>"], ["B<|return|>"]]


def test_a_template_that_always_writes_the_next_header_is_refused(make_tokenizer, chat_row):
    with pytest.raises(
        DataError,
        match=r"messages\[1\] \(assistant\): where this turn ends is ambiguous: the template "
        r"writes '<EOT><SOT><assistant>' after the message's text when it ends the conversation, and a "
        r"following message's rendering keeps only '<EOT><SOT>' of that .*: the template writes text after whatever "
        r"message ends a conversation even without add_generation_prompt",
    ):
        tokenize_conversation(make_tokenizer(ALWAYS_WRITES_HEADER), to_conversation(chat_row(1), WHERE), WHERE)


# A guard model's habit (ShieldGemma): the conversation's last messages framed as a question for the model to answer,
# written after whatever message ends it; a following message rewrites the whole rendering.
GUARD_QUESTION = (
    "{% if messages[-1].role == 'user' %}Is <q>{{ messages[-1].content }}</q> safe? Answer:"
    "{% else %}Is <q>{{ messages[-2].content }}</q><r>{{ messages[-1].content }}</r> a safe reply? Answer:{% endif %}"
)


def test_an_instruction_written_after_the_last_message_is_not_trained(make_tokenizer, chat_row):
    # The turn's text was taken to run to the end of the rendering: the question after it was trained as its output.
    with pytest.raises(
        DataError,
        match=r"messages\[1\] \(assistant\): where this turn ends is ambiguous: the template writes "
        r"'</r> a safe reply\? Answer:' after the message's text when it ends the conversation, text that a following "
        r"message's rendering does not keep after it",
    ):
        tokenize_conversation(make_tokenizer(GUARD_QUESTION), to_conversation(chat_row(1), WHERE), WHERE)


# Muse Glimmer's habit (vLLM's template): a default system message written only with the generation prompt (or tools),
# before the whole conversation, so the prompt holds the context after text of its own.
PROMPT_WRITES_SYSTEM_FIRST = (
    "{% if add_generation_prompt %}<|start|>system<|message|>Default.<|eot|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"
)


def test_a_system_message_only_the_generation_prompt_writes_does_not_hide_its_header(make_tokenizer, chat_row):
    # The prompt was compared with the turn from its first character: they part at the system message, and the row was
    # refused as one whose generation prompt is not how the turn starts.
    tok = make_tokenizer(PROMPT_WRITES_SYSTEM_FIRST)
    row = {
        "messages": chat_row(1)["messages"]
        + [
            {"role": "assistant", "content": "B"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "C"},
        ]
    }
    result, runs = masked(tok, row)
    assert result.policy == "full"
    assert runs == ["fine 1<|eot|>", "B<|eot|>", "C<|eot|>"]


def test_turns_the_template_ends_with_nothing_are_counted(make_tokenizer, chat_row):
    row = {
        "messages": chat_row(1)["messages"]
        + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "B"}]
    }
    result = tokenize_conversation(make_tokenizer(NO_END_MARKER), to_conversation(row, WHERE), WHERE)
    assert result.policy == "full" and result.unterminated == 2
    assert target_runs(make_tokenizer(NO_END_MARKER), result.examples[0]) == ["fine 1", "B"]


# Mistral's parallel-tools template: no generation prompt, the system prompt written into the conversation's last
# message when it is a user message (so the context renders differently once a turn follows), " " before an answer.
NO_PROMPT_SYSTEM_LAST = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST] {% if loop.last %}SYS {% endif %}{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{{ ' ' + m.content + '</s>' }}{% endif %}{% endfor %}"
)


def test_with_no_generation_prompt_the_text_a_turn_writes_before_the_message_is_output(make_tokenizer):
    _, runs = masked(make_tokenizer(NO_PROMPT_SYSTEM_LAST), exchange("one", "A", "two", "B"))
    # What the model writes after [/INST] is " A</s>", space included. Each turn's view renders its context unlike its
    # prompt (SYS moves to the last message), so the output is found after the prompt's header, which is empty.
    assert runs == [" A</s>", " B</s>"]


def test_a_tool_call_written_only_once_a_message_follows_is_refused_saying_so(make_tokenizer):
    # vLLM's Nemotron JSON template writes a conversation's last assistant message apart, without its tool calls.
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}<assistant>{{ m.content }}"
        "{% if m.tool_calls and not loop.last %}<call>{{ m.tool_calls[0].function.name }}{% endif %}</s>"
        "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    row = weather_call_row({})
    with pytest.raises(DataError, match=r"get_weather.*writes it once another message follows"):
        tokenize_conversation(make_tokenizer(template), to_conversation(row, WHERE), WHERE)


def test_a_turn_that_ends_with_blank_space_only_is_counted_as_unterminated(make_tokenizer, chat_row):
    # DeciLM writes a newline after every message and no end-of-turn marker: the newline is trained, but it is no stop.
    tok = make_tokenizer(NO_END_MARKER.replace("{{ m.content }}", "{{ m.content }}\n"))
    result = tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE)
    assert target_runs(tok, result.examples[0]) == ["fine 1\n"]
    assert result.unterminated == 1
    # Unless the end-of-sequence token is that blank space (RWKV World's is "\n\n"): then it is the stop.
    tok.eos_token = "\n"
    assert tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE).unterminated == 0


# Apertus's habit: an assistant turn is closed by the end-of-sequence token, written only by a user message that follows.
CLOSED_BY_NEXT = (
    "{% for m in messages %}{% if m.role == 'user' %}"
    "{% if loop.previtem is defined and loop.previtem.role == 'assistant' %}CLOSE{% endif %}<user>{{ m.content }}"
    "{% else %}<assistant>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize("multi_turn", ["full", "per_turn"])
def test_an_end_of_sequence_token_the_next_message_writes_first_closes_the_turn(make_tokenizer, chat_row, multi_turn):
    tok = make_tokenizer(CLOSED_BY_NEXT.replace("CLOSE", "</s>"))  # ByT5's eos
    row = {
        "messages": chat_row(1)["messages"]
        + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "B"}]
    }
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE, multi_turn=multi_turn)
    runs = [target_runs(tok, ex) for ex in result.examples]
    # The last turn, which nothing follows, is closed as a user message after it would close it.
    assert runs == ([["fine 1</s>", "B</s>"]] if multi_turn == "full" else [["fine 1</s>"], ["B</s>"]])
    assert result.unterminated == 0
    if multi_turn == "per_turn":  # the next message's rendering, cut after the close
        assert tok.decode(result.examples[0]["input_ids"]) == "<user>question 1<assistant>fine 1</s>"
    assert tok.decode(result.examples[-1]["input_ids"]).endswith("<user>more<assistant>B</s>")


# Hunyuan 3's habit: an answer ends with the end-of-sequence token unless it is the conversation's last message (for a
# prompt that continues it); a tool call always ends with it.
STOP_UNLESS_LAST = (
    "{% for m in messages %}{% if m.role == 'user' %}<user>{{ m.content }}"
    "{% elif m.role == 'tool' %}<result>{{ m.content }}"
    "{% elif m.tool_calls %}<assistant><call>{{ m.tool_calls[0].function | tojson }}</s>"
    "{% else %}<assistant>{{ m.content }}{% if not loop.last %}</s>{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize("multi_turn", ["full", "per_turn"])
def test_a_single_turn_row_learns_the_stop_the_template_writes_once_a_message_follows(
    make_tokenizer, chat_row, multi_turn
):
    tok = make_tokenizer(STOP_UNLESS_LAST)
    result = tokenize_conversation(tok, to_conversation(chat_row(1), WHERE), WHERE, multi_turn=multi_turn)
    assert [target_runs(tok, ex) for ex in result.examples] == [["fine 1</s>"]]
    assert result.unterminated == 0
    assert tok.decode(result.examples[0]["input_ids"]) == "<user>question 1<assistant>fine 1</s>"


def test_a_turn_rewritten_once_followed_gets_the_close_of_the_message_it_then_renders_as(make_tokenizer):
    # Hunyuan 3 also drops an answer's reasoning once a message follows: the turn with its reasoning is never followed
    # by the close, but it renders then as the same message without reasoning does, and that one is closed by </s>.
    template = STOP_UNLESS_LAST.replace(
        "<assistant>{{ m.content }}",
        "<assistant>{% if loop.last and m.reasoning_content %}{{ m.reasoning_content }}|{% endif %}{{ m.content }}",
    )
    tok = make_tokenizer(template)
    row = exchange("one", ("A", "r1"), "two", ("B", "r2"))
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert result.policy == "per_turn" and result.unterminated == 0
    assert [target_runs(tok, ex) for ex in result.examples] == [["r1|A</s>"], ["r2|B</s>"]]
    assert tok.decode(result.examples[0]["input_ids"]) == "<user>one<assistant>r1|A</s>"


def test_a_turn_that_ends_with_the_end_of_sequence_token_is_terminated(make_tokenizer):
    # A plain message in the tool call's place ends with nothing (it is last), the tool call with </s>: a stop.
    tok = make_tokenizer(STOP_UNLESS_LAST)
    row = weather_call_row({"city": "Paris"})
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE, multi_turn="full")
    call_text = '<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</s>'
    assert target_runs(tok, result.examples[0]) == [call_text, "Sunny.</s>"]
    assert result.unterminated == 0


def test_other_text_the_next_message_writes_first_is_not_the_turns(make_tokenizer, chat_row):
    tok = make_tokenizer(CLOSED_BY_NEXT.replace("CLOSE", "<close>"))  # not the model's end-of-sequence token
    row = {
        "messages": chat_row(1)["messages"]
        + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "B"}]
    }
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert target_runs(tok, result.examples[0]) == ["fine 1", "B"] and result.unterminated == 2


@pytest.mark.parametrize(
    "writes",
    ["' + tc.function.arguments + '", "{{ tc.function.arguments | string }}"],
    ids=["concatenates-text", "prints-the-value"],
)
def test_arguments_go_as_json_text_to_templates_that_cannot_take_a_mapping(make_tokenizer, chatml, tool_row, writes):
    template = chatml.replace(
        '"arguments": {{ tc.function.arguments | tojson }}',
        '"arguments": ' + ("{{ '" + writes + "' }}" if writes.startswith("'") else writes),
    )
    result = tokenize_conversation(make_tokenizer(template), to_conversation(tool_row, WHERE), WHERE)
    assert target_runs(make_tokenizer(template), result.examples[0])[0] == CHATML_TARGETS[0]  # {"city": "Paris"}


# Gemma 3's first template (Ollama's gemma3:1b GGUF keeps it): the system prompt read as a list of text parts only.
READS_SYSTEM_PARTS = (
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'][0]['text'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<T>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ prefix if loop.first else '' }}"
    "{% if m.content is string %}{{ m.content | trim }}{% else %}{% for p in m.content %}{{ p.text | trim }}"
    "{% endfor %}{% endif %}</T>\n{% endfor %}{% if add_generation_prompt %}<T>model\n{% endif %}"
)


def test_a_template_that_reads_content_as_text_parts_gets_them(make_tokenizer, chat_row, tool_row):
    """phalanx joins a message's text parts into one string, so a row cannot be changed to give the template the parts
    it reads (Gemma 3's first template raised "'str object' has no attribute 'text'" on every row with a system
    message, and the refusal said to change the row): the contents go to it as parts when the string fails."""
    tok = make_tokenizer(READS_SYSTEM_PARTS)
    row = chat_row(1)
    row["messages"].insert(0, {"role": "system", "content": "Be brief."})
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert tok.decode(result.examples[0]["input_ids"]) == "<T>user\nBe brief.\n\nquestion 1</T>\n<T>model\nfine 1</T>\n"
    assert target_runs(tok, result.examples[0]) == ["fine 1</T>\n"]
    # Where the template fails further on too, that error is the one said (Gemma 3 has no tool role).
    with pytest.raises(
        DataError, match=r"failed on messages\[:4\] \(roles: system, user, assistant, tool\).*alternate"
    ):
        tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)
    # A template that prints the content as it is did not want parts: the string's own error stands.
    prints = READS_SYSTEM_PARTS.replace("{% if m.content is string %}", "{{ m.content }}{% if false %}")
    with pytest.raises(DataError, match=r"failed on messages\[:2\] \(roles: system, user\).*has no attribute 'text'"):
        tokenize_conversation(make_tokenizer(prints), to_conversation(row, WHERE), WHERE)


def test_a_tool_calling_message_whose_content_the_template_ignores_is_located(make_tokenizer, chatml, tool_row):
    """Mistral writes only the calls of a tool-calling message: the sentinel goes into the call's name too."""
    ignores_content = NUMBERED + chatml.replace(
        "<|im_start|>assistant\n{{ m.content }}",
        "<|im_start|>assistant\n{% if not m.tool_calls %}{{ m.content }}{% endif %}",
    )
    tool_row["messages"][2]["content"] = "<think>checking the weather</think>"  # reasoning only: not trained, counted
    tok = make_tokenizer(ignores_content)
    result = tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)
    assert result.policy == "full" and target_runs(tok, result.examples[0]) == CHATML_TARGETS
    assert result.reasoning_dropped == 1


# MiniMax's habit: the generation prompt pre-fills "<think>\n", which the template writes around reasoning.
WRITES_THINK_AROUND_REASONING = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<A>\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}</s>"
    "{% else %}<U>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<A>\n<think>\n{% endif %}"
)


def test_a_prefill_the_template_writes_around_reasoning_is_not_trained(make_tokenizer):
    tok = make_tokenizer(WRITES_THINK_AROUND_REASONING)
    result = tokenize_conversation(tok, to_conversation(REASONING_ROW, WHERE), WHERE, "per_turn")
    assert [target_runs(tok, ex) for ex in result.examples] == [
        ["WHY-ONE\n</think>\n\nANSWER-ONE</s>"],
        ["WHY-TWO\n</think>\n\nANSWER-TWO</s>"],
    ]


def test_an_end_of_sequence_token_inside_a_turn_is_refused(make_tokenizer, tool_row):
    """Nemotron writes content and tool calls as two assistant blocks, each closed by the end-of-sequence token."""
    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.tool_calls %}</s><|assistant|>"
        "{% for tc in m.tool_calls %}{{ tc.function.name }}{{ tc.function.arguments | tojson }}{% endfor %}"
        "{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tool_row["messages"][2]["content"] = "Let me check."
    with pytest.raises(
        DataError,
        match=r"messages\[2\] \(assistant\): the chat template writes the end-of-sequence "
        r"token '</s>' inside this turn.*the message's content and tool calls as blocks of their own",
    ):
        tokenize_conversation(make_tokenizer(template), to_conversation(tool_row, WHERE), WHERE)


def test_an_end_of_sequence_token_after_the_reasoning_is_refused_naming_the_reasoning(make_tokenizer):
    """Solar Open writes reasoning as an assistant message of its own, closed by the token that closes every message:
    the refusal names reasoning and content as the blocks (it named content and tool calls, which this row lacks)."""
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' and m.reasoning %}<|assistant|><|think|>{{ m.reasoning }}"
        "</s>{% endif %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
        "{% endif %}"
    )
    with pytest.raises(DataError) as info:
        tokenize_conversation(make_tokenizer(template), to_conversation(REASONING_ROW, WHERE), WHERE)
    message = str(info.value)
    assert "writes the message's reasoning and content as blocks of their own" in message
    assert "content and tool calls" not in message


def test_an_end_of_sequence_token_inside_a_one_part_turn_names_no_blocks(make_tokenizer, chat_row):
    """A turn of content alone that the template closes with the token and then writes more: there are no parts to
    give messages of their own, so the refusal offers only another template or another eos."""
    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.role == 'assistant' %}</s>[done]{% endif %}"
        "</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(DataError) as info:
        tokenize_conversation(make_tokenizer(template), to_conversation(chat_row(1), WHERE), WHERE)
    message = str(info.value)
    assert "so a model could never generate what follows it: use another template (--chat_template), or, if the " in (
        message
    )
    assert "blocks of their own" not in message and "Give each part" not in message


def test_an_end_of_sequence_token_in_the_rows_own_text_is_refused_as_the_rows_fault(make_tokenizer, chat_row):
    """The token's text in the message itself (a reply that quotes '</s>'): the row is at fault, not the template, and
    the message says what to edit."""
    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    row = chat_row(1)
    row["messages"][-1]["content"] = "Every reply ends with </s> here. Fine."
    with pytest.raises(DataError) as err:  # read as the token (data.special_token_text: token)
        tokenize_conversation(make_tokenizer(template), to_conversation(row, WHERE), WHERE, special_token_text="token")
    message = str(err.value)
    assert "its content holds the text of the end-of-sequence token '</s>'" in message, message
    assert "edit the row" in message and "--on_bad_row skip" in message and "chat template writes" not in message
    # By default the row's text is text (tests/data/test_special_text.py): the reply trains as written.
    tok = make_tokenizer(template)
    (example,) = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE).examples
    assert target_runs(tok, example) == ["Every reply ends with </s> here. Fine.</s>"]


def test_consecutive_assistant_messages(make_tokenizer, chat_row):
    """After an assistant message a generation prompt may rewrite it (gpt-oss) or be missing (Apriel writes the
    header with the turn): each message still trains exactly its own output."""
    row = {"messages": chat_row(1)["messages"] + [{"role": "assistant", "content": "B"}]}
    tok = make_tokenizer(FINAL_ONLY_MARKER)
    assert [target_runs(tok, ex) for ex in tokenize_conversation(tok, to_conversation(row, WHERE), WHERE).examples] == [
        ["fine 1<|return|>"],
        ["B<|return|>"],
    ]
    header_with_turn = (
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt and messages[-1].role != 'assistant' %}<|assistant|>\n{% endif %}"
    )
    tok = make_tokenizer(header_with_turn)
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert result.policy == "full" and target_runs(tok, result.examples[0]) == ["fine 1<|end|>\n", "B<|end|>\n"]


def test_template_variables_reach_every_rendering_qwen3_without_thinking():
    """data.chat_template_kwargs: Qwen3's non-thinking mode pre-fills an empty think block in the generation prompt,
    so it is prompt, not output; by default the model writes that block itself and is trained on it."""
    from data.templates import build_tokenizer
    from helpers import shared_template

    tok = build_tokenizer(shared_template("Qwen-Qwen3-0.6B").read_text(encoding="utf-8"))
    conv = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello, Ann."}]}
    thinking = trained_runs(tok, one(tokenize_conversation(tok, conv, "row 1")))
    plain = trained_runs(
        tok, one(tokenize_conversation(tok, conv, "row 1", template_kwargs={"enable_thinking": False}))
    )
    assert thinking == ["<think>\n\n</think>\n\nHello, Ann.<|im_end|>\n"]
    assert plain == ["Hello, Ann.<|im_end|>\n"]


def test_a_conversation_that_opens_with_the_assistant_trains_that_turn_or_says_why_not(make_tokenizer):
    """A greeting before the user's first message (support chats open so) trains like any turn: after the empty
    conversation the template renders before it (DeepSeek-R1-Distill's BOS, with `<｜Assistant｜><think>\n` as the
    prompt), or, where the template cannot render an empty conversation (Qwen2.5 reads messages[0]), after the header
    its generation prompt writes. transformers refuses to render an empty conversation, and the row was refused as one
    the template failed on at messages[:0]. With neither, the row is refused naming the message."""
    from data.templates import build_tokenizer
    from helpers import shared_template

    row = {
        "messages": [
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    }
    eos = "<｜end▁of▁sentence｜>"
    tok = build_tokenizer(shared_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B").read_text(encoding="utf-8"))
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert result.policy == "full" and target_runs(tok, one(result)) == [f"Hi! How can I help?{eos}", f"4{eos}"]
    assert tok.decode(one(result)["input_ids"]).startswith("<｜begin▁of▁sentence｜><｜Assistant｜>Hi!")

    tok = build_tokenizer(shared_template("Qwen-Qwen2.5-7B-Instruct").read_text(encoding="utf-8"))
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE, multi_turn="per_turn")
    assert [target_runs(tok, ex) for ex in result.examples] == [["Hi! How can I help?<|im_end|>\n"], ["4<|im_end|>\n"]]
    assert tok.decode(result.examples[0]["input_ids"]).startswith("<|im_start|>system\nYou are Qwen")

    reads_first = "{% if messages[0].role == 'system' %}<<SYS>>{% endif %}" + INST  # and has no generation prompt
    with pytest.raises(DataError) as info:
        tokenize_conversation(make_tokenizer(reads_first), to_conversation(row, WHERE), WHERE)
    message = str(info.value)
    assert message.startswith(f"{WHERE}: messages[0] (assistant): the conversation opens with an assistant message")
    assert "no element 0" in message and "messages[:0]" not in message, message


@pytest.mark.parametrize("multi_turn", ["auto", "per_turn"])
def test_an_empty_turn_the_template_writes_nothing_for_is_refused(make_tokenizer, multi_turn):
    """An assistant message with empty content trains its stop where the template writes one (ChatML: `<|im_end|>`).
    A template that writes nothing for it (GLM-4-9B skips an empty message; Seed-OSS writes its header only) left the
    turn untrained, silently: a row with no trained token under per_turn, the turn left out of the full row."""
    row = exchange("Say nothing.", "", "Now say hi.", "hi")
    tok = make_tokenizer()
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE, multi_turn=multi_turn)
    assert [target_runs(tok, ex) for ex in result.examples] == (
        [["<|im_end|>\n", "hi<|im_end|>\n"]] if multi_turn == "auto" else [["<|im_end|>\n"], ["hi<|im_end|>\n"]]
    )
    skips_empty = (
        "{% for m in messages %}{% if m.content %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tok = make_tokenizer(skips_empty)
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(row, WHERE), WHERE, multi_turn=multi_turn)
    assert str(info.value).startswith(
        f"{WHERE}: messages[1] (assistant): the chat template writes nothing for this turn"
    ), str(info.value)


def test_reasoning_written_without_its_opening_tag_is_located_like_a_think_block():
    """DeepSeek-R1-style output saved as generated: the prompt pre-filled `<think>\\n`, so the content is
    `reasoning</think>answer`. GLM-4.7-Flash reads it as reasoning and writes it after the `<think>` its prompt
    pre-fills: that `<think>` is prompt, as for the same message with an opening tag or reasoning_content; it was
    trained as the turn's first token."""
    from data.templates import REAL, build_tokenizer

    tok = build_tokenizer((REAL / "GLM-4.7-Flash.jinja").read_text(encoding="utf-8"))
    runs = []
    for answer in (
        {"content": "add them\n</think>\n\n4"},
        {"content": "<think>add them</think>4"},
        {"content": "4", "reasoning_content": "add them"},
    ):
        row = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", **answer}]}
        runs.append(target_runs(tok, one(tokenize_conversation(tok, to_conversation(row, WHERE), WHERE))))
    assert runs == [["add them</think>4"]] * 3


def test_a_greeting_the_template_takes_only_after_a_user_message_is_refused_as_the_greeting():
    """Qwen3.5's template raises 'No user query found in messages' on a conversation without a user message. A row
    opening with a greeting renders whole, but the greeting's own turn (messages[:1], how phalanx finds what the model
    wrote) does not: it was refused as a row the template does not take ("change the row"), quoting an error the row
    does not have (it has a user message). The refusal says what fails and what to do."""
    from data.templates import REAL, build_tokenizer

    tok = build_tokenizer((REAL / "Qwen3.5-4B.jinja").read_text(encoding="utf-8"))
    row = {
        "messages": [
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    }
    assert "No user query" not in tok.apply_chat_template(row["messages"], tokenize=False)  # the whole row renders
    for multi_turn in ("auto", "per_turn"):
        with pytest.raises(DataError) as info:
            tokenize_conversation(tok, to_conversation(row, WHERE), WHERE, multi_turn=multi_turn)
        message = str(info.value)
        assert message.startswith(f"{WHERE}: messages[0] (assistant): the conversation opens with an assistant message")
        assert "No user query found in messages" in message and "renders the whole row" in message, message
        assert "Start the row with the user (or system) message the assistant answers" in message, message


@pytest.mark.parametrize("multi_turn", ["auto", "per_turn"])
def test_a_prompt_that_pre_fills_an_empty_reasoning_block_trains_the_turn_it_leaves_out(multi_turn):
    """Cohere2MoE (North Mini Code) with reasoning off (data.chat_template_kwargs `reasoning: false`, or
    `reasoning_effort: none`): its generation prompt pre-fills an empty `<|START_THINKING|><|END_THINKING|>`, which a
    finished turn without reasoning does not write (it opens `<|START_TEXT|>`), as with reasoning on the prompt
    pre-fills `<|START_THINKING|>` alone. Every row without reasoning was refused as one whose generation prompt is not
    how the template starts the turn; the output is what the turn writes after the header, as with reasoning on."""
    from data.templates import REAL, build_tokenizer

    tok = build_tokenizer((REAL / "Cohere2MoE.jinja").read_text(encoding="utf-8"))
    conv = to_conversation(exchange("Name a prime.", "7", "And an even one?", "2"), WHERE)
    off = {"reasoning": False}
    prompt = tok.apply_chat_template(conv["messages"][:1], add_generation_prompt=True, tokenize=False, **off)
    assert prompt.endswith("<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>")
    want = ["<|START_TEXT|>7<|END_TEXT|><|END_OF_TURN_TOKEN|>", "<|START_TEXT|>2<|END_TEXT|><|END_OF_TURN_TOKEN|>"]
    for kwargs in (None, off, {"reasoning_effort": "none"}):
        result = tokenize_conversation(tok, conv, WHERE, multi_turn=multi_turn, template_kwargs=kwargs)
        runs = [target_runs(tok, example) for example in result.examples]
        assert runs == ([want] if multi_turn == "auto" else [[w] for w in want]), kwargs


@pytest.mark.parametrize("multi_turn", ["auto", "per_turn"])
def test_a_prompt_that_pre_fills_what_no_turn_writes_trains_the_turn_after_its_header(multi_turn):
    """Cohere2MoE with `skip_thinking` (data.chat_template_kwargs) writes no reasoning in any turn, while its generation
    prompt still pre-fills `<|START_THINKING|>` (or, with reasoning off, `<|START_THINKING|><|END_THINKING|>`) after the
    `<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>` a finished turn writes too, and the turn writes `<|START_TEXT|>` there:
    every row was refused as one whose generation prompt is not how the template starts the turn. The output is what the
    turn writes after the part of the header it shares with the prompt, as without `skip_thinking`."""
    from data.templates import REAL, build_tokenizer

    tok = build_tokenizer((REAL / "Cohere2MoE.jinja").read_text(encoding="utf-8"))
    row = exchange("Name a prime.", ("7", "Any prime will do."), "And an even one?", "2")
    conv = to_conversation(row, WHERE)
    want = ["<|START_TEXT|>7<|END_TEXT|><|END_OF_TURN_TOKEN|>", "<|START_TEXT|>2<|END_TEXT|><|END_OF_TURN_TOKEN|>"]
    for kwargs in ({"skip_thinking": True}, {"skip_thinking": True, "reasoning": False}):
        text = tok.apply_chat_template(conv["messages"], tokenize=False, **kwargs)
        assert "<|START_THINKING|>" not in text[text.index("<|CHATBOT_TOKEN|>") :], kwargs  # no turn writes reasoning
        result = tokenize_conversation(tok, conv, WHERE, multi_turn=multi_turn, template_kwargs=kwargs)
        runs = [target_runs(tok, example) for example in result.examples]
        assert runs == ([want] if multi_turn == "auto" else [[w] for w in want]), kwargs
        assert result.reasoning_dropped == 1, kwargs


# Command A Reasoning's way: every assistant message's `content[0].thinking` is read (a string has a first character
# unless it is empty), and a tool message's content is iterated as a list of results.
READS_ASSISTANT_PARTS = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' %}{% if m.content[0].thinking %}<T>{{ m.content[0].thinking }}</T>{% endif %}"
    "{% for tc in m.tool_calls or [] %}<call>{{ tc.function.name }} {{ tc.function.arguments | tojson }}</call>"
    "{% endfor %}{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% else %}{% for part in m.content %}{{ part.text if part is mapping else '[' + part + ']' }}{% endfor %}"
    "{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_an_empty_assistant_content_goes_as_one_empty_text_part_where_the_string_fails(make_tokenizer):
    """A tool call's empty content: Command A Reasoning's template reads `content[0].thinking` of each assistant
    message, which an empty string fails ('str object has no element 0'), so every tool-calling row was refused with
    that error, which no row can avoid (content null is passed as ""). With every content as text parts, it renders."""
    tok = make_tokenizer(READS_ASSISTANT_PARTS)
    row = weather_call_row({"city": "Paris"})
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert tok.decode(result.examples[0]["input_ids"]) == (
        '<|user|>weather?<|end|><|assistant|><call>get_weather {"city": "Paris"}</call><|end|>'
        "<|tool|>sunny<|end|><|assistant|>Sunny.<|end|>"
    )
    assert target_runs(tok, result.examples[0]) == [
        '<call>get_weather {"city": "Paris"}</call><|end|>',
        "Sunny.<|end|>",
    ]
