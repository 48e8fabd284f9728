"""The loss mask covers exactly the assistant turns, whatever the chat template, and nothing else."""

from __future__ import annotations

import pytest

from phalanx.data.chat import IGNORE_INDEX, tokenize_conversation
from phalanx.data.collate import pad_batch
from phalanx.data.formats import to_conversation
from phalanx.errors import DataError

WHERE = "train.jsonl line 3"

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


def target_runs(tok, result) -> list[str]:
    """Decode each contiguous run of labelled tokens."""
    runs, current = [], []
    for token, label in zip(result["input_ids"], result["labels"]):
        assert label in (IGNORE_INDEX, token)
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(run) for run in runs]


CHATML_TARGETS = [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n',
    "ASSISTANT-ONE It is 18C.<|im_end|>\n",
    "ASSISTANT-TWO You're welcome.<|im_end|>\n",
]


def _assert_only_assistant(text: str):
    for other in ("SYSTEM-TEXT", "USER-ONE", "USER-TWO", "TOOL-RESULT", "get_weather\", \"description"):
        assert other not in text


def test_chatml_multi_turn_tool_calls_mask_exactly_the_assistant_turns(tokenizer, tool_row):
    conv = to_conversation(tool_row, WHERE)
    result = tokenize_conversation(tokenizer, conv, WHERE)
    assert target_runs(tokenizer, result) == CHATML_TARGETS
    _assert_only_assistant("".join(target_runs(tokenizer, result)))
    # The input is exactly the template's text: tools rendered, no special token added (no BOS/EOS twice).
    rendered = tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
    assert tokenizer.decode(result["input_ids"]) == rendered
    assert "# Tools\n{\"type\": \"function\"" in rendered
    assert tokenizer.eos_token_id not in result["input_ids"]


def test_a_different_template_masks_correctly_too(make_tokenizer, tool_row):
    tok = make_tokenizer(LLAMA3)
    result = tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)
    assert target_runs(tok, result) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "ASSISTANT-ONE It is 18C.<|eot_id|>",
        "ASSISTANT-TWO You're welcome.<|eot_id|>",
    ]
    assert tok.decode(result["input_ids"]).startswith("<|start_header_id|>system<|end_header_id|>\n\nFunctions: get_weather")


def test_inst_template_without_generation_prompt_trains_on_answer_and_eos(make_tokenizer):
    tok = make_tokenizer(INST)
    row = {"conversations": [
        {"from": "system", "value": "SYSTEM-TEXT"},
        {"from": "human", "value": "USER-ONE"}, {"from": "gpt", "value": "ASSISTANT-ONE"},
        {"from": "human", "value": "USER-TWO"}, {"from": "gpt", "value": "ASSISTANT-TWO"},
    ]}
    result = tokenize_conversation(tok, to_conversation(row, WHERE), WHERE)
    assert target_runs(tok, result) == [" ASSISTANT-ONE</s>", " ASSISTANT-TWO</s>"]
    assert result["labels"][-1] == tok.eos_token_id  # EOS is a real special token here, and a target


def test_alpaca_row_through_chatml(tokenizer):
    conv = to_conversation({"instruction": "Add", "input": "1 and 2", "output": "3", "system": "math"}, WHERE)
    result = tokenize_conversation(tokenizer, conv, WHERE)
    assert target_runs(tokenizer, result) == ["3<|im_end|>\n"]


@pytest.fixture
def fast_tokenizer(chatml, tool_row):
    """A real fast (Rust) byte-level BPE tokenizer, trained here in milliseconds, with special tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([chatml, json.dumps(tool_row)] * 5, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = chatml
    return tok


def test_fast_tokenizer_uses_offsets_and_masks_the_same_text(fast_tokenizer, tool_row):
    assert fast_tokenizer.is_fast
    conv = to_conversation(tool_row, WHERE)
    result = tokenize_conversation(fast_tokenizer, conv, WHERE)
    assert target_runs(fast_tokenizer, result) == CHATML_TARGETS
    # One pass over the whole text: the ids are what inference would see.
    rendered = fast_tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
    assert result["input_ids"] == fast_tokenizer(rendered, add_special_tokens=False)["input_ids"]


NUMBERED = "<conversation of {{ messages | length }} messages>\n"  # rewrites the start whenever a turn is added


def test_template_that_is_not_prefix_stable_is_refused(make_tokenizer, chatml, tool_row):
    tok = make_tokenizer(NUMBERED + chatml)
    with pytest.raises(DataError) as info:
        tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)
    msg = str(info.value)
    assert msg.startswith(WHERE + ": ") and "not prefix-stable: the rendering of messages[:2] changes" in msg
    assert "'<conversation of 2" in msg and "'<conversation of 3" in msg  # shows where the renderings part


def test_generation_prompt_that_does_not_match_assistant_turns_is_refused(make_tokenizer, chatml, tool_row):
    tok = make_tokenizer(chatml.replace("{% if add_generation_prompt %}<|im_start|>assistant", "{% if add_generation_prompt %}<|im_start|>model"))
    with pytest.raises(DataError, match=r"not prefix-stable at messages\[2\] \(assistant\): its generation prompt \(add_generation_prompt=True\)"):
        tokenize_conversation(tok, to_conversation(tool_row, WHERE), WHERE)


def test_tokenizer_without_chat_template(make_tokenizer, tool_row):
    with pytest.raises(DataError, match=rf"^{WHERE}: the tokenizer \(ByT5Tokenizer\) has no chat template"):
        tokenize_conversation(make_tokenizer(None), to_conversation(tool_row, WHERE), WHERE)


def test_template_errors_become_data_errors(make_tokenizer, tool_row):
    with pytest.raises(DataError, match=rf"^{WHERE}: the tokenizer's chat template failed .*unsupported role tool"):
        tokenize_conversation(make_tokenizer(INST), to_conversation(tool_row, WHERE), WHERE)


def test_plain_text_trains_on_every_token_and_ends_with_eos(make_tokenizer):
    tok = make_tokenizer(None)  # text rows need no chat template
    result = tokenize_conversation(tok, to_conversation({"text": "héllo world"}, WHERE), WHERE)
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
