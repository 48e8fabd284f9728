"""Prompt files: every training format plus plain questions; errors name the line; rendering as training renders."""

import json

import pytest

from helpers import chat_row
from phalanx.errors import ConfigError, DataError
from phalanx.generate.prompts import plain_transcript, prompts_digest, read_prompts
from phalanx.models.load import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded:tiny-qwen3")


def write(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_every_format_becomes_a_prompt(tmp_path, tok):
    path = write(
        tmp_path / "p.jsonl",
        chat_row(3),  # a full training row: its final assistant answer is dropped, the tool result is answered
        {"question": "Is 8 hours of sleep enough?"},
        {"prompt": "Name a vegetable.", "system": "Answer in one word."},
        {"instruction": "Convert to kg", "input": "150 lb", "output": "68 kg"},
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi!"}], "system": "Be kind."},
        "",
        {"question": "last"},
    )
    warnings = []
    prompts = read_prompts(str(path), tok, warn=warnings.append)
    assert [p.id for p in prompts] == list(range(6)) and not warnings
    assert all(p.text is None for p in prompts)
    assert [p.where.rsplit(" ", 1)[1] for p in prompts] == ["1", "2", "3", "4", "5", "7"]  # blank line 6 skipped
    chat = prompts[0]
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.tools[0]["function"]["name"] == "get_bmi"
    assert chat.messages[2]["tool_calls"][0]["function"]["arguments"] == {"weight_kg": 53, "height_cm": 153}
    assert prompts[1].messages == [{"role": "user", "content": "Is 8 hours of sleep enough?"}]
    assert prompts[2].messages[0] == {"role": "system", "content": "Answer in one word."}
    assert prompts[3].messages == [{"role": "user", "content": "Convert to kg\n\n150 lb"}]
    assert [m["role"] for m in prompts[4].messages] == ["system", "user"]
    # Rendered with the template's generation prompt, tokenized as training tokenizes.
    rendered = tok.apply_chat_template(chat.messages, tools=chat.tools, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert list(chat.input_ids) == tok(rendered, add_special_tokens=False)["input_ids"]


def test_text_rows_are_continued_and_never_mixed_with_chat(tmp_path, tok):
    prompts = read_prompts(str(write(tmp_path / "t.jsonl", {"text": "Once upon a time"}, {"text": "Dear diary,"})), tok)
    assert prompts[0].messages is None and prompts[0].text == "Once upon a time"
    assert tok.decode(prompts[0].input_ids) == "Once upon a time"
    with pytest.raises(
        DataError, match=r"m.jsonl line 2: a plain-text row .*m.jsonl line 1 is a chat prompt.*not both"
    ):
        read_prompts(str(write(tmp_path / "m.jsonl", {"question": "q"}, {"text": "t"})), tok)


def test_num_questions_and_txt_files(tmp_path, tok):
    path = tmp_path / "q.txt"
    path.write_text("first question?\n\nsecond question?\nthird\n")
    assert [p.messages[-1]["content"] for p in read_prompts(str(path), tok, 2)] == [
        "first question?",
        "second question?",
    ]
    warnings = []
    assert len(read_prompts(str(path), tok, 10, warn=warnings.append)) == 3
    assert "--num_questions 10" in warnings[0] and "only 3 prompts" in warnings[0]
    assert len(read_prompts("bundled:health-agent", tok, 88)) == 88  # seed 001's --num_questions 88, no file needed
    notepad = tmp_path / "notepad.txt"  # a Windows editor's byte-order mark and line ends are not the question's
    notepad.write_bytes(b"\xef\xbb\xbffirst question?\r\nsecond\r\n")
    assert [p.messages[-1]["content"] for p in read_prompts(str(notepad), tok)] == ["first question?", "second"]


BAD = {
    "malformed_json": (
        ['{"question": "ok"}', '{"question": "ok"}', '{"question": '],
        ["p.jsonl line 3", "malformed JSON"],
    ),
    "unknown_shape": ([{"question": "ok"}, {"query": "what?"}], ["p.jsonl line 2", "'query'", "accepted prompt rows"]),
    "no_user_turn": (
        [{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}],
        ["p.jsonl line 1", "no user message to answer", "system, assistant"],
    ),
    "bad_role": (
        [{"question": "ok"}, {"messages": [{"role": "bot", "content": "x"}]}],
        ["p.jsonl line 2", "messages[0].role", "'bot'"],
    ),
    "empty_question": ([{"question": "  "}], ["p.jsonl line 1", "question", "non-empty"]),
    "not_an_object": (['["a list"]'], ["p.jsonl line 1", "expected a JSON object"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_prompt_rows_name_the_line(case, tmp_path, tok):
    rows, needles = BAD[case]
    with pytest.raises(DataError) as info:
        read_prompts(str(write(tmp_path / "p.jsonl", *rows)), tok)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_empty_prompt_sets(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        read_prompts(str(tmp_path / "empty.jsonl"), tok)
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(DataError, match="no prompts"):
        read_prompts(str(tmp_path / "empty.txt"), tok)
    with pytest.raises(DataError, match="no such file"):
        read_prompts(str(tmp_path / "missing.jsonl"), tok)


def test_plain_transcript_without_a_chat_template(tok):
    text = plain_transcript(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}],
        [{"type": "function", "function": {"name": "f"}}],
    )
    assert text == 'tools: [{"type": "function", "function": {"name": "f"}}]\nsystem: s\nuser: q?\nassistant: '


def test_digest_follows_content(tmp_path, tok):
    a = read_prompts(str(write(tmp_path / "a.jsonl", {"question": "x"}, {"question": "y"})), tok)
    b = read_prompts(str(write(tmp_path / "b.jsonl", {"question": "x"}, {"question": "z"})), tok)
    assert prompts_digest(a) == prompts_digest(read_prompts(str(tmp_path / "a.jsonl"), tok)) != prompts_digest(b)


def test_template_variables_shape_the_prompt_and_default_to_the_adapters_run(tmp_path):
    """Qwen3 with enable_thinking false pre-fills an empty think block, as training masked it; an adapter's run
    record gives the variables when --chat_template_kwargs is not given; reserved names are refused by flag."""
    from data.templates import build_tokenizer
    from helpers import run_phalanx, shared_template
    from phalanx.generate.job import adapter_template_kwargs

    qwen3 = build_tokenizer(shared_template("Qwen-Qwen3-0.6B").read_text(encoding="utf-8"))
    prompts = write(tmp_path / "p.jsonl", {"question": "Hi?"})
    plain = read_prompts(str(prompts), qwen3, template_kwargs={"enable_thinking": False})[0]
    thinking = read_prompts(str(prompts), qwen3)[0]
    assert qwen3.decode(list(plain.input_ids)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.decode(list(thinking.input_ids)).endswith("<|im_start|>assistant\n")

    record = {"config": {"data": {"chat_template_kwargs": {"enable_thinking": False}}}}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "training_info.json").write_text(json.dumps(record))
    assert adapter_template_kwargs(str(tmp_path / "run")) == {"enable_thinking": False}
    (tmp_path / "run" / "checkpoint-4").mkdir()  # a checkpoint records its config in trainer_state.json
    (tmp_path / "run" / "checkpoint-4" / "trainer_state.json").write_text(json.dumps(record))
    assert adapter_template_kwargs(str(tmp_path / "run" / "checkpoint-4")) == {"enable_thinking": False}
    assert adapter_template_kwargs(str(tmp_path)) == {} and adapter_template_kwargs(None) == {}

    refused = run_phalanx("generate", "--chat_template_kwargs", "{messages: []}")
    assert refused.returncode == 2 and "--chat_template_kwargs: messages: set by phalanx" in refused.stderr


def test_a_prompt_the_template_raises_on_names_the_prompt_and_what_to_do():
    """Gemma-like templates refuse a role: the prompt is named, with the template's words and the way on (the same
    message a training row gets: data.chat.template_refused)."""
    from transformers import AutoTokenizer

    from phalanx.generate.prompts import render_prompt
    from phalanx.models.load import resolve_model_path

    strict = AutoTokenizer.from_pretrained(resolve_model_path("embedded:tiny-qwen3"))
    strict.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(DataError) as err:
        render_prompt(strict, messages, None, None, "prompts.jsonl line 4")
    message = str(err.value)
    assert message.startswith("prompts.jsonl line 4: the chat template failed on this prompt "), message
    assert "(roles: system, user): TemplateError: System role not supported" in message, message
    assert "or use a template that takes it (--chat_template FILE|NAME)" in message, message


def test_a_template_that_reads_content_as_text_parts_renders_the_prompt_as_training_does():
    """Gemma 3's first template reads the system prompt as `content[0]['text']`: training gives it the contents as text
    parts when the string fails (data.chat), so the prompt does too; it was refused, naming the system message."""
    from transformers import AutoTokenizer

    from phalanx.generate.prompts import render_prompt
    from phalanx.models.load import resolve_model_path

    parts = AutoTokenizer.from_pretrained(resolve_model_path("embedded:tiny-qwen3"))
    parts.chat_template = (
        "{% if messages[0].role == 'system' %}{{ '[' + messages[0].content[0].text + ']' }}"
        "{% set messages = messages[1:] %}{% endif %}{% for m in messages %}{{ m.role }}: "
        "{% if m.content is string %}{{ m.content }}{% else %}{{ m.content[0].text }}{% endif %}{{ '\n' }}{% endfor %}"
        "assistant:"
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = render_prompt(parts, messages, None, None, "prompts.jsonl line 4")
    assert parts.decode(ids) == "[Be brief.]user: Hi\nassistant:"
    assert messages[0]["content"] == "Be brief."  # the prompt's own messages are left as they were


def test_a_prompt_quoting_a_special_token_is_encoded_as_text_as_training_encodes_it():
    """A prompt that quotes the tokenizer's end-of-sequence token does not close its turn (data.special_text)."""
    from transformers import AutoTokenizer

    from phalanx.generate.prompts import render_prompt
    from phalanx.models.load import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("embedded:tiny-qwen3"))
    eos = tok.eos_token
    messages = [{"role": "user", "content": f"Repeat {eos} twice."}]
    ids = render_prompt(tok, messages, None, None, "prompts.jsonl line 1")
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids) == rendered  # every character as written
    assert ids.count(tok.eos_token_id) == rendered.count(eos) - 1  # the template's own ends only
    assert messages[0]["content"] == f"Repeat {eos} twice."


def test_a_missing_prompts_path_the_model_and_dtype_are_named_by_their_flags(tmp_path, capsys):
    """generate's errors name what the user typed (--prompts, --model_name), not train's config fields; --dtype
    also takes train's spellings (fp32, bf16, fp16)."""
    from phalanx.generate.args import parse_args
    from phalanx.generate.job import plan_job

    with pytest.raises(DataError, match=f"--prompts {tmp_path}/none.jsonl: no such file or folder; accepted: "):
        read_prompts(str(tmp_path / "none.jsonl"), None)
    # a file of another type: named by the flag, with .txt among what is accepted (training's list, without it, and
    # without the flag, was given)
    (tmp_path / "questions.csv").write_text("q\n")
    with pytest.raises(DataError, match=r"--prompts .*questions.csv: unsupported file type '.csv'; accepted: .*\.txt"):
        read_prompts(str(tmp_path / "questions.csv"), None)
    # a folder without data files: the same (a folder of .txt files is no dataset; each .txt is given as a file)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        DataError, match=r"--prompts .*empty: a folder with no \*.jsonl or \*.parquet files; accepted: .*\.txt"
    ):
        read_prompts(str(tmp_path / "empty"), None)
    (tmp_path / "empty" / "qs.txt").write_text("why?\n")
    with pytest.raises(DataError, match=r"its qs.txt must be given as a file: --prompts .*empty/qs.txt\)"):
        read_prompts(str(tmp_path / "empty"), None)
    args = parse_args(["--model_name", str(tmp_path / "no-model"), "--output", str(tmp_path / "o.jsonl")])
    with pytest.raises(ConfigError, match=f"--model_name '{tmp_path}/no-model': no such folder"):
        plan_job(args, warn=print)
    assert [parse_args(["--dtype", name]).dtype for name in ("fp32", "bf16", "fp16", "float16")] == [
        "float32",
        "bfloat16",
        "float16",
        "float16",
    ]
