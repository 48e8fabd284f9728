"""models.load: what a model_name that cannot be loaded is told."""

from pathlib import Path

import pytest

from phalanx.errors import ConfigError
from phalanx.models.load import resolve_model_path, stop_also_at


def test_a_model_name_that_is_a_file_or_a_folder_without_config_is_named_as_such(tmp_path):
    """A file (a .safetensors given for the folder) was called "a folder without config.json"."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"model.safetensors' is a file, not a model folder; expected a folder"):
        resolve_model_path(str(weights))
    with pytest.raises(ConfigError, match="is a folder without config.json; expected a folder written by"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def _model_folder(tmp_path: Path, template) -> Path:
    """A model folder (config.json and the embedded tokenizer) whose tokenizer carries `template`."""
    from phalanx.models.load import load_tokenizer

    folder = tmp_path / "model"
    tokenizer = load_tokenizer("embedded:tiny-qwen3")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text("{}")
    return folder


def test_a_model_whose_own_template_does_not_compile_is_refused_at_load_naming_its_file_and_line(tmp_path):
    """A model's own template that does not compile (MiroThinker-v1's llama.cpp copy leaves an `if` open inside a
    `for`) renders no row: the tokenizer loader says so, with the file transformers read it from and its line,
    before any data is read, instead of refusing the first row as if the row were at fault."""
    from phalanx.models.load import load_tokenizer

    broken = "{% for m in messages %}\n{% if m.role == 'user' %}{{ m.content }}\n{% endfor %}"
    folder = _model_folder(tmp_path, broken)
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(folder))
    message = str(info.value)
    assert message.startswith(
        f"model.model_name = '{folder}': its chat template {folder / 'chat_template.jinja'} line 3 is not valid "
        "jinja: Encountered unknown tag 'endfor'."
    )
    assert "No row renders with it: fix the template, or give one that compiles with data.chat_template" in message
    # Replacing it is the way out: a given template is used and the broken own one is not looked at.
    assert load_tokenizer(str(folder), chat_template="deepseek-r1-distill").chat_template.startswith(
        "{#-\n  DeepSeek-R1-Distill-Qwen"
    )


def test_a_broken_named_template_and_a_sandbox_gap_are_named_too(tmp_path):
    """transformers' dict form (several named templates): the one that does not compile is named. A tag jinja knows
    but transformers' sandbox does not load (`do`) is said as what the sandbox lacks."""
    from phalanx.models.load import load_tokenizer

    good = "{% for m in messages %}{{ m.content }}{% endfor %}"
    folder = _model_folder(tmp_path, {"default": good, "tool_use": good + "{% do tools.append(1) %}"})
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(folder))
    message = str(info.value)
    assert f"its chat template {folder / 'additional_chat_templates' / 'tool_use.jinja'} line 1 cannot be rendered" in (
        message
    )
    assert (
        "line 1 cannot be rendered by transformers: it uses the jinja tag 'do', which transformers does not enable"
        in message
    )
    assert load_tokenizer(str(_model_folder(tmp_path / "fine", {"default": good, "tool_use": good}))).chat_template


def test_stop_also_at_adds_ids_after_those_the_generation_config_stops_at():
    from types import SimpleNamespace

    from transformers import GenerationConfig

    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=[7, 9]))
    assert stop_also_at(model, [9, 5], eos_token_id=3) == [7, 9, 5]  # kept order, 9 not twice
    assert stop_also_at(model, [5], eos_token_id=3) == []  # nothing new: unchanged
    assert model.generation_config.eos_token_id == [7, 9, 5]
    # A generation config with no eos: the tokenizer's end-of-sequence token stays the first stop.
    model = SimpleNamespace(generation_config=GenerationConfig())
    assert stop_also_at(model, [5], eos_token_id=3) == [3, 5]
    assert stop_also_at(SimpleNamespace(), [5], eos_token_id=3) == []  # a model without one (TrainingEngine's)
