"""Memory planning (`phalanx plan`): bytes per rank for each parallel strategy, before any weight is loaded.

`model` counts parameters on the meta device; `estimate` turns counts, dtypes, micro-batch and
sequence length into parameters, gradients, optimizer state, activations and a step's peak per
strategy; `fit` what fits on one device (also asked by `phalanx train`); `command` prints the table and the
recommendation. Method and accuracy: docs/plan.md.
"""

from phalanx.plan.estimate import Activations, Row, Setup, activation_bytes, setup_from_config, strategy_rows
from phalanx.plan.model import ModelFacts, model_facts

__all__ = [
    "Activations",
    "ModelFacts",
    "Row",
    "Setup",
    "activation_bytes",
    "model_facts",
    "setup_from_config",
    "strategy_rows",
]
