"""Activation checkpointing and dropout are live while training.

That recomputing activations changes no loss is proven under each strategy by the equivalence tests, where one
LoRA case per strategy trains with --gradient_checkpointing (DDP with accumulation, FSDP2 FULL_SHARD, ZeRO-3).
"""

import pytest

from equivalence import train

pytestmark = pytest.mark.distributed


def test_checkpointing_is_on_during_training(tmp_path):
    """Training runs in train mode (from_pretrained returns eval mode, where transformers skips checkpointing):
    checkpointing then really lowers the peak of live tensors."""
    from plan.workers import measure

    base = {
        "model.finetune": "full",
        "data.max_length": 512,
        "training.batch_size": 4,
        "training.max_steps": 2,
        "data.test_size": 0.0,
        "eval.eval_steps": 100,
        "checkpoint.save_steps": 100,
        "logging.tensorboard": False,
        "logging.progress_bar": False,
        "checkpoint.save_best": False,
    }
    runs = [
        {**base, "output_dir": str(tmp_path / name), "model.gradient_checkpointing": on}
        for name, on in (("plain", False), ("checkpointed", True))
    ]
    plain, checkpointed = (r[0]["peak"] for r in measure(runs))
    assert checkpointed < 0.7 * plain, (checkpointed, plain)


def test_lora_dropout_is_applied_during_training(equivalence_data, single, tmp_path):
    """Step 1 is the same with or without dropout (LoRA B starts at zero); later steps differ only if dropout is live."""
    _, ref = single("lora")  # dropout 0
    losses = train(equivalence_data, tmp_path, 1, 4, "lora", "--lora_dropout", "0.3")
    assert losses[0] == pytest.approx(ref[0], abs=1e-6)
    assert all(abs(a - b) > 1e-6 for a, b in zip(losses[1:], ref[1:])), (losses, ref)
