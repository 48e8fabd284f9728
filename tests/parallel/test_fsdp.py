"""FSDP2 proven equal to one process: 2 gloo ranks vs one process with the double batch, fp32 on CPU.

Tolerance 1e-5 on every step's loss (the same bar DDP meets): sharding changes only the order
in which gradient partial sums are added (reduce-scatter of per-rank sums, then the optimizer
on shards), so the two runs differ by fp32 rounding, measured at about 1e-6 over 5 steps.
Saved weights are compared to the single process's at 1e-4 (Adam's update divides by
sqrt(v), which amplifies those rounding differences in the weights themselves).
"""

import json

import pytest

from equivalence import assert_adapter_loads_with_peft, assert_saved_weights_match, grad_norms, train

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_fsdp_matches_one_process(equivalence_data, tmp_path, single, finetune, sharding):
    ref_dir, ref = single(finetune)
    out = tmp_path / "fsdp"
    # One LoRA case accumulates over two micro-batches per rank (no gradient sync on the first); the other
    # recomputes activations in backward (non-reentrant checkpointing inside each sharded layer).
    extra = {
        ("lora", "SHARD_GRAD_OP"): ("1", "--gradient_accumulation_steps", "2"),
        ("lora", "FULL_SHARD"): ("2", "--gradient_checkpointing", "true"),
    }.get((finetune, sharding), ("2",))
    losses = train(
        equivalence_data,
        out,
        2,
        int(extra[0]),
        finetune,
        *extra[1:],
        "--strategy",
        "fsdp",
        "--sharding_strategy",
        sharding,
    )
    assert len(losses) == len(ref) == 5
    assert losses == pytest.approx(ref, abs=1e-5)
    assert ref[-1] < ref[0], "the loss moves: the comparison is not between two untrained models"
    # Some norms exceed max_grad_norm 1.0 (LoRA step 3: about 10): the later losses matching shows clipping used the global norm.
    assert grad_norms(out) == pytest.approx(grad_norms(ref_dir), rel=1e-4)
    info = json.loads((out / "final_training_info.json").read_text())
    assert info["strategy"] == "fsdp"
    # The saved model or adapter is complete (not an empty or sharded file) and equals the trained weights.
    assert_saved_weights_match(ref_dir, out, finetune)
    if finetune == "lora":
        assert_adapter_loads_with_peft(out)


def test_fsdp_keeps_a_frozen_bf16_lora_base_in_bf16():
    """Under bf16 mixed precision (asked for directly: on CPU a run gets fp32) the frozen base stays bf16 once sharded,
    with no fp32 copy of weights that never step; only the LoRA weights are fp32 masters. Three steps run, and the
    losses equal DDP's bf16 autocast path to one bf16 rounding (measured: equal to the last digit on CPU)."""
    from dist_workers import run_ranks
    from parallel import fsdp_ranks
    from phalanx.config.schema import EMBEDDED_MODEL
    from phalanx.models.load import resolve_model_path

    resolve_model_path(EMBEDDED_MODEL)  # built once here, not by two ranks at once
    fsdp = run_ranks(fsdp_ranks.lora_bf16_steps, 2, "fsdp")
    ddp = run_ranks(fsdp_ranks.lora_bf16_steps, 2, "ddp")
    for rank in fsdp:
        assert rank["frozen"] == ["torch.bfloat16"] and rank["trainable"] == ["torch.float32"], rank
    # Each rank holds half the frozen base, in 2 bytes a weight (DDP: all of it, also bf16).
    assert fsdp[0]["frozen_local_bytes"] + fsdp[1]["frozen_local_bytes"] == pytest.approx(
        ddp[0]["frozen_local_bytes"], rel=0.01
    )
    assert fsdp[0]["losses"] == fsdp[1]["losses"]
    assert fsdp[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=4e-3)
    assert fsdp[0]["losses"][-1] < fsdp[0]["losses"][0], "the adapter trains"
