"""training.loader_workers: worker processes pack micro-batches ahead of the loop, and change neither the losses nor
where a checkpoint resumes (the saved position counts micro-batches the loop took, not those the workers drew)."""

import json
import subprocess
import sys

import pytest

from equivalence import train

pytestmark = pytest.mark.system

WORKERS = ["--training.loader_workers", "2", "--save_steps", "2"]


def test_workers_give_the_same_steps_and_resume_at_the_micro_batch_taken(equivalence_data, tmp_path, single):
    _, padded = single("lora")  # one process, batch 4, no workers, padded
    out = tmp_path / "workers"
    losses = train(equivalence_data, out, 1, 4, "lora", *WORKERS)
    assert len(losses) == len(padded) == 5
    assert max(abs(a - b) for a, b in zip(losses, padded)) < 1e-5, (losses, padded)
    # Two steps of 4 rows were taken before checkpoint-2; the workers had drawn further (prefetch 2 x 2 workers).
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["sampler"]["position"] == 8, state["sampler"]

    # The same command resumed from checkpoint-2 (train() asserts it succeeds): the log is cut back and continued.
    resume = ("--force", "--resume_from_checkpoint", str(out / "checkpoint-2"))
    resumed = train(equivalence_data, out, 1, 4, "lora", *WORKERS, *resume)
    assert len(resumed) == 5 and max(abs(a - b) for a, b in zip(resumed, padded)) < 1e-5, (resumed, padded)


STOP_AND_EXIT = """
import sys
from torch.utils.data import DataLoader
from phalanx.runtime.signals import ignore_preemption_signals
from phalanx.train.run import stop_loader_workers

loader = DataLoader(list(range(100)), batch_size=2, num_workers=2, persistent_workers=True,
                    worker_init_fn=ignore_preemption_signals)
for i, batch in enumerate(loader):
    if i == 3:
        break  # as the loop does at max_steps: the workers hold prefetched batches
stop_loader_workers(loader)
"""


def test_workers_that_ignore_sigterm_are_stopped_so_the_rank_exits():
    """Persistent workers ignore SIGTERM (a job-wide one must not kill them before their rank saves), so a rank stops
    them itself (train.command, train_worker's finally). Left to interpreter exit, multiprocessing SIGTERMs them and
    waits forever: without the stop_loader_workers line this script never exits (killed after 40 s by hand), and a
    2-rank `--training.loader_workers 2 --batch_tokens 1536 --max_steps 14` run printed its summary and hung."""
    proc = subprocess.run([sys.executable, "-c", STOP_AND_EXIT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
