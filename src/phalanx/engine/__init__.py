"""TrainingEngine for arbitrary PyTorch models (seed 004): DDP, synchronised BatchNorm, AMP, EMA, launch helpers.

`from phalanx import TrainingEngine, launch_distributed_training, distributed_train_worker`;
see docs/engine.md.
"""
