"""Activation checkpointing (non-reentrant) under every strategy: recomputing activations changes no loss."""

import pytest

from parallel.common import train

pytestmark = pytest.mark.distributed

STRATEGIES = {"ddp": ["--strategy", "ddp"], "fsdp": ["--strategy", "fsdp"],
              "zero3": ["--strategy", "deepspeed", "--zero_stage", "3"]}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_checkpointed_lora_matches_one_process(dataset, single, tmp_path, name):
    _, ref = single("lora")
    # Two micro-batches per rank under DDP: a LoRA weight's gradient hook fires once per backward, recompute or not.
    shape = ["--batch_size", "1", "--gradient_accumulation_steps", "2"] if name == "ddp" else ["--batch_size", "2"]
    losses = train(dataset, tmp_path / name, 2, int(shape[1]), "lora", *shape[2:], "--gradient_checkpointing", "true",
                   *STRATEGIES[name])
    assert losses == pytest.approx(ref, abs=1e-5)
