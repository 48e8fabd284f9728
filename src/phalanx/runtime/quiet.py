"""Quiet the model and data libraries: phalanx prints its own progress, and theirs would interleave with it."""

from __future__ import annotations


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
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
