"""phalanx: distributed training and fine-tuning for PyTorch models and LLMs."""

__version__ = "0.1.0"

# The seed-004 API, imported on first use so `import phalanx` stays light.
_LAZY = {
    "TrainingEngine": "phalanx.engine.engine",
    "launch_distributed_training": "phalanx.engine.launch",
    "distributed_train_worker": "phalanx.engine.launch",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
