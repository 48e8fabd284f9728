"""DeepSpeed ZeRO-1/2/3 through the real engine, proven equal to one process (2 gloo ranks, fp32 on CPU).

Tolerance 1e-5 on each step's loss, as for DDP and FSDP: ZeRO changes only how gradient sums
are bucketed and reduced and which rank updates which slice, so the runs differ by fp32
rounding (measured about 1e-6). Saved weights: 1e-4 (Adam's 1/sqrt(v) amplifies rounding).
"""

import json
from pathlib import Path

import pytest

from equivalence import COMMON, assert_adapter_loads_with_peft, assert_saved_weights_match, grad_norms, train
from helpers import read_metrics, run_phalanx, stopped_after, write_chat_jsonl, write_payload
from phalanx.checkpoint.safe_load import check_deepspeed_checkpoint

pytestmark = pytest.mark.distributed
import deepspeed  # noqa: E402, F401  (installed by the Makefile; a missing engine is a failure, not a skip)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_zero_matches_one_process(equivalence_data, tmp_path, single, finetune, stage):
    ref_dir, ref = single(finetune)
    out = tmp_path / f"zero{stage}"
    # LoRA under ZeRO-2 accumulates (two micro-batches per rank, the engine's boundary on the second); LoRA under
    # ZeRO-3 recomputes activations in backward, where the engine gathers each layer's partitions a second time.
    extra = {2: ("1", "--gradient_accumulation_steps", "2"), 3: ("2", "--gradient_checkpointing", "true")}
    shape = extra.get(stage, ("2",)) if finetune == "lora" else ("2",)
    losses = train(
        equivalence_data,
        out,
        2,
        int(shape[0]),
        finetune,
        *shape[1:],
        "--strategy",
        "deepspeed",
        "--zero_stage",
        str(stage),
    )
    assert losses == pytest.approx(ref, abs=1e-5)
    assert ref[-1] < ref[0]
    # Some norms exceed max_grad_norm 1.0 (LoRA step 3: about 10): the later losses matching shows clipping used the global norm.
    assert grad_norms(out) == pytest.approx(grad_norms(ref_dir), rel=1e-4)
    assert json.loads((out / "final_training_info.json").read_text())["strategy"] == "deepspeed"
    # Under ZeRO-3 every rank holds a slice of each weight: the saved file must still be whole and trained.
    assert_saved_weights_match(ref_dir, out, finetune)
    if finetune == "lora" and stage == 3:
        assert_adapter_loads_with_peft(out)


def test_user_json_auto_values_filled_and_resume_from_engine_checkpoint(tmp_path):
    """A seed-003-shaped JSON with "auto" runs; state is DeepSpeed's own per-rank checkpoint; a run stopped after
    checkpoint-4 (a copy of the uninterrupted run's folder cut back to it: helpers.stopped_after) resumes exactly."""
    data = write_chat_jsonl(tmp_path / "train.jsonl", 30)
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 3},
            }
        )
    )
    base = [
        "train",
        "--dataset_path",
        str(data),
        "--world_size",
        "2",
        "--batch_size",
        "2",
        *COMMON,
        "--max_steps",
        "6",
        "--save_steps",
        "2",
        "--eval_steps",
        "3",
        "--test_size",
        "0.2",
        "--strategy",
        "deepspeed",
        "--deepspeed_config",
        str(ds_json),
    ]
    whole = tmp_path / "whole"
    proc = run_phalanx(*base, "--output_dir", str(whole))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The engine started without building DeepSpeed's shared-memory all-reduce op (C++, a minute on first use), and
    # DeepSpeed was told its accelerator (CPU ranks) instead of warning on every rank that it found no GPU.
    said = proc.stdout + proc.stderr
    assert "shm_comm" not in said and "Setting accelerator to CPU" not in said, said[-3000:]
    assert (whole / "checkpoint-4" / "deepspeed" / "state").is_dir()
    assert not (whole / "checkpoint-4" / "optimizer.pt").exists()
    stopped = stopped_after(whole, 4, tmp_path / "stopped")  # as a run killed in step 5 leaves its folder
    # On another number of ranks DeepSpeed cannot re-partition its optimizer state: refused by name with bad input's
    # status (its own traceback exited 1, a crash a requeue repeats), the checkpoint left as it was for the resume.
    proc = run_phalanx(*base, "--output_dir", str(stopped), "--world_size", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        f"{stopped / 'checkpoint-4'} holds DeepSpeed ZeRO state partitioned over 2 ranks, and this run has 1: "
        "DeepSpeed cannot re-partition it. Resume it on 2 ranks (--world_size 2)"
    ) in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # Nor can it load ZeRO-3's files into stage 1 or 2 (its loader stopped on a bare AssertionError).
    stage_2 = tmp_path / "ds_stage_2.json"
    stage_2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    proc = run_phalanx(
        *base, "--output_dir", str(stopped), "--world_size", "1", "--deepspeed_config", str(stage_2), "--force"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        f"{stopped / 'checkpoint-4'} holds a DeepSpeed checkpoint of ZeRO stage 3, and this run uses ZeRO stage 1 "
        "or 2 (zero_stage 2): DeepSpeed loads its state only into the stages that wrote it."
    ) in proc.stderr, proc.stderr[-3000:]
    proc = run_phalanx(*base, "--output_dir", str(stopped))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint-4 at step 4" in proc.stdout
    assert [r["loss"] for r in read_metrics(stopped)] == pytest.approx(
        [r["loss"] for r in read_metrics(whole)], abs=1e-6
    )

    # What DeepSpeed wrote passes the restricted unpickler's allowlist; a state file replaced by a pickle that runs
    # code is refused when the engine loads it (phalanx.checkpoint.safe_load), the file named, before anything runs.
    check_deepspeed_checkpoint(whole / "checkpoint-4" / "deepspeed")
    tampered = stopped_after(whole, 4, tmp_path / "tampered")
    target = sorted((tampered / "checkpoint-4" / "deepspeed" / "state").glob("*optim_states.pt"))[0]
    marker = tmp_path / "payload-ran"
    write_payload(target, marker)
    proc = run_phalanx(*base, "--output_dir", str(tampered))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"{target} holds" in proc.stderr and "never runs code from a checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists(), "the pickle's payload ran"
    # Rank 1 read its own untouched file, then its collective broke as rank 0 left: it stands aside, naming rank 0.
    assert "rank 1 stopped: rank 0 (UnsafeCheckpointError" in proc.stderr, proc.stderr[-3000:]


def test_json_that_contradicts_the_run_is_refused(tmp_path):
    data = write_chat_jsonl(tmp_path / "train.jsonl", 8)
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(json.dumps({"gradient_accumulation_steps": 16, "zero_optimization": {"stage": 3}}))
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(data),
        "--output_dir",
        str(tmp_path / "out"),
        "--world_size",
        "2",
        "--strategy",
        "deepspeed",
        "--deepspeed_config",
        str(ds_json),
        "--zero_stage",
        "2",
        *COMMON,
    )
    assert proc.returncode == 2
    assert "gradient_accumulation_steps is 16 in the JSON" in proc.stderr
    assert "zero_optimization.stage is 3 in the JSON but 2" in proc.stderr
    assert "World Size" not in proc.stdout and not (tmp_path / "out").exists(), "refused before any rank started"


@pytest.mark.parametrize(
    "user, said",
    [
        ({"zero_optimization": {"stage": "two"}}, 'zero_optimization.stage = "two"; accepted: 0, 1, 2 or 3, or "auto"'),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage = 4; accepted: 0, 1, 2 or 3"),
        ({"gradient_clipping": "high"}, 'gradient_clipping = "high"; accepted: a number, 0 or more'),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu = 0; accepted: a positive integer"),
        ({"bf16": {"enabled": "yes"}}, 'bf16.enabled = "yes"; accepted: true or false'),
        ({"bf16": True}, 'bf16 = true; accepted: an object such as {"enabled": "auto"}'),
    ],
)
def test_json_values_of_the_wrong_type_are_refused_by_file_and_key(tmp_path, user, said):
    """Values DeepSpeed would take into every rank and fail on there, without a word of the file (at start-up:
    "invalid literal for int()"; at the first step: "'>' not supported between 'str' and 'float'")."""
    from phalanx.config.loader import load_config
    from phalanx.errors import ConfigError
    from phalanx.parallel.base import Precision
    from phalanx.parallel.deepspeed import build_ds_config

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(user))
    cfg = load_config(None, {"distributed.strategy": "deepspeed", "distributed.deepspeed_config": str(path)})
    with pytest.raises(ConfigError) as refused:
        build_ds_config(cfg, 2, Precision(None))
    assert str(refused.value).startswith(f"{path}: {said}")
    path.write_text(json.dumps({"gradient_clipping": "auto", "zero_optimization": {"stage": "auto"}}))
    assert build_ds_config(cfg, 2, Precision(None))["zero_optimization"]["stage"] == 2, '"auto" takes the run\'s'


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("evalnan") / "train.jsonl", 35)


EVAL_NAN = ["--test_size", "0.2", "--eval.eval_batch_size", "3", "--eval_steps", "2"]


@pytest.fixture(scope="module")
def single_eval_nan(eval_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single-evalnan")
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(eval_data),
        "--output_dir",
        str(out),
        "--batch_size",
        "4",
        *COMMON,
        *EVAL_NAN,
        "--packing",
        "false",
        env={"PHALANX_FAULT": "nan@step=3"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize(
    "strategy",
    [
        ["--strategy", "deepspeed", "--zero_stage", "2"],
        ["--strategy", "deepspeed", "--zero_stage", "3"],
        ["--strategy", "fsdp"],
    ],
    ids=["zero2", "zero3", "fsdp"],
)
def test_skipped_nan_step_and_uneven_eval_match_one_process(eval_data, single_eval_nan, tmp_path, strategy):
    """A NaN step on one rank is discarded on all without leaving gradients behind; 7 eval rows give the two
    ranks different numbers of eval batches (2 and 1), which a sharded forward must not hang on. The reference
    pads (--packing false), the ranks pack: train and eval losses agree to 1e-5 packed and padded."""
    out = tmp_path / "run"
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(eval_data),
        "--output_dir",
        str(out),
        "--world_size",
        "2",
        "--batch_size",
        "2",
        *COMMON,
        *EVAL_NAN,
        *strategy,
        env={"PHALANX_FAULT": "nan@step=3,rank=0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "update skipped" in proc.stdout
    ref = [r["loss"] for r in read_metrics(single_eval_nan)]
    assert [r["loss"] for r in read_metrics(out)] == pytest.approx(ref, abs=1e-5)
    ref_eval = [r["loss"] for r in read_metrics(single_eval_nan, "eval")]
    assert len(ref_eval) == 3
    assert [r["loss"] for r in read_metrics(out, "eval")] == pytest.approx(ref_eval, abs=1e-5)


def test_the_engine_starts_without_the_shared_memory_all_reduce_op():
    """Only inference's tensor-parallel all-reduce uses it; building it compiles C++ on a CPU rank's first start."""
    import importlib

    import deepspeed.ops

    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # its package's `torch` attribute is torch itself

    from phalanx.parallel.deepspeed import SHM_ALL_REDUCE_OP, without_inference_all_reduce_op

    before = deepspeed.ops.__compatible_ops__.get(SHM_ALL_REDUCE_OP)
    with without_inference_all_reduce_op():
        assert ds_torch_comm.build_shm_op() is None  # what the backend calls as it starts: nothing built
    assert deepspeed.ops.__compatible_ops__.get(SHM_ALL_REDUCE_OP) == before  # a later caller sees DeepSpeed's own
