"""Optional packages a config needs, checked without importing them (cheap enough for the launcher parent)."""

from __future__ import annotations

import importlib.util

from phalanx.errors import ConfigError


def require_4bit_packages() -> None:
    """transformers quantizes with bitsandbytes and loads quantized models through accelerate."""
    missing = [name for name in ("bitsandbytes", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"model.load_in_4bit needs {' and '.join(missing)}, not installed here: "
            f"pip install 'phalanx[qlora]' (or pip install {' '.join(missing)})"
        )
