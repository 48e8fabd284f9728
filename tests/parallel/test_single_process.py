"""FSDP2 and DeepSpeed on one process (a one-rank group): what a single-GPU user runs for CPU offload.

The reference is the plain one-process run of the same batch; offloading moves where state lives and
must not change the arithmetic, so losses agree to fp32 summation-order noise and the saved weights are whole.
"""

import pytest

from equivalence import assert_saved_weights_match, train


@pytest.mark.distributed
@pytest.mark.parametrize(
    "flags",
    [
        ("--strategy", "fsdp", "--offload_param", "true"),
        ("--strategy", "deepspeed", "--zero_stage", "3", "--offload_param", "true", "--offload_optimizer", "true"),
    ],
    ids=["fsdp-offload", "zero3-offload"],
)
def test_one_process_sharded_strategy_matches_plain_training(flags, equivalence_data, single, tmp_path):
    ref_dir, ref_losses = single("lora")
    losses = train(equivalence_data, tmp_path, 1, 4, "lora", *flags)
    info = (tmp_path / "final_training_info.json").read_text()
    assert f'"{flags[1]}"' in info, "the run must report the strategy it used"
    assert len(losses) == len(ref_losses) == 5
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    assert_saved_weights_match(ref_dir, tmp_path, "lora")
