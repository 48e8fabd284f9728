"""Find and load a causal LM and its tokenizer: a local folder, a Hub id, or an embedded preset.

Every model, the embedded default included, goes through `from_pretrained`, so what the
tests exercise is the path users' own models take.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from phalanx.errors import ConfigError

EMBEDDED_PREFIX = "embedded:"
# What the Hub accepts as a repository id: "name" or "org/name", nothing path-like.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def cache_root() -> Path:
    """Where phalanx keeps what it builds once per machine (embedded models, tokenized data)."""
    return Path(os.environ.get("PHALANX_CACHE", Path.home() / ".cache" / "phalanx"))


def resolve_model_path(model_name: str) -> str:
    """Turn `model_name` into something from_pretrained accepts, or explain why it cannot be found."""
    if model_name.startswith(EMBEDDED_PREFIX):
        from phalanx.models.presets import materialize_embedded_model

        return str(materialize_embedded_model(model_name[len(EMBEDDED_PREFIX) :], cache_root() / "models"))
    path = Path(model_name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.model_name = {model_name!r} is a folder without config.json; expected a folder written by "
                "save_pretrained (config.json + *.safetensors + tokenizer files) or a Hub id like 'org/name'."
            )
        return str(path)
    if not HUB_ID.fullmatch(model_name):
        raise ConfigError(
            f"model.model_name = {model_name!r}: no such folder. Give an existing folder written by save_pretrained, "
            f"a Hub id like 'Qwen/Qwen2.5-0.5B-Instruct', or '{EMBEDDED_PREFIX}tiny-qwen3'."
        )
    return model_name


def load_tokenizer(model_name: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    path = resolve_model_path(model_name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.model_name = {model_name!r}: could not load its tokenizer: {exc}") from None
    if tokenizer.pad_token_id is None:
        # Padding positions never reach the loss (labels -100, attention mask 0), so eos is a safe pad.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_name: str, dtype: torch.dtype, trust_remote_code: bool = False) -> PreTrainedModel:
    path = resolve_model_path(model_name)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.model_name = {model_name!r}: could not load the model: {exc}") from None
