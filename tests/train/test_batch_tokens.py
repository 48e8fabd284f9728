"""Token-budget micro-batches (training.batch_tokens): ranks train what one process trains with more accumulation,
and a run resumes at the micro-batch it saved, under another world size too."""

import pytest

from equivalence import COMMON, grad_norms
from helpers import read_metrics, run_phalanx
from phalanx.config.loader import load_config, overrides_from_flags
from phalanx.errors import ConfigError

pytestmark = pytest.mark.distributed

BUDGET = ["--batch_tokens", "1536", "--packing", "true"]


def run(dataset, out, world: int, accumulation: int, *extra: str) -> list[float]:
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(dataset),
        "--output_dir",
        str(out),
        "--world_size",
        str(world),
        "--gradient_accumulation_steps",
        str(accumulation),
        *COMMON,
        *BUDGET,
        *extra,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r["loss"] for r in read_metrics(out)]


def test_two_ranks_equal_one_process_and_resume_continues_at_the_saved_micro_batch(equivalence_data, tmp_path):
    one_dir = tmp_path / "one"
    one = run(equivalence_data, one_dir, 1, 2, "--save_steps", "2")
    two = run(equivalence_data, tmp_path / "two", 2, 1)
    assert len(one) == len(two) == 5
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)
    assert grad_norms(tmp_path / "two") == pytest.approx(grad_norms(one_dir), rel=1e-4)

    # Resume the one-process run from step 2 on two ranks: steps 3-5 are the uninterrupted ones.
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(equivalence_data),
        "--output_dir",
        str(one_dir),
        "--world_size",
        "2",
        *COMMON,
        *BUDGET,
        "--save_steps",
        "2",
        "--force",
        "--resume_from_checkpoint",
        str(one_dir / "checkpoint-2"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Resuming from" in proc.stdout and "at step 2" in proc.stdout
    resumed = [r["loss"] for r in read_metrics(one_dir)]  # the log is cut back to the resumed step, then continued
    assert len(resumed) == 5 and max(abs(a - b) for a, b in zip(resumed, one)) < 1e-5, (resumed, one)

    # Another budget counts positions in other micro-batches: refused by name, the checkpoint left as it was.
    before = sorted(p.name for p in (one_dir / "checkpoint-4").iterdir())
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(equivalence_data),
        "--output_dir",
        str(one_dir),
        *COMMON,
        "--batch_tokens",
        "2048",
        "--force",
        "--resume_from_checkpoint",
        str(one_dir / "checkpoint-4"),
    )
    assert proc.returncode != 0
    assert "batch_tokens = 1536, this run packs 2048" in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in (one_dir / "checkpoint-4").iterdir()) == before


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"training.batch_tokens": 512, "data.max_length": 1024}, "is less than data.max_length = 1024"),
        ({"training.batch_tokens": 4096, "data.packing": False}, "needs data.packing true"),
    ],
)
def test_a_budget_that_cannot_work_is_refused_by_field(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides_from_flags([(k, str(v)) for k, v in flags.items()]))
