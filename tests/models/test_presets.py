"""The embedded tiny model: built once, atomically, deterministically; loads with Auto* classes;
its chat template renders tool calls and is prefix-stable."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.errors import ConfigError
from phalanx.models.presets import (
    CHAT_TEMPLATE,
    EMBEDDED_PRESETS,
    materialize_embedded_model,
    preset_hash,
)

NAME = "tiny-qwen3"


@pytest.fixture(scope="module")
def embedded_dir(tmp_path_factory) -> Path:
    return materialize_embedded_model(NAME, tmp_path_factory.mktemp("embedded"))


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_unknown_preset_lists_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="embedded:tiny-qwen3"):
        materialize_embedded_model("tiny-llama-9000", tmp_path)
    assert not list(tmp_path.iterdir())


def test_materialize_is_idempotent(embedded_dir):
    assert embedded_dir.name == f"{NAME}-{preset_hash(NAME)}"
    before = {p.name: p.stat().st_mtime_ns for p in embedded_dir.iterdir()}
    again = materialize_embedded_model(f"embedded:{NAME}", embedded_dir.parent)
    assert again == embedded_dir
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before
    assert "model.safetensors" in before and "chat_template.jinja" in before


def test_concurrent_materialization_is_safe_and_deterministic(embedded_dir, tmp_path):
    root = tmp_path / "shared"
    code = (
        "import sys; from pathlib import Path; "
        "from phalanx.models.presets import materialize_embedded_model as m; "
        "print(m(sys.argv[1], Path(sys.argv[2])))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(phalanx.__file__).parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, NAME, str(root)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    paths = {out.strip().splitlines()[-1] for out, _ in results}
    assert paths == {str(root / embedded_dir.name)}
    # Only the finished folder and the lock file remain; no half-built temporaries.
    assert sorted(p.name for p in root.iterdir()) == sorted([embedded_dir.name, f".{embedded_dir.name}.lock"])
    # Built in other processes, the bytes match the in-process build.
    assert _file_bytes(root / embedded_dir.name) == _file_bytes(embedded_dir)


def test_build_leaves_the_callers_rng_alone(tmp_path):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    materialize_embedded_model(NAME, tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_loads_with_auto_classes_and_runs_forward(embedded_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    cfg = model.config
    assert cfg.vocab_size >= len(tokenizer) and cfg.vocab_size % 8 == 0
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings >= 4096
    assert cfg.eos_token_id == tokenizer.eos_token_id and cfg.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(out.loss)


def test_special_tokens_survive_save_and_reload(tokenizer):
    assert type(tokenizer).__name__ == "ByT5Tokenizer"
    im_start = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_start) == 1 and len(im_end) == 1 and im_start != im_end
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end[0]
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id not in (im_start[0], im_end[0])
    assert {"<|im_start|>", "<|im_end|>"} <= set(tokenizer.all_special_tokens)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    # Special tokens keep the whitespace around them: rendered text round-trips exactly.
    text = "<|im_start|>user\n héllo <|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode()) - 2 * len("<|im_start|>") - len("<|im_end|>") + 3


BMI_TOOL = {
    "type": "function",
    "function": {
        "name": "get_bmi",
        "description": "Body-mass index.",
        "parameters": {
            "type": "object",
            "properties": {"weight_kg": {"type": "number"}, "height_cm": {"type": "number"}},
            "required": ["weight_kg", "height_cm"],
        },
    },
}
CLINIC_TOOL = {
    "type": "function",
    "function": {
        "name": "find_clinic",
        "description": "Clinics in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _call(call_id, name, arguments):
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a health assistant."},
    {"role": "user", "content": "BMI for 70 kg, 175 cm? And a clinic in Oslo."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            _call("call_1", "get_bmi", {"weight_kg": 70, "height_cm": 175}),
            _call("call_2", "find_clinic", {"city": "Oslo"}),
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"bmi": 22.9}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"name": "Aker"}'},
    {"role": "assistant", "content": "BMI 22.9; try Aker clinic."},
    {"role": "user", "content": "Thanks!"},
    {
        "role": "assistant",
        "content": "Let me log that.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_bmi", "arguments": {"weight_kg": 70, "height_cm": 175}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_3", "content": '{"bmi": 22.9}'},
    {"role": "assistant", "content": "Done."},
]

EXPECTED_TOOL_RENDERING = (
    "<|im_start|>system\nYou are a health assistant.\n\n"
    "# Tools\n<tools>\n"
    + json.dumps(BMI_TOOL["function"])
    + "\n"
    + json.dumps(CLINIC_TOOL["function"])
    + "\n</tools>\n"
    'Call a function with <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nBMI for 70 kg, 175 cm? And a clinic in Oslo.<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_bmi", "arguments": {"weight_kg": 70, "height_cm": 175}}\n</tool_call>\n'
    '<tool_call>\n{"name": "find_clinic", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n"
    '<tool_response>\n{"bmi": 22.9}\n</tool_response>\n'
    '<tool_response>\n{"name": "Aker"}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\nBMI 22.9; try Aker clinic.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
    "<|im_start|>assistant\nLet me log that.\n"
    '<tool_call>\n{"name": "get_bmi", "arguments": {"weight_kg": 70, "height_cm": 175}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n{"bmi": 22.9}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\nDone.<|im_end|>\n"
)


def _render(tokenizer, messages, tools=None, add_generation_prompt=False):
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def test_template_renders_a_tool_call_conversation(tokenizer):
    text = _render(tokenizer, TOOL_CONVERSATION, tools=[BMI_TOOL, CLINIC_TOOL])
    assert text == EXPECTED_TOOL_RENDERING


def test_template_without_system_or_tools(tokenizer):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert _render(tokenizer, msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert _render(tokenizer, msgs[:1], add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # Tools without a system message get a system turn of their own.
    assert _render(tokenizer, msgs, tools=[BMI_TOOL]).startswith("<|im_start|>system\n# Tools\n")


@pytest.mark.parametrize("tools", [None, [BMI_TOOL, CLINIC_TOOL]])
@pytest.mark.parametrize("drop_system", [False, True])
def test_template_is_prefix_stable(tokenizer, tools, drop_system):
    messages = TOOL_CONVERSATION[1:] if drop_system else TOOL_CONVERSATION
    # transformers refuses an empty conversation; its rendering is "" by definition.
    renders = [""] + [_render(tokenizer, messages[:k], tools=tools) for k in range(1, len(messages) + 1)]
    for k in range(len(messages)):
        assert renders[k + 1].startswith(renders[k]), f"messages[:{k}] is not a prefix of messages[:{k + 1}]"
    # The loss mask: each assistant turn is exactly what follows the generation prompt, and
    # earlier assistant turns are never rewritten.
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = _render(tokenizer, messages[:i], tools=tools, add_generation_prompt=True)
            assert renders[i + 1].startswith(prompt)
            assert renders[i + 1][len(prompt) :].endswith("<|im_end|>\n")
            assert "<|im_start|>" not in renders[i + 1][len(prompt) :]
    # Byte-level tokens are prefix-stable too.
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in renders[1:]]
    for shorter, longer in zip(ids, ids[1:]):
        assert longer[: len(shorter)] == shorter


def test_tool_call_arguments_as_string_or_dict_render_the_same(tokenizer):
    args = {"weight_kg": 70.5, "height_cm": 180, "note": "après"}
    as_string = [{"role": "assistant", "tool_calls": [_call("c", "get_bmi", args)]}]
    as_dict = [{"role": "assistant", "tool_calls": [{"function": {"name": "get_bmi", "arguments": args}}]}]
    assert _render(tokenizer, as_string) == _render(tokenizer, as_dict)


def test_every_preset_hash_is_distinct():
    hashes = {preset_hash(name) for name in EMBEDDED_PRESETS}
    assert len(hashes) == len(EMBEDDED_PRESETS)
