"""Rule 3 of the house: N ranks with batch b train exactly like one process with batch N*b.

Real ranks over gloo, started by `phalanx train --world_size 2` (torch's elastic launcher),
against one plain process (the session's `single` reference); fp32 on CPU, losses compared step
by step to 1e-5 (the runs differ only in the order fp32 partial sums are added: about 1e-6).
The ranks pack their micro-batches (the default), the reference pads: packed equals padded too.
"""

import pytest

from equivalence import assert_saved_weights_match, train

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_two_ranks_match_one_process_with_double_batch(equivalence_data, tmp_path, finetune, single):
    single_dir, reference = single(finetune)
    ddp = train(equivalence_data, tmp_path, 2, 2, finetune)
    assert len(reference) == len(ddp) == 5
    assert ddp == pytest.approx(reference, abs=1e-5)
    assert reference[-1] < reference[0], "the loss moves: the comparison is not between two untrained models"
    assert_saved_weights_match(single_dir, tmp_path, finetune)


def test_accumulation_and_activation_checkpointing_change_no_loss(equivalence_data, tmp_path, single):
    """2 ranks x batch 1 x 2 micro-batches, recomputing activations (non-reentrant) in backward: the same global
    batch, so the same losses. Under DDP a LoRA weight's gradient hook then fires once per backward; the reentrant
    kind of checkpointing would fail here with "mark a variable ready only once"."""
    _, reference = single("lora")
    losses = train(
        equivalence_data,
        tmp_path,
        2,
        1,
        "lora",
        "--gradient_accumulation_steps",
        "2",
        "--gradient_checkpointing",
        "true",
    )
    assert losses == pytest.approx(reference, abs=1e-5)


def test_fp16_gradient_compression_stays_close(equivalence_data, tmp_path, single):
    """seed 000's comm hook: gradients travel as fp16, so the match is close rather than exact. Padded micro-batches
    here (--packing false): the multi-rank padded path keeps a run of its own."""
    _, reference = single("lora")
    losses = train(equivalence_data, tmp_path, 2, 2, "lora", "--ddp_comm_hook", "fp16", "--packing", "false")
    assert losses == pytest.approx(reference, abs=1e-2)
