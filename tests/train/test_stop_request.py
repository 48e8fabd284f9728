"""A stop request (Ctrl-C, SIGTERM, SIGUSR1) stops the run at the step it promised: the step under way when it
came, or, when it came while a checkpoint was saved, that checkpoint's step, untrained further; a resume then
continues exactly. In process: the handler only sets the flag, so the test sets it at the moment a signal would
(tests/runtime/test_faults.py sends real signals to real ranks)."""

from pathlib import Path

import pytest

from helpers import read_metrics, tiny_run, write_chat_jsonl
from phalanx.checkpoint.checkpointer import Checkpointer
from phalanx.checkpoint.commit import committed_step_checkpoints
from phalanx.config.flags import split_flags
from phalanx.config.loader import load_config, overrides_from_flags
from phalanx.runtime.signals import PREEMPTED_EXIT_CODE, PreemptionFlag
from phalanx.train import loop
from phalanx.train.command import train_worker


def run(out: Path, data: Path, flag: PreemptionFlag, eval_steps: int = 50) -> int:
    flags = tiny_run({"max_steps": 4, "save_steps": 2, "test_size": 0, "eval_steps": eval_steps})
    flags += ["--dataset_path", str(data), "--output_dir", str(out), "--batch_size", "2"]
    return train_worker(load_config(None, overrides_from_flags(split_flags(flags)[1])), flag)


def press(flag: PreemptionFlag) -> None:
    flag.requested, flag.signal_name = True, "SIGINT"  # what PreemptionFlag's handler does


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    data = write_chat_jsonl(tmp_path_factory.mktemp("stop") / "train.jsonl", 12)
    out = data.parent / "uninterrupted"
    assert run(out, data, PreemptionFlag()) == 0
    return data, losses(out)


def test_a_request_during_a_save_stops_at_that_checkpoint_and_the_resume_continues_exactly(
    reference, tmp_path, monkeypatch
):
    """Ctrl-C while checkpoint-2 was written: the run trained step 3 and saved checkpoint-3 as well."""
    data, expected = reference
    flag, save = PreemptionFlag(), Checkpointer.save

    def save_and_press(self, name, **kwargs):
        folder = save(self, name, **kwargs)
        if name == "checkpoint-2":
            press(flag)
        return folder

    monkeypatch.setattr(Checkpointer, "save", save_and_press)
    out = tmp_path / "o"
    assert run(out, data, flag) == PREEMPTED_EXIT_CODE
    assert [s for s, _ in committed_step_checkpoints(out)] == [2] and list(losses(out)) == [1, 2]
    monkeypatch.setattr(Checkpointer, "save", save)
    assert run(out, data, PreemptionFlag()) == 0
    assert losses(out) == pytest.approx(expected, rel=1e-6)


def test_a_request_during_a_step_stops_after_that_step(reference, tmp_path, monkeypatch):
    """Ctrl-C in step 3's forward pass: the run trained step 4 as well before it stopped."""
    data, expected = reference
    flag, loss, calls = PreemptionFlag(), loop.token_loss_sum, []

    def loss_and_press(model, batch):
        calls.append(1)
        if len(calls) == 3:  # one micro-batch per step, no evaluation: step 3
            press(flag)
        return loss(model, batch)

    monkeypatch.setattr(loop, "token_loss_sum", loss_and_press)
    out = tmp_path / "o"
    assert run(out, data, flag) == PREEMPTED_EXIT_CODE
    assert [s for s, _ in committed_step_checkpoints(out)] == [2, 3] and list(losses(out)) == [1, 2, 3]
    assert losses(out) == pytest.approx({s: expected[s] for s in (1, 2, 3)}, rel=1e-6)


def test_a_request_during_an_evaluation_stops_at_that_step(reference, tmp_path, monkeypatch):
    """Ctrl-C while step 3's evaluation ran: the run saves checkpoint-3 and stops, step 4 untrained (it trained step 4
    first, and stopped there: a step after the one the request came in)."""
    data, expected = reference
    flag, evaluate = PreemptionFlag(), loop.run_eval

    def evaluate_and_press(run_):
        result = evaluate(run_)
        if run_.state.global_step == 3:
            press(flag)
        return result

    monkeypatch.setattr(loop, "run_eval", evaluate_and_press)
    out = tmp_path / "o"
    assert run(out, data, flag, eval_steps=3) == PREEMPTED_EXIT_CODE
    assert [s for s, _ in committed_step_checkpoints(out)] == [2, 3] and list(losses(out)) == [1, 2, 3]
    monkeypatch.setattr(loop, "run_eval", evaluate)
    assert run(out, data, PreemptionFlag(), eval_steps=3) == 0
    assert losses(out) == pytest.approx(expected, rel=1e-6)
