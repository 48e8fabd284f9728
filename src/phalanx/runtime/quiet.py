"""Quiet the model and data libraries: phalanx prints its own progress, and theirs would interleave with it."""

from __future__ import annotations


def quiet_libraries() -> None:
    """Turn off the progress bars and deprecation chatter of transformers and datasets (a no-op without them).

    Commands call it after installing their signal handlers: these imports take seconds, and a preemption signal
    must not be lost in them."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
