"""checkpoint-best from after the checkpoint a run resumes from (saved, then a crash before the next checkpoint-N)
is a future the resumed run has not lived: it is set aside, not kept as the best nor deleted, and the resumed run's
checkpoint-best is the one its own records name."""

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
