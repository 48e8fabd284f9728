"""models.load: what a model_name that cannot be loaded is told; an adapter folder's base; the stops a saved model lists."""

import json
from pathlib import Path

import pytest

from phalanx.errors import ConfigError
from phalanx.models.load import adapter_base, resolve_model_path, stop_also_at


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
    assert stop_also_at(model, [9, 5, 5], eos_token_id=3) == [5]  # what it added: 9 is there, 5 once
    assert model.generation_config.eos_token_id == [7, 9, 5]  # kept order
    assert stop_also_at(model, [5], eos_token_id=3) == []  # nothing new: unchanged
    assert model.generation_config.eos_token_id == [7, 9, 5]
    # A generation config with no eos: the tokenizer's end-of-sequence token stays the first stop.
    model = SimpleNamespace(generation_config=GenerationConfig())
    assert stop_also_at(model, [5], eos_token_id=3) == [5] and model.generation_config.eos_token_id == [3, 5]
    assert stop_also_at(SimpleNamespace(), [5], eos_token_id=3) == []  # a model without one (TrainingEngine's)


def test_an_adapter_folder_needs_its_config_its_weights_and_a_base(tmp_path):
    """What `generate --adapter` and `export` check of an adapter folder before loading anything."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    with pytest.raises(ConfigError, match="--adapter .*: no adapter_config.json there; give the output_dir"):
        adapter_base(str(folder))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    # Without weights PEFT took the folder for a Hub id and tried to download them (a network traceback offline).
    with pytest.raises(ConfigError, match=r"no weights \(adapter_model.safetensors or adapter_model.bin\) there"):
        adapter_base(str(folder), model_name="org/given")  # a base given does not make the folder an adapter
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="no base_model_name_or_path; pass --model_name"):
        adapter_base(str(folder))
    assert adapter_base(str(folder), model_name="org/given") == "org/given"
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))
    assert adapter_base(str(folder)) == "org/base"
    with pytest.raises(ConfigError, match="^phalanx export .*: no adapter_config.json"):
        adapter_base(str(tmp_path), "phalanx export")  # errors name the folder as the command was given it


def test_an_adapter_of_an_embedded_model_finds_its_base_without_the_cached_folder(tmp_path):
    """adapter_config.json records the cache folder the embedded model was built in (PHALANX_CACHE/models/NAME-HASH):
    on another machine, or after the cache was cleared, generate --adapter said "no such folder". The same preset and
    hash rebuild the same model; any other missing folder is left for the model loader to name."""
    from phalanx.models.presets import preset_hash

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"")
    gone = tmp_path / "cleared-cache" / "models" / f"tiny-qwen3-{preset_hash('tiny-qwen3')}"
    for base, found in (
        (gone, "embedded:tiny-qwen3"),
        (gone.with_name("tiny-qwen3-0000000000"), str(gone.with_name("tiny-qwen3-0000000000"))),  # another build
        (tmp_path / "my-model", str(tmp_path / "my-model")),
    ):
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
        assert adapter_base(str(folder)) == found
    # Where the folder is here, the name too: generate's record said the cache path, not the model the run was given.
    gone.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(gone)}))
    assert adapter_base(str(folder)) == "embedded:tiny-qwen3"
