"""Rule 3 of the house: N ranks with batch b train exactly like one process with batch N*b.

Real ranks over gloo, started by `phalanx train --world_size 2` (torch's elastic launcher),
against one plain process (the session's `single` reference); fp32 on CPU, losses compared step
by step to 1e-5 (the runs differ only in the order fp32 partial sums are added: about 1e-6).
The ranks pack their micro-batches (the default), the reference pads: packed equals padded too.
"""

import pytest

from equivalence import assert_saved_weights_match, train
from helpers import read_metrics, write_chat_jsonl

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_two_ranks_match_one_process_with_double_batch(equivalence_data, tmp_path, finetune, single):
    single_dir, reference = single(finetune)
    ddp = train(equivalence_data, tmp_path, 2, 2, finetune)
    assert len(reference) == len(ddp) == 5
    assert ddp == pytest.approx(reference, abs=1e-5)
    assert reference[-1] < reference[0], "the loss moves: the comparison is not between two untrained models"
    assert_saved_weights_match(single_dir, tmp_path, finetune)
    # --logging.loss_curve false (the tests' tiny runs): the run finished without drawing its plot.
    assert (tmp_path / "final_training_info.json").is_file() and not (tmp_path / "loss_curve.png").exists()


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


def test_merged_micro_batches_match_one_process(equivalence_data, tmp_path, single):
    """2 ranks x batch 1 x 2 micro-batches, each rank's two run as one pass (training.merge_micro_batches, what
    'auto' does on CUDA): one backward per step, so DDP reduces once, and the same losses and weights."""
    single_dir, reference = single("lora")
    merged = ("--training.merge_micro_batches", "true", "--training.merge_tokens", "1536")  # 2 x max_length: one pass
    losses = train(equivalence_data, tmp_path, 2, 1, "lora", "--gradient_accumulation_steps", "2", *merged)
    assert losses == pytest.approx(reference, abs=1e-5)
    assert_saved_weights_match(single_dir, tmp_path, "lora")


def test_fp16_gradient_compression_stays_close(equivalence_data, tmp_path, single):
    """seed 000's comm hook: gradients travel as fp16, so the match is close rather than exact. Padded micro-batches
    here (--packing false): the multi-rank padded path keeps a run of its own."""
    _, reference = single("lora")
    losses = train(equivalence_data, tmp_path, 2, 2, "lora", "--ddp_comm_hook", "fp16", "--packing", "false")
    assert losses == pytest.approx(reference, abs=1e-2)


def test_rows_the_ranks_do_not_divide_are_each_trained_once(tmp_path):
    """7 rows, one epoch, 2 ranks x batch 2: the 8th position only evens out the ranks. It is computed (both ranks run
    the same steps) but trains nothing, so the two steps equal one process's with batch 4 (4 rows, then 3) and the
    step's target tokens are the 3 rows' only; a row trained twice would change the second step's loss."""
    data = write_chat_jsonl(tmp_path / "train.jsonl", 7)
    epoch = ("--max_steps", "2")  # one epoch of either
    reference = train(data, tmp_path / "one", 1, 4, "lora", "--packing", "false", *epoch)
    ranks = train(data, tmp_path / "two", 2, 2, "lora", *epoch)
    assert len(reference) == len(ranks) == 2
    assert ranks == pytest.approx(reference, abs=1e-5)
    tokens = [[r["tokens_seen"] for r in read_metrics(tmp_path / out)] for out in ("one", "two")]
    assert tokens[0] == tokens[1], tokens  # with the 8th position trained, the ranks' second step had one row more
