"""models.load: what a model_name that cannot be loaded is told."""

import pytest

from phalanx.errors import ConfigError
from phalanx.models.load import resolve_model_path


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
