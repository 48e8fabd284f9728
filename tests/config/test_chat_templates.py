"""data.chat_template: phalanx's DeepSeek-R1-Distill template against the models' own, resolving the value, and a
real run that saves the template it trained with."""

import re

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from helpers import ROOT, run_phalanx, shared_template, trained_runs, write_chat_jsonl
from phalanx.config.chat_templates import resolve_chat_template, shipped_templates
from phalanx.config.loader import load_config
from phalanx.data.chat import tokenize_conversation
from phalanx.data.formats import to_conversation
from phalanx.errors import ConfigError

ORIGINAL = shared_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B").read_text()
OURS = resolve_chat_template("deepseek-r1-distill")
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CALL_BMI = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_bmi\n```json\n{"weight_kg": 70}\n```<｜tool▁call▁end｜>'
CALL_TIME = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "UTC"}\n```<｜tool▁call▁end｜>'


def render(template: str, messages: list[dict], generation_prompt: bool = False) -> str:
    return render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=generation_prompt, bos_token=BOS, eos_token=EOS
    )[0][0]


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


BMI, TIME = call("get_bmi", '{"weight_kg": 70}'), call("get_time", '{"tz": "UTC"}')
PLAIN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "<think>greet back</think>\n\nhello"},
    {"role": "user", "content": "and now?"},
    {"role": "assistant", "content": "still here"},
]
TWO_CALLS = [  # what the original handles: content None, arguments as a string, two calls, then the results
    {"role": "system", "content": "You may call tools."},
    {"role": "user", "content": "BMI and time?"},
    {"role": "assistant", "content": None, "tool_calls": [BMI, TIME]},
    {"role": "tool", "content": '{"bmi": 22.9}'},
    {"role": "tool", "content": '{"time": "12:00"}'},
    {"role": "assistant", "content": "22.9, at noon."},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "<think>polite</think>you're welcome"},
]


@pytest.mark.parametrize("messages", [PLAIN, TWO_CALLS], ids=["plain-multi-turn", "two-calls"])
def test_same_text_as_the_original_where_the_original_is_right(messages):
    for n in range(len(messages) + 1):
        for generation_prompt in (False, True):
            assert render(OURS, messages[:n], generation_prompt) == render(ORIGINAL, messages[:n], generation_prompt)
    # phalanx normalises the row (content "" and arguments as a mapping): the text stays the original's
    normalised = to_conversation({"messages": TWO_CALLS}, "row 1")["messages"]
    assert normalised[2]["content"] == "" and isinstance(normalised[2]["tool_calls"][0]["function"]["arguments"], dict)
    assert render(OURS, normalised) == render(ORIGINAL, TWO_CALLS)


def test_one_call_is_closed():
    messages = [{"role": "user", "content": "BMI?"}, {"role": "assistant", "content": None, "tool_calls": [BMI]}]
    expected = f"{BOS}<｜User｜>BMI?<｜Assistant｜><｜tool▁calls▁begin｜>{CALL_BMI}<｜tool▁calls▁end｜>{EOS}"
    assert render(OURS, messages) == expected
    assert render(ORIGINAL, messages) == expected.removesuffix(f"<｜tool▁calls▁end｜>{EOS}")  # never closed


@pytest.mark.parametrize("content", ["", "missing", "Let me check."])
def test_calls_render_whatever_the_content(content):
    turn = {"role": "assistant", "tool_calls": [BMI, TIME]}
    if content != "missing":
        turn["content"] = content
    text = "Let me check." if content == "Let me check." else ""
    expected = (
        f"{BOS}<｜User｜>q<｜Assistant｜>{text}<｜tool▁calls▁begin｜>{CALL_BMI}\n{CALL_TIME}<｜tool▁calls▁end｜>{EOS}"
    )
    assert render(OURS, [{"role": "user", "content": "q"}, turn]) == expected
    if content != "missing":  # the original writes the text (or nothing) and drops the calls
        assert (
            render(ORIGINAL, [{"role": "user", "content": "q"}, turn]) == f"{BOS}<｜User｜>q<｜Assistant｜>{text}{EOS}"
        )


def test_arguments_as_a_mapping_are_written_as_json():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_bmi", {"weight_kg": 70})]},
    ]
    assert CALL_BMI in render(OURS, messages)
    with pytest.raises(TypeError):  # the original concatenates: str + dict
        render(ORIGINAL, messages)


def test_later_tool_rounds_keep_their_markers():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [BMI]},
        {"role": "tool", "content": "A"},
        {"role": "assistant", "content": "thinking aloud", "tool_calls": [TIME]},  # calls right after tool results
        {"role": "tool", "content": "B"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": None, "tool_calls": [BMI, TIME, BMI]},
        {"role": "tool", "content": "C"},
        {"role": "user", "content": "never mind"},
    ]
    ours = render(OURS, messages)
    calls = f"<｜tool▁calls▁begin｜>{CALL_BMI}\n{CALL_TIME}\n{CALL_BMI}<｜tool▁calls▁end｜>{EOS}"
    assert ours == (
        f"{BOS}<｜User｜>q<｜Assistant｜><｜tool▁calls▁begin｜>{CALL_BMI}<｜tool▁calls▁end｜>{EOS}"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>A<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        f"thinking aloud<｜tool▁calls▁begin｜>{CALL_TIME}<｜tool▁calls▁end｜>{EOS}"
        f"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>B<｜tool▁output▁end｜><｜tool▁outputs▁end｜>done{EOS}"
        f"<｜User｜>again<｜Assistant｜>{calls}"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>C<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜User｜>never mind"
    )
    original = render(ORIGINAL, [m if "tool_calls" not in m else {**m, "content": None} for m in messages])
    assert original.count("<｜Assistant｜><｜tool▁calls▁begin｜>") == 1  # later tool-calling turns lose the opener
    assert original.count("<｜tool▁outputs▁begin｜>") == 1  # later rounds of results lose theirs
    # one list never closed, the next closed after each of its calls: 4 closings for 3 lists
    assert original.count("<｜tool▁calls▁end｜>") == 4 and ours.count("<｜tool▁calls▁end｜>") == 3


@pytest.mark.parametrize("messages", [PLAIN, TWO_CALLS], ids=["plain-multi-turn", "two-calls"])
def test_prefix_stable_and_no_generation_prompt_after_tool_results(messages):
    for n in range(len(messages)):
        if messages[n]["role"] != "tool":  # (a result after a result reopens the closed round, as in the original)
            assert render(OURS, messages[: n + 1]).startswith(render(OURS, messages[:n]))
    after_results = render(OURS, TWO_CALLS[:5], generation_prompt=True)
    assert after_results.endswith("<｜tool▁outputs▁end｜>") and after_results == render(OURS, TWO_CALLS[:5])
    assert render(OURS, PLAIN[:4], generation_prompt=True).endswith("<｜User｜>and now?<｜Assistant｜><think>\n")


# --- resolving data.chat_template ---------------------------------------------------------------


def test_shipped_templates_are_listed_described_and_packaged():
    names = shipped_templates()
    folder = ROOT / "src" / "phalanx" / "config" / "templates"
    assert set(names) == {p.stem for p in folder.glob("*.jinja")} and "deepseek-r1-distill" in names
    assert all(about and "\n" not in about for about in names.values())
    assert '"config/templates/*.jinja"' in (ROOT / "pyproject.toml").read_text()


def test_a_file_path_wins_and_bad_values_name_the_field(tmp_path):
    own = tmp_path / "own.jinja"
    own.write_text("{{ messages[0].content }}")
    assert resolve_chat_template(str(own)) == "{{ messages[0].content }}"
    own.write_bytes(b"\xef\xbb\xbf{{ messages[0].content }}")  # saved by a Windows editor: the mark is not text
    assert resolve_chat_template(str(own)) == "{{ messages[0].content }}"
    with pytest.raises(ConfigError) as e:
        resolve_chat_template("nosuch")
    assert str(e.value).startswith("data.chat_template = 'nosuch': no such file")
    assert "path of a jinja file" in str(e.value) and "deepseek-r1-distill (" in str(e.value)
    # A typo: the nearest file in that folder, or shipped name, is named; a folder that is not there is said.
    with pytest.raises(ConfigError, match=rf"no template phalanx ships has that name\. Did you mean {own}\? Give"):
        resolve_chat_template(str(tmp_path / "own.jinj"))
    with pytest.raises(ConfigError, match=r"that name\. Did you mean deepseek-r1-distill\? Give"):
        resolve_chat_template("deepseek-r1-distil")
    with pytest.raises(ConfigError, match=rf"that name\. There is no folder {tmp_path}/templtes\. Give"):
        resolve_chat_template(str(tmp_path / "templtes" / "own.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ConfigError, match=r"broken.jinja line 2 is not valid jinja: unexpected '}'"):
        resolve_chat_template(str(broken))
    # jinja, but not what transformers renders: a filter or tag of another engine is named
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}\n{{ m.content | from_json }}{% endfor %}")
    with pytest.raises(
        ConfigError, match=r"other.jinja line 2 cannot be rendered by transformers: .*filter 'from_json'"
    ):
        resolve_chat_template(str(other))
    other.write_text("{% set seen = [] %}\n{% do seen.append(1) %}")
    with pytest.raises(
        ConfigError, match=r"other.jinja line 2 cannot be rendered by transformers: .*the jinja tag 'do'"
    ):
        resolve_chat_template(str(other))
    # A block closed by the wrong end tag (MiroThinker-v1: an `if` left open inside a `for`) is broken jinja, whatever
    # renders it: jinja's own message says which block is open, not a tag transformers lacks.
    broken.write_text("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}\n{% endfor %}")
    with pytest.raises(ConfigError) as e:
        resolve_chat_template(str(broken))
    assert "broken.jinja line 2 is not valid jinja: Encountered unknown tag 'endfor'" in str(e.value)
    assert "innermost block that needs to be closed is 'if'" in str(e.value) and "transformers" not in str(e.value)
    with pytest.raises(ConfigError, match="is a folder"):
        resolve_chat_template(str(tmp_path))


def test_the_tokenizer_records_which_template_it_was_given(tmp_path):
    """So a template that cannot be rendered is named in the refusal (phalanx.data.chat.template_name)."""
    from phalanx.data.chat import template_name
    from phalanx.models.load import load_tokenizer

    assert template_name(load_tokenizer("embedded:tiny-qwen3")).startswith("the chat template of ")
    tok = load_tokenizer("embedded:tiny-qwen3", chat_template="deepseek-r1-distill")
    assert template_name(tok) == "the chat template 'deepseek-r1-distill' (data.chat_template)"


def test_a_models_json_file_or_folder_gives_its_chat_template_field(tmp_path):
    """What model repositories ship: chat_template.json ({"chat_template": text}), tokenizer_config.json (the text, or
    a list of named templates), or a folder holding either (or chat_template.jinja). The template comes out of the
    field, never the JSON text itself rendered as a template (which wrapped every row in `{"chat_template": "`)."""
    import json

    text = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
    tools = "TOOLS\n" + text
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": text}))
    assert resolve_chat_template(str(tmp_path / "chat_template.json")) == text
    (tmp_path / "wrapped.jinja").write_text(json.dumps({"chat_template": text}, indent=2))  # JSON under another name
    assert resolve_chat_template(str(tmp_path / "wrapped.jinja")) == text
    config = {"model_max_length": 4096, "chat_template": [{"name": "default", "template": text}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert resolve_chat_template(str(tmp_path / "tokenizer_config.json")) == text  # one name: that text
    config["chat_template"].append({"name": "tool_use", "template": tools})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert resolve_chat_template(str(tmp_path / "tokenizer_config.json")) == {"default": text, "tool_use": tools}

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": text}))
    assert resolve_chat_template(str(model)) == text
    (model / "chat_template.jinja").write_text(tools)  # written by save_pretrained; read before the JSON files
    assert resolve_chat_template(str(model)) == tools
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "rag.jinja").write_text(text)
    assert resolve_chat_template(str(model)) == {"default": tools, "rag": text}

    refusals = {
        "no_field.json": (json.dumps({"model_max_length": 8}), "no_field.json has no chat_template field"),
        "broken.json": ('{"chat_template": ', "broken.json is not valid JSON"),
        "odd.json": (json.dumps({"chat_template": 3}), "chat_template is neither a template's text nor a list"),
        "no_default.json": (
            json.dumps({"chat_template": [{"name": "a", "template": text}, {"name": "b", "template": text}]}),
            "holds named templates (a, b) and none is named 'default'",
        ),
        "bad_jinja.json": (json.dumps({"chat_template": "{% if %}"}), "bad_jinja.json line 1 is not valid jinja"),
    }
    for name, (content, message) in refusals.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(ConfigError, match=r"^data\.chat_template = .*" + re.escape(message)):
            resolve_chat_template(str(tmp_path / name))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="is a folder with no chat template in it"):
        resolve_chat_template(str(empty))


def test_named_templates_from_a_file_render_rows_with_tools_with_tool_use(tmp_path):
    """tokenizer_config.json's list: as transformers does with a model that ships one, a row with tools renders with
    'tool_use' and a row without with 'default'; the trained text is each one's own."""
    import json

    from helpers import chat_row
    from phalanx.models.load import load_tokenizer

    tool_row = chat_row(0)
    own = load_tokenizer("embedded:tiny-qwen3").chat_template
    named = [{"name": "default", "template": own}, {"name": "tool_use", "template": "TOOL-USE-TEMPLATE\n" + own}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    tok = load_tokenizer("embedded:tiny-qwen3", chat_template=str(tmp_path / "tokenizer_config.json"))
    with_tools = tokenize_conversation(tok, to_conversation(tool_row, "row 1"), "row 1").examples[0]
    plain = {"messages": [m for m in tool_row["messages"] if m["role"] in ("system", "user")][:2]}
    plain["messages"].append({"role": "assistant", "content": "Hello."})
    without = tokenize_conversation(tok, to_conversation(plain, "row 2"), "row 2").examples[0]
    assert tok.decode(with_tools["input_ids"]).startswith("TOOL-USE-TEMPLATE")
    assert "TOOL-USE-TEMPLATE" not in tok.decode(without["input_ids"])
    assert any(label != -100 for label in with_tools["labels"]) and any(label != -100 for label in without["labels"])


def test_checked_when_the_config_is_read_and_before_launch():
    assert load_config(None, {"data.chat_template": "deepseek-r1-distill"}).data.chat_template == "deepseek-r1-distill"
    with pytest.raises(ConfigError, match=r"field 'data.chat_template' = 'nosuch': no such file"):
        load_config(None, {"data.chat_template": "nosuch"})
    from phalanx.generate.args import parse_args
    from phalanx.launch.command import check_training

    with pytest.raises(ConfigError, match="data.chat_template"):  # phalanx launcher / slurm
        check_training(None, ["--chat_template", "nosuch"], num_nodes=1, nproc_per_node=2, gpus=0)
    with pytest.raises(ConfigError, match="--chat_template nosuch: no such file"):
        parse_args(["--chat_template", "nosuch"])


# --- a real run -----------------------------------------------------------------------------------


@pytest.mark.system
def test_the_template_is_saved_in_checkpoints_and_output_and_used_by_generate(tmp_path):
    from transformers import AutoTokenizer

    from phalanx.generate.args import parse_args
    from phalanx.generate.job import plan_job
    from phalanx.models.presets import CHAT_TEMPLATE

    data = write_chat_jsonl(tmp_path / "data" / "train.jsonl", 6)
    template = tmp_path / "mine.jinja"
    template.write_text("{#- the tiny model's template under another name -#}\n" + CHAT_TEMPLATE)
    out = tmp_path / "out"
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(data.parent),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--save_steps",
        "1",
        "--test_size",
        "0",
        "--max_length",
        "512",
        "--chat_template",
        str(template),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for folder in (out, out / "checkpoint-1"):
        assert (folder / "chat_template.jinja").read_text() == template.read_text()
        assert AutoTokenizer.from_pretrained(folder).chat_template == template.read_text()
    job = plan_job(parse_args(["--adapter", str(out), "--num_questions", "1"]), warn=print)
    assert job.tokenizer.chat_template == template.read_text()


@pytest.mark.system
def test_an_unknown_template_stops_train_before_it_starts(tmp_path):
    out = tmp_path / "out"
    proc = run_phalanx("train", "--output_dir", str(out), "--max_steps", "1", "--chat_template", "nosuch")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "field 'data.chat_template' = 'nosuch': no such file" in proc.stderr
    assert "deepseek-r1-distill" in proc.stderr and "Traceback" not in proc.stderr and not out.exists()


def test_tool_rows_train_with_exact_masks_under_the_corrected_template():
    """Every call list and answer trains (with its end-of-sentence); no header, user text or tool output does."""
    from data.templates import build_tokenizer

    tok = build_tokenizer(OURS, bos_token=BOS, eos_token=EOS)
    messages = TWO_CALLS[:6] + [
        {"role": "assistant", "content": "", "tool_calls": [call("get_bmi", {"weight_kg": 70})]},
        {"role": "tool", "content": '{"bmi": 22.9}'},
        {"role": "assistant", "content": "same"},
    ]
    result = tokenize_conversation(tok, to_conversation({"messages": messages}, "row 1"), "row 1")
    assert result.policy == "full"
    runs = trained_runs(tok, result.examples[0])
    assert runs == [
        f"<｜tool▁calls▁begin｜>{CALL_BMI}\n{CALL_TIME}<｜tool▁calls▁end｜>{EOS}",
        f"22.9, at noon.{EOS}",
        f"<｜tool▁calls▁begin｜>{CALL_BMI}<｜tool▁calls▁end｜>{EOS}",
        f"same{EOS}",
    ]


def test_a_templates_own_switches_are_the_names_it_reads_with_a_fallback():
    """What data.chat_template_kwargs can set: names a template tests with `is defined` and never gets from
    apply_chat_template (messages, tools, special tokens, transformers' functions), nor sets itself first."""
    from phalanx.config.chat_templates import template_variables

    assert template_variables(shared_template("Qwen-Qwen3-0.6B").read_text()) == ["enable_thinking"]
    assert template_variables(shared_template("meta-llama-Llama-3.1-8B-Instruct").read_text()) == [
        "builtin_tools",
        "custom_tools",
        "date_string",
        "tools_in_user_message",
    ]
    assert template_variables(ORIGINAL) == []  # R1-Distill has none
    own = "{% if tools is defined %}{{ bos_token }}{% endif %}{% if eos_token is defined and strftime_now is defined %}"
    assert template_variables(own + "{% endif %}{% if mine is not defined %}x{% endif %}") == ["mine"]
    assert template_variables("{% if broken") == []


def test_a_variable_the_template_writes_and_nothing_sets_is_named():
    """GigaChat 3.5 writes "Текущая дата: " ~ current_date into its default system prompt: unset, every row trains on
    a blank date, silently. Named only when the value is written in place (a switch, a name the template sets itself or
    tests, or one the run gives, is not)."""
    from transformers import ByT5Tokenizer

    from phalanx.config.chat_templates import template_variables, variables_written_empty

    tok = ByT5Tokenizer()
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tok.chat_template = "Date: {{ current_date }}\n" + chatml
    assert variables_written_empty(tok) == {"current_date": "every"}
    assert variables_written_empty(tok, {"current_date": "2026-11-27"}) == {}
    tok.chat_template = (
        "{% if extra %}Extra: {{ extra }}\n{% endif %}"  # a switch: unset, the part is not there at all
        "{% if today is defined %}{{ today }}{% endif %}"  # read with a fallback
        "{% set mine = 'x' %}{{ mine }}"  # set by the template itself
        "{{ eos_token }}" + chatml  # a special token the tokenizer has
    )
    assert variables_written_empty(tok) == {}
    tok.chat_template = "{{ messages | nosuchfilter }}"  # does not render: nothing to say here (refused elsewhere)
    assert variables_written_empty(tok) == {}
    assert template_variables("{{ messages | nosuchfilter }}{% if x is defined %}{% endif %}") == []


def test_a_default_system_prompts_variable_is_written_only_into_rows_without_a_system_message():
    """Jamba 1.6 fills in `default_system_message` only where the conversation brings no system message: said of
    those rows, not of every row."""
    from transformers import ByT5Tokenizer

    from phalanx.config.chat_templates import variables_written_empty

    tok = ByT5Tokenizer()
    tok.chat_template = (
        "{% set default_system_message = default_system_message or '' %}"
        "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}"
        "{% else %}{% set system = default_system_message %}{% set rest = messages %}{% endif %}"
        "<|system|>{{ system }}\n{% for m in rest %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    )
    assert variables_written_empty(tok) == {"default_system_message": "without_system"}
    tok.chat_template = "{% if messages[0].role == 'system' %}Today: {{ today_text }}\n{% endif %}"
    assert variables_written_empty(tok) == {"today_text": "with_system"}


def test_a_special_token_the_tokenizer_lacks_is_said_to_be_written_empty():
    """`{{ bos_token }}` in a template written for a tokenizer with one (Mistral's, given to a tokenizer without a bos)
    writes nothing, silently; named, with what to do (a template variable cannot give a token the tokenizer lacks)."""
    from transformers import ByT5Tokenizer

    from phalanx.config.chat_templates import variables_written_empty, written_empty_notes

    tok = ByT5Tokenizer()  # eos, pad and unk; no bos
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tok.chat_template = "{{ bos_token }}{{ eos_token }}" + chatml
    written = variables_written_empty(tok)
    assert written == {"bos_token": "every"}
    (note,) = written_empty_notes(written, "advice for {name}")
    assert note.startswith("the chat template writes bos_token into every row, which this tokenizer does not have")
    assert "advice for" not in note and "--chat_template FILE|NAME" in note
    tok.chat_template = "{% if bos_token is defined %}{{ bos_token }}{% endif %}" + chatml  # its own fallback
    assert variables_written_empty(tok) == {}
