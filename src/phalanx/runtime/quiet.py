"""Quiet the model and data libraries: phalanx prints its own progress, and theirs would interleave with it."""

from __future__ import annotations

import os
import sys


def quiet_import_notes() -> None:
    """Before anything imports peft: on CPUs with AVX512-bf16, importing bitsandbytes (peft does) warns that an
    optional kernel package is missing, though its 4-bit CPU path works without it; a line on every command that
    asks nothing of the user. Costs no import, so the CLI calls it first."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def quiet_libraries() -> None:
    """Turn off the progress bars and deprecation chatter of transformers and datasets (a no-op without them).

    Commands call it after installing their signal handlers: these imports take seconds, and a preemption signal
    must not be lost in them."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    quiet_import_notes()
    # datasets reads this as it imports (only a Hub name or a save_to_disk source needs it: a rank reading the
    # tokenized cache never does), and the ranks a command starts inherit it.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
