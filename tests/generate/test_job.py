"""What a job checks of an --adapter folder before any rank starts."""

import json

import pytest

from phalanx.errors import ConfigError
from phalanx.generate.job import adapter_base


def test_an_adapter_folder_needs_its_config_its_base_and_its_weights(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    with pytest.raises(ConfigError, match="no adapter_config.json there; give the output_dir"):
        adapter_base(str(folder))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(ConfigError, match="no base_model_name_or_path; pass --model_name"):
        adapter_base(str(folder))
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))
    # Without weights PEFT took the folder for a Hub id and tried to download them (a network traceback offline).
    with pytest.raises(ConfigError, match=r"no weights \(adapter_model.safetensors or adapter_model.bin\) there"):
        adapter_base(str(folder))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    assert adapter_base(str(folder)) == "org/base"


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
