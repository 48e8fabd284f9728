"""The Checkpointer's decisions on real files: cadence, checkpoint-best, retention, one background save in flight, resume."""

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from phalanx.checkpoint.checkpointer import BestMetric, Checkpointer, CheckpointPolicy
from phalanx.checkpoint.commit import committed_step_checkpoints, is_committed
from phalanx.checkpoint.safe_load import load_state_file
from phalanx.runtime.dist import RankInfo

RANK = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


class Counter:
    """A stateful object of the run (as an optimizer or a scheduler would be)."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state: dict) -> None:
        self.value = int(state["value"])


def make(tmp_path: Path, step: dict, policy: CheckpointPolicy, model=None, **kwargs) -> Checkpointer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2) if model is None else model
    return Checkpointer(
        tmp_path,
        RANK,
        model=model,
        plain_weights=isinstance(model, torch.nn.Module),
        states={"counter": kwargs.pop("counter", Counter())},
        trainer_state=lambda: {"global_step": step["n"]},
        policy=policy,
        **kwargs,
    )


def committed(tmp_path: Path) -> list[int]:
    return [step for step, _ in committed_step_checkpoints(tmp_path)]


def test_cadence_saves_every_n_steps_and_when_stopping(tmp_path):
    step = {"n": 0}
    ck = make(tmp_path, step, CheckpointPolicy(every=2))
    saved = []
    for n in range(1, 6):
        step["n"] = n
        saved.append(ck.maybe_save(n))
    assert saved == [None, tmp_path / "checkpoint-2", None, tmp_path / "checkpoint-4", None]
    assert committed(tmp_path) == [2, 4]
    assert ck.maybe_save(5, stopping=True) == tmp_path / "checkpoint-5", "a stopping run saves off the cadence"
    assert committed(tmp_path) == [2, 4, 5]
    assert json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert CheckpointPolicy().every is None and not make(tmp_path / "x", step, CheckpointPolicy()).due(10)
    with pytest.raises(ValueError, match="every = 0"):
        CheckpointPolicy(every=0)


def test_best_follows_the_metric_and_keeps_its_record_on_the_holder(tmp_path):
    step = {"n": 0}
    record = SimpleNamespace(best_eval_loss=None, best_step=None)
    ck = make(tmp_path, step, CheckpointPolicy(), best=BestMetric(record, "best_eval_loss", "best_step"))
    marks = []
    for n, loss in enumerate([2.0, 1.5, 1.7, float("nan"), 1.2], start=1):
        step["n"] = n
        folder = ck.maybe_save_best(loss, n)
        marks.append(folder is not None)
        if folder is not None:
            assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == n
    assert marks == [True, True, False, False, True], "only a lower loss saves; NaN never does"
    assert (record.best_eval_loss, record.best_step) == (1.2, 5)
    assert is_committed(tmp_path / "checkpoint-best") and not (tmp_path / ".checkpoint-best.retired").exists()

    accuracy = SimpleNamespace(best=None)
    higher = make(tmp_path / "acc", step, CheckpointPolicy(save_best=False), best=BestMetric(accuracy, "best"))
    assert [higher.maybe_save_best(v, i, lower_is_better=False) for i, v in enumerate([0.5, 0.4, 0.6])] == [None] * 3
    assert accuracy.best == 0.6, "save_best=False: the best is tracked, nothing is written"
    assert not (tmp_path / "acc" / "checkpoint-best").exists()
    assert not BestMetric(accuracy, "best").improves(float("nan"), lower_is_better=False)


def test_retention_keeps_the_newest_and_never_checkpoint_best(tmp_path):
    step = {"n": 0}
    record = SimpleNamespace(best=None)
    ck = make(tmp_path, step, CheckpointPolicy(every=1, keep=2), best=BestMetric(record, "best"))
    for n in range(1, 6):
        step["n"] = n
        ck.maybe_save(n)
        if n == 1:
            ck.maybe_save_best(0.5, n)  # checkpoint-best holds step 1 and outlives every step folder of that age
    assert committed(tmp_path) == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-5", "checkpoint-best"]
    assert json.loads((tmp_path / "checkpoint-best" / "trainer_state.json").read_text())["global_step"] == 1


class GatedWeights:
    """A model whose files are written only once the test opens the gate; records what was committed by then."""

    def __init__(self, root: Path):
        self.root, self.gate, self.seen = root, threading.Event(), []

    def save_pretrained(self, folder: Path, safe_serialization: bool = True, state_dict=None) -> None:
        assert self.gate.wait(30), "the test never opened the gate"
        self.seen.append((Path(folder).name, [step for step, _ in committed_step_checkpoints(self.root)]))
        (Path(folder) / "weights.txt").write_text(Path(folder).name)


def test_background_saves_commit_one_at_a_time_in_order(tmp_path):
    step, counter = {"n": 2}, Counter(2)
    model = GatedWeights(tmp_path)
    ck = make(tmp_path, step, CheckpointPolicy(every=2, asynchronous=True), model=model, counter=counter)
    assert ck.maybe_save(2) == tmp_path / "checkpoint-2"
    assert ck.pending is not None and (tmp_path / ".checkpoint-2.staging").is_dir()
    assert committed(tmp_path) == [], "training goes on while checkpoint-2 is written"
    counter.value, step["n"] = 4, 4  # training moves on before the background write has started
    model.gate.set()
    ck.maybe_save(4)  # commits checkpoint-2 before checkpoint-4 is started
    ck.wait()
    assert ck.pending is None
    assert model.seen == [(".checkpoint-2.staging", []), (".checkpoint-4.staging", [2])]
    assert committed(tmp_path) == [2, 4] and not list(tmp_path.glob(".*.staging"))
    assert int(load_state_file(tmp_path / "checkpoint-2" / "counter.pt")["value"]) == 2, "the state at the call"
    assert json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert int(load_state_file(tmp_path / "checkpoint-4" / "counter.pt")["value"]) == 4


def test_a_stopping_save_is_committed_when_it_returns(tmp_path):
    step = {"n": 3}
    ck = make(tmp_path, step, CheckpointPolicy(every=2, asynchronous=True))
    ck.maybe_save(3, stopping=True)
    assert ck.pending is None and committed(tmp_path) == [3]


def test_load_restores_the_model_the_stateful_objects_and_returns_the_counters(tmp_path):
    step, counter = {"n": 7}, Counter(7)
    ck = make(tmp_path, step, CheckpointPolicy(every=7), counter=counter)
    saved_weights = {k: v.clone() for k, v in ck.model.state_dict().items()}
    assert ck.latest() is None
    ck.maybe_save(7)
    assert ck.latest() == tmp_path / "checkpoint-7"
    assert set(load_file(str(tmp_path / "checkpoint-7" / "model.safetensors"))) == {"weight", "bias"}

    torch.manual_seed(1)
    other, fresh = torch.nn.Linear(3, 2), Counter()
    resumed = Checkpointer(
        tmp_path, RANK, model=other, plain_weights=True, states={"counter": fresh}, trainer_state=lambda: {}
    )
    assert resumed.load(resumed.latest())["global_step"] == 7
    assert fresh.value == 7
    for name, value in other.state_dict().items():
        assert torch.equal(value, saved_weights[name]), name
