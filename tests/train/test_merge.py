"""training.merge_micro_batches: a step's packed micro-batches run as fewer, larger passes, and train the same.

In one process on CPU (fp32): batch 1 x accumulation 4, merged into passes of at most 1,024 tokens, against the same
run unmerged: the same losses and the same adapter weights to float-summation order, in fewer forward passes. A merged
run killed mid-step resumes bit-identically. The multi-rank proof (2 DDP ranks, merged, against one process) is in
test_distributed_equivalence.py."""

import pytest
import torch

from helpers import R1_DISTILL_SHAPE, read_metrics, run_phalanx, tiny_run, write_chat_jsonl
from phalanx.config.flags import split_flags
from phalanx.config.loader import load_config, overrides_from_flags
from phalanx.data.collate import merge_budget


def config(*flags: str):
    return load_config(None, overrides_from_flags(split_flags(list(flags))[1]))


def train_counting_passes(tmp_path, monkeypatch, merge: str) -> tuple[list[float], dict, list[int]]:
    import phalanx.train.loop as loop
    from phalanx.runtime.dist import shutdown
    from phalanx.train.loss import token_loss_sum as original
    from phalanx.train.run import build_run

    passes = []

    def counted(model, batch, *args, **kwargs):
        passes.append(batch["input_ids"].shape[1])
        return original(model, batch, *args, **kwargs)

    monkeypatch.setattr(loop, "token_loss_sum", counted)
    out = tmp_path / merge
    cfg = config(
        *("--max_steps", "3", "--batch_size", "1", "--gradient_accumulation_steps", "4", "--max_length", "512"),
        *("--test_size", "0", "--output_dir", str(out), "--logging.tensorboard", "false"),
        *("--logging.progress_bar", "false", "--lora_dropout", "0", "--learning_rate", "1e-3"),
        *("--training.merge_micro_batches", merge),
        *(("--training.merge_tokens", "1024") if merge == "true" else ()),
    )
    run = build_run(cfg)
    try:
        losses = []
        for micro_batches in run.steps_of_epoch():
            losses.append(loop.train_step(run, micro_batches)["loss"])
            run.state.global_step += 1
            if len(losses) == 3:
                break
        weights = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
    finally:
        shutdown()
    return losses, weights, passes


def test_merged_passes_train_like_one_pass_per_micro_batch(tmp_path, monkeypatch):
    merged_losses, merged_weights, merged_passes = train_counting_passes(tmp_path, monkeypatch, "true")
    plain_losses, plain_weights, plain_passes = train_counting_passes(tmp_path, monkeypatch, "false")
    assert len(plain_passes) == 12 and len(merged_passes) < len(plain_passes)
    assert max(merged_passes) <= 1024 and sum(merged_passes) == sum(plain_passes)  # the same tokens, fewer passes
    assert merged_losses == pytest.approx(plain_losses, abs=1e-6)
    assert plain_losses[-1] != plain_losses[0]
    for name, weight in plain_weights.items():
        torch.testing.assert_close(merged_weights[name], weight, atol=1e-6, rtol=1e-5, msg=name)


def test_auto_merges_on_cuda_only_and_keeps_the_unmerged_memory_bound():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg = config("--batch_size", "1", "--gradient_accumulation_steps", "8", "--max_length", "2048")
    assert merge_budget(cfg, cuda, packing=True) == 2048  # batch_size x max_length: what one micro-batch holds
    assert merge_budget(cfg, cpu, packing=True) is None
    assert merge_budget(cfg, cuda, packing=False) is None
    assert (
        merge_budget(config("--batch_size", "4", "--max_length", "2048"), cuda, packing=True) is None
    )  # nothing to merge
    deepspeed = config("--gradient_accumulation_steps", "8", "--strategy", "deepspeed")
    assert merge_budget(deepspeed, cuda, packing=True) is None
    bigger = config("--gradient_accumulation_steps", "8", "--training.merge_tokens", "16384")
    assert merge_budget(bigger, cuda, packing=True) == 16384
    on_cpu = config("--gradient_accumulation_steps", "8", "--training.merge_micro_batches", "true")
    assert merge_budget(on_cpu, cpu, packing=True) == on_cpu.data.max_length


@pytest.mark.parametrize(
    "flags, named",
    [
        (("--training.merge_micro_batches", "true", "--packing", "false"), "needs data.packing"),
        (("--training.merge_micro_batches", "true", "--strategy", "deepspeed"), "not supported under --strategy"),
        (("--training.merge_micro_batches", "false", "--training.merge_tokens", "4096"), "drop one of them"),
        (("--training.merge_tokens", "100", "--max_length", "512"), "at least 512"),
    ],
)
def test_contradictory_merge_settings_are_refused_by_name(flags, named):
    from phalanx.errors import ConfigError

    with pytest.raises((ConfigError, ValueError)) as caught:
        config(*flags)
    assert "training.merge" in str(caught.value) and named in str(caught.value)


def test_on_a_gpu_the_train_command_sizes_merged_passes_by_the_memory_model(tmp_path, monkeypatch):
    """The seeds' setting (batch 1 x 8 micro-batches) on an 80 GB GPU: passes of a whole step's rows (16,384 tokens at
    most), which the estimate fits (measured on an H100: 23.9 GB, 7.02x the tokens/s of one pass per micro-batch,
    benchmarks/RESULTS.md 2026-11-27 08:42); on 24 GB, one micro-batch's size stays. CPU: nothing is asked."""
    import json
    from types import SimpleNamespace

    from phalanx.plan.estimate import GiB
    from phalanx.train.command import merge_tokens_for_this_device

    (tmp_path / "config.json").write_text(json.dumps(R1_DISTILL_SHAPE))
    seeds = ("--model_name", str(tmp_path), "--batch_size", "1", "--gradient_accumulation_steps", "8")
    assert merge_tokens_for_this_device(config(*seeds, "--max_length", "2048")) is None  # no CUDA here
    memory = {"total": 80 * GiB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=memory["total"]))
    assert merge_tokens_for_this_device(config(*seeds, "--max_length", "2048")) == 16384
    assert merge_tokens_for_this_device(config(*seeds, "--training.merge_tokens", "4096")) is None  # the user's size
    memory["total"] = 24 * GiB
    assert merge_tokens_for_this_device(config(*seeds, "--max_length", "2048")) is None


def test_a_fitted_pass_size_replaces_one_micro_batchs_and_the_run_says_so(tmp_path, capsys):
    from phalanx.runtime.dist import shutdown
    from phalanx.train.run import build_run

    cfg = config(
        *("--max_steps", "1", "--batch_size", "1", "--gradient_accumulation_steps", "4", "--max_length", "512"),
        *("--test_size", "0", "--output_dir", str(tmp_path / "out"), "--logging.tensorboard", "false"),
        *("--training.merge_micro_batches", "true"),
    )
    try:
        run = build_run(cfg, merge_tokens_that_fit=1536)
        assert run.merge_tokens == 1536
    finally:
        shutdown()
    assert "passes of at most 1,536 tokens (the most the memory estimate fits on this device" in capsys.readouterr().out


def test_a_merged_run_killed_mid_step_resumes_bit_identically(tmp_path):
    """Merging happens inside a step, after the loader handed over the step's micro-batches: the saved data position,
    RNG state (dropout on) and optimizer state resume a merged run exactly where it stopped."""
    data = write_chat_jsonl(tmp_path / "train.jsonl", 24)
    flags = tiny_run({"max_steps": 4, "save_steps": 2, "lora_dropout": 0.1, "batch_size": 1})
    flags += ["--dataset_path", str(data), "--gradient_accumulation_steps", "3", "--world_size", "1"]
    flags += ["--training.merge_micro_batches", "true", "--training.merge_tokens", "1536"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = run_phalanx("train", *flags, "--output_dir", str(whole))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "micro-batches run as passes of at most 1,536 tokens" in proc.stdout
    proc = run_phalanx("train", *flags, "--output_dir", str(killed), env={"PHALANX_FAULT": "kill@step=3"})
    assert proc.returncode != 0 and [r["step"] for r in read_metrics(killed)] == [1, 2], proc.stderr[-3000:]
    proc = run_phalanx("train", *flags, "--output_dir", str(killed))  # the same command again
    assert proc.returncode == 0 and "checkpoint-2 at step 2" in proc.stdout, proc.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(killed)] == [r["loss"] for r in read_metrics(whole)]
