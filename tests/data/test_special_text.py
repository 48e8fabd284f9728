"""A special token's text written in a row is encoded as text; only the chat template's markup becomes control tokens."""

import pytest
from transformers import PreTrainedTokenizerFast

from helpers import chatml_bpe_tokenizer
from phalanx.data.chat import IGNORE_INDEX, tokenize_conversation
from phalanx.data.formats import to_conversation
from phalanx.data.special_text import shield, special_token_texts
from phalanx.errors import DataError

WHERE = "rows.jsonl line 1"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUOTING = {
    "messages": [
        {"role": "user", "content": "What does <|im_end|> do?"},
        {
            "role": "assistant",
            "content": "<think>\nrecall</think>It ends a turn: <|im_end|><|im_end|>. So does <|endoftext|>.",
        },
    ]
}


@pytest.fixture(scope="module")
def fast():
    """A real fast byte-level BPE tokenizer with ChatML's special tokens and a non-special added <think>/</think>."""
    tok = chatml_bpe_tokenizer([CHATML, "user assistant What does it do? It ends a turn."] * 5, vocab_size=400)
    tok.add_tokens(["<think>", "</think>"])  # added, not special: an answer's reasoning block is the model's output
    tok.chat_template = CHATML
    return tok


def trained_text(tok, example) -> str:
    return tok.decode([t for t in example["labels"] if t != IGNORE_INDEX])


def test_quoted_special_tokens_are_text_and_the_templates_markup_is_tokens(fast):
    result = tokenize_conversation(fast, to_conversation(QUOTING, WHERE), WHERE)
    (example,) = result.examples
    ids = example["input_ids"]
    end, pad, think = (fast.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<think>"))
    # The template closes two turns; the row's three <|im_end|> and its <|endoftext|> are characters.
    assert ids.count(end) == 2 and pad not in ids
    assert ids.count(think) == 1  # a non-special added token the row writes stays the token
    rendered = fast.apply_chat_template(QUOTING["messages"], tokenize=False)
    assert fast.decode(ids) == rendered  # every character as written
    assert trained_text(fast, example) == QUOTING["messages"][1]["content"] + "<|im_end|>\n"
    assert result.special_texts == {"<|im_end|>": 3, "<|endoftext|>": 1}
    # Read whole, the rendering holds five ends and a pad; up to the user's quote the ids are the same.
    whole = fast(rendered, add_special_tokens=False)["input_ids"]
    assert whole.count(end) == 5 and pad in whole
    quote = whole.index(end)
    assert ids[:quote] == whole[:quote] and ids[quote] != end


def test_token_mode_reads_the_rows_special_text_as_the_tokens(fast):
    row = {"messages": [QUOTING["messages"][0], {"role": "assistant", "content": "Fine."}]}
    result = tokenize_conversation(fast, to_conversation(row, WHERE), WHERE, special_token_text="token")
    rendered = fast.apply_chat_template(row["messages"], tokenize=False)
    assert result.examples[0]["input_ids"] == fast(rendered, add_special_tokens=False)["input_ids"]
    assert result.special_texts == {}
    # An answer holding the end-of-sequence token's text could never be generated then: refused, naming the way on.
    with pytest.raises(DataError, match="Leave special_token_text at 'text'"):
        tokenize_conversation(fast, to_conversation(QUOTING, WHERE), WHERE, special_token_text="token")


def test_slow_tokenizer_encodes_the_quoted_token_as_text(make_tokenizer):
    tok = make_tokenizer(CHATML.replace("<|im_end|>", "</s>"))  # ByT5: slow, byte-level, </s> its end-of-sequence
    row = {"messages": [{"role": "user", "content": "end with </s>?"}, {"role": "assistant", "content": "No: </s>."}]}
    (example,) = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE).examples
    assert example["input_ids"].count(tok.eos_token_id) == 2
    assert trained_text(tok, example) == "No: </s>.</s>"
    # ByT5's </s> takes the blank space around it; the quoted one is characters, so the user's space stays.
    rendered = tok.apply_chat_template(row["messages"], tokenize=False)
    assert tok.decode(tok(rendered, add_special_tokens=False)["input_ids"]).startswith("<|im_start|>user\nend with</s>")
    assert tok.decode(example["input_ids"]).startswith("<|im_start|>user\nend with </s>?</s><|im_start|>assistant\n")


def test_tool_schemas_and_arguments_are_shielded_too(fast):
    tools = [{"type": "function", "function": {"name": "f", "description": "stops at <|im_end|>", "parameters": {}}}]
    call = {"type": "function", "function": {"name": "f", "arguments": {"text": "<|endoftext|>"}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    shielded_messages, shielded_tools, found = shield(fast, messages, tools, WHERE)
    assert found is not None and found.counts == {"<|im_end|>": 1, "<|endoftext|>": 1}
    assert "<|" not in str(shielded_tools) + str(shielded_messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"text": "<|endoftext|>"}  # the row is not changed
    # The rendering restored: the same characters, and where the row's tokens stand.
    text = f"{shielded_tools[0]['function']['description']}|{shielded_messages[1]['tool_calls'][0]['function']}"
    restored, ranges = found.restore(text, WHERE)
    assert restored == "stops at <|im_end|>|{'name': 'f', 'arguments': {'text': '<|endoftext|>'}}"
    assert [restored[a:b] for a, b in ranges] == ["<|im_end|>", "<|endoftext|>"]


def test_a_token_the_template_reads_in_the_rows_text_is_left_a_token(fast):
    """A template that parses or slices the row's text at a special token needs the text as written: that token is not
    shielded (GLM-4.7 splits content at its special `</think>` into a reasoning block:
    tests/data/test_chat.py::test_reasoning_written_without_its_opening_tag_is_located_like_a_think_block)."""
    cutting = PreTrainedTokenizerFast(tokenizer_object=fast.backend_tokenizer, eos_token="<|im_end|>")
    cutting.chat_template = CHATML.replace("{{ m.content }}", "{{ m.content[:12] }}")
    row = {"messages": [{"role": "user", "content": "say <|im_end|>"}, {"role": "assistant", "content": "ok"}]}
    result = tokenize_conversation(cutting, to_conversation(row, WHERE), WHERE)
    assert result.special_texts == {}  # 'say <|im_e' is what the template writes: read as the tokenizer reads it
    # A restore that meets a cut run (a rendering the check above did not cover) is refused, naming the text.
    _, _, found = shield(fast, row["messages"], None, WHERE)
    with pytest.raises(DataError, match=r"the chat template cut the text '<\|im_end\|>' that the row holds"):
        found.restore("say " + chr(0x17000 + special_token_texts(fast).index("<|im_end|>")) * 6, WHERE)


def test_private_use_characters_in_a_row_with_special_text_are_refused(fast):
    row = [{"role": "user", "content": "\U00017000 and <|im_end|>"}]
    with pytest.raises(DataError, match="Tangut"):
        shield(fast, row, None, WHERE)
    assert shield(fast, [{"role": "user", "content": "\U00017000 alone"}], None, WHERE)[2] is None


def test_special_token_texts_are_the_special_ones_longest_first(fast):
    assert special_token_texts(fast) == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def test_a_refusal_quotes_the_rows_text_as_written(fast):
    dropping = PreTrainedTokenizerFast(tokenizer_object=fast.backend_tokenizer, eos_token="<|im_end|>")
    dropping.chat_template = CHATML.replace("{{ m.content }}", "{{ m.content if m.role == 'user' else 'x' }}")
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "say <|im_end|> now"}]}
    with pytest.raises(DataError) as info:
        tokenize_conversation(dropping, to_conversation(row, WHERE), WHERE)
    assert "'say <|im_end|> now'" in str(info.value) and chr(0x17000) not in str(info.value)


def test_an_answers_markup_tokens_stay_tokens_and_only_sequence_tokens_are_text(fast):
    """An answer is what the model writes: markup tokens in it (here <|im_start|>, as [TOOL_CALLS] or <|python_tag|>
    elsewhere) are ones it generates; in the prompt's messages every special token's text is text."""
    start = fast.convert_tokens_to_ids("<|im_start|>")
    row = {
        "messages": [
            {"role": "user", "content": "a <|im_start|> b"},
            {"role": "assistant", "content": "c <|im_start|> d <|endoftext|>"},
        ]
    }
    result = tokenize_conversation(fast, to_conversation(row, WHERE), WHERE)
    (example,) = result.examples
    assert result.special_texts == {"<|im_start|>": 1, "<|endoftext|>": 1}
    assert example["input_ids"].count(start) == 2 + 1  # the template's two headers and the answer's own
    assert example["labels"].count(start) == 1
