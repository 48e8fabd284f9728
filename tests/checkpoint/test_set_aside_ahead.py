"""What output_dir holds from after the checkpoint a run resumes from is a future the resumed run has not lived
(checkpoint.resume.set_aside_ahead): set aside into one crashed-<time> folder, never kept in the run's way nor deleted.
checkpoint-best saved before a crash that came before the next checkpoint-N: the resumed run's checkpoint-best is the
one its own records name. checkpoint-N and a final model left by a run resumed from an older checkpoint on purpose:
a requeue's --resume_from_checkpoint latest continues the resumed run, not the one it went back from."""

import json
from pathlib import Path

import pytest

from helpers import read_metrics, tiny_run, write_chat_jsonl
from phalanx.checkpoint.layout import MARKER
from phalanx.config.flags import split_flags
from phalanx.config.loader import load_config, overrides_from_flags
from phalanx.runtime.signals import PreemptionFlag
from phalanx.train.command import train_worker


def marked_step(folder: Path) -> int:
    return json.loads((folder / MARKER).read_text())["global_step"]


def test_a_best_ahead_of_the_resumed_checkpoint_is_set_aside(tmp_path, monkeypatch, capsys):
    data = write_chat_jsonl(tmp_path / "train.jsonl", 24)
    out = tmp_path / "o"
    flags = tiny_run({"max_steps": 4, "save_steps": 2, "eval_steps": 1, "test_size": 0.25, "learning_rate": 2e-3})
    flags += ["--dataset_path", str(data), "--output_dir", str(out), "--batch_size", "2"]
    cfg = load_config(None, overrides_from_flags(split_flags(flags)[1]))

    monkeypatch.setenv("PHALANX_FAULT", "raise@step=4")  # after step 3's evaluation, before checkpoint-4
    with pytest.raises(RuntimeError, match="injected fault"):
        train_worker(cfg, PreemptionFlag())
    evals = {r["step"]: r["loss"] for r in read_metrics(out, "eval")}
    assert marked_step(out / "checkpoint-best") == 3 and evals[3] < evals[2], evals  # the test's premise
    monkeypatch.delenv("PHALANX_FAULT")
    capsys.readouterr()

    assert train_worker(cfg, PreemptionFlag()) == 0
    said = capsys.readouterr().out
    [aside] = out.glob("crashed-*/checkpoint-best")
    assert (
        f"checkpoint-best came from step 3, after step 2 where this run resumes: moved to {aside}; the best is "
        f"tracked again from step 2's record (best eval loss {evals[2]:.4f} at step 2)"
    ) in said
    assert marked_step(aside) == 3
    info = json.loads((out / "final_training_info.json").read_text())
    assert marked_step(out / "checkpoint-best") == info["best_step"] >= 3


def test_going_back_to_an_older_checkpoint_sets_the_later_ones_and_the_final_model_aside(tmp_path, monkeypatch, capsys):
    data = write_chat_jsonl(tmp_path / "train.jsonl", 16)
    out = tmp_path / "o"
    flags = tiny_run({"max_steps": 4, "save_steps": 1, "test_size": 0})
    flags += ["--dataset_path", str(data), "--output_dir", str(out), "--batch_size", "2"]
    finished = load_config(None, overrides_from_flags(split_flags(flags)[1]))
    assert train_worker(finished, PreemptionFlag()) == 0
    first = {r["step"]: r["loss"] for r in read_metrics(out)}
    first_lr = {r["step"]: r["lr"] for r in read_metrics(out)}

    # Back to checkpoint-2 with another learning rate (--force); a crash in step 3, before any checkpoint of its own.
    again = flags + ["--learning_rate", "1e-3", "--force"]
    back = load_config(
        None, overrides_from_flags(split_flags(again + ["--resume_from_checkpoint", str(out / "checkpoint-2")])[1])
    )
    monkeypatch.setenv("PHALANX_FAULT", "raise@step=3")
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="injected fault"):
        train_worker(back, PreemptionFlag())
    said = capsys.readouterr().out
    assert "learning_rate 0.01 -> 0.001 from step 2 on (--force)" in said
    [aside] = out.glob("crashed-*")
    assert sorted(p.name for p in aside.iterdir()) == [
        "adapter_model.safetensors",
        "checkpoint-3",
        "checkpoint-4",
        "final_training_info.json",
    ]
    assert f"checkpoint-3, checkpoint-4 came after step 2 where this run resumes: moved to {aside}" in said
    assert (
        "the final model of a run that finished at step 4 (final_training_info.json, adapter_model.safetensors)" in said
    )
    assert marked_step(aside / "checkpoint-4") == 4  # moved whole, still committed

    # The requeue: latest is checkpoint-2, and steps 3-4 are trained at the new learning rate, not skipped.
    monkeypatch.delenv("PHALANX_FAULT")
    latest = load_config(None, overrides_from_flags(split_flags(again + ["--resume_from_checkpoint", "latest"])[1]))
    assert train_worker(latest, PreemptionFlag()) == 0
    resumed = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert list(resumed) == [1, 2, 3, 4] and [resumed[s] for s in (1, 2)] == [first[s] for s in (1, 2)]
    info = json.loads((out / "final_training_info.json").read_text())
    assert info["global_step"] == 4 and info["learning_rate"] == 1e-3
    # The new learning rate took over at the schedule's position: the checkpoint's optimizer and schedule carried
    # the old one (train.schedule.take_configured_hyperparameters); and it said so.
    lrs = {r["step"]: r["lr"] for r in read_metrics(out)}
    assert [lrs[s] for s in (1, 2)] == [first_lr[s] for s in (1, 2)]
    assert [lrs[s] for s in (3, 4)] == pytest.approx([first_lr[s] / 10 for s in (3, 4)], rel=1e-9)
    assert resumed[4] != first[4]


def _committed(folder: Path, step: int, files: dict[str, bytes]) -> Path:
    from phalanx.checkpoint.commit import commit

    staging = folder.with_name(f".{folder.name}.staging")
    staging.mkdir(parents=True)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    commit(staging, folder, {"global_step": step})
    return folder


@pytest.mark.parametrize("source", ["kept", "gone", "sharded only"])
def test_a_best_set_aside_is_rebuilt_from_the_checkpoint_that_holds_the_resumed_records_best(tmp_path, source):
    """The record at step 4 says the best eval came at step 2; checkpoint-best holds step 5's (saved, then a crash
    before checkpoint-6). Set aside, it is rebuilt from checkpoint-2 when that still holds the weights: a resumed run
    that never beats step 2 then ends with the checkpoint-best its record names. Otherwise the line says what will
    write it."""
    from phalanx.checkpoint.resume import set_aside_ahead

    out = tmp_path / "o"
    weights = {"adapter_model.safetensors": b"step 2 weights", "adapter_config.json": b"{}", "optimizer.pt": b"opt"}
    if source == "kept":
        _committed(out / "checkpoint-2", 2, weights)
    elif source == "sharded only":
        _committed(out / "checkpoint-2", 2, {"sharded_state.distcp": b"shards"})
    _committed(out / "checkpoint-4", 4, {"adapter_model.safetensors": b"step 4 weights"})
    _committed(out / "checkpoint-best", 5, {"adapter_model.safetensors": b"step 5 weights"})

    lines = set_aside_ahead(out, 4, "best eval loss 1.2345 at step 2", best_step=2)
    [aside] = out.glob("crashed-*")
    assert marked_step(aside / "checkpoint-best") == 5
    said = "\n".join(lines)
    assert f"checkpoint-best came from step 5, after step 4 where this run resumes: moved to {aside}" in said
    if source == "kept":
        assert "checkpoint-best is rebuilt from checkpoint-2, which holds that best" in said
        best = out / "checkpoint-best"
        assert marked_step(best) == 2
        assert {p.name: p.read_bytes() for p in best.iterdir() if p.name != MARKER} == weights
        assert (out / "checkpoint-2" / "adapter_model.safetensors").read_bytes() == b"step 2 weights"  # left as it was
        assert not list(out.glob(".checkpoint-best*"))  # no staging left behind
    else:
        why = "is gone" if source == "gone" else "holds no model weights (sharded state only)"
        assert f"checkpoint-2 {why}, so checkpoint-best is written again when an eval beats step 2's" in said
        assert not (out / "checkpoint-best").exists()
