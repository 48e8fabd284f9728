"""Optional packages a config needs, checked without importing them (cheap enough for the launcher parent)."""

from __future__ import annotations

import importlib.util
import sys

from phalanx.errors import ConfigError

# Set by the `phalanx` program (cli.main) in its own process: what one command decides for the process (which
# libraries it loads) then holds for that process alone, never for a caller that imports phalanx as a library.
_COMMAND_OWNS_PROCESS = False


def command_owns_process() -> None:
    global _COMMAND_OWNS_PROCESS
    _COMMAND_OWNS_PROCESS = True


def require_4bit_packages() -> None:
    """transformers quantizes with bitsandbytes and loads quantized models through accelerate."""
    missing = [name for name in ("bitsandbytes", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"model.load_in_4bit needs {' and '.join(missing)}, not installed here: "
            f"pip install 'phalanx[qlora]' (or pip install {' '.join(missing)})"
        )


def leave_out_bitsandbytes() -> None:
    """In a `phalanx` process that quantizes nothing: make bitsandbytes look absent, as where it is not installed.

    peft (and transformers) import it whenever it is installed, and it compiles kernels with torch.compile as it
    imports: about a second per process, every rank of every run, for QLoRA's library."""
    _leave_out("bitsandbytes")


def leave_out_deepspeed() -> None:
    """In a `phalanx` process of another strategy than DeepSpeed: make deepspeed look absent, as where it is not
    installed. accelerate imports it whenever it is installed (transformers' generation utilities import accelerate),
    which takes 0.2-0.4 s per process here and prints DeepSpeed's accelerator warning into a DDP or FSDP run."""
    _leave_out("deepspeed")


def _leave_out(package: str) -> None:
    """Its entry in sys.modules set to None makes `importlib.util.find_spec` answer None, which is how peft,
    transformers and accelerate ask whether a package is there. Called before any of them is imported, so that every
    one asks after it; only where the command owns the process (the CLI), since a caller's later use of the package in
    the same process would find it gone."""
    if _COMMAND_OWNS_PROCESS and not {package, "peft", "transformers", "accelerate"} & set(sys.modules):
        sys.modules[package] = None
