"""phalanx: distributed training and fine-tuning for PyTorch models and LLMs."""

__version__ = "0.1.0"
