"""Rule 3 of the house: N ranks with batch b train exactly like one process with batch N*b.

Real ranks over gloo, started by `phalanx train --world_size 2` (torch's elastic launcher),
against one plain process; fp32 on CPU, losses compared step by step to 1e-5.
"""

from pathlib import Path

import pytest
from helpers import read_metrics, run_phalanx, write_chat_jsonl
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

COMMON = ["--max_steps", "5", "--log_steps", "1", "--eval_steps", "100", "--save_steps", "100", "--test_size", "0",
          "--lora_dropout", "0", "--learning_rate", "1e-2", "--max_length", "768", "--lora_r", "4",
          "--logging.progress_bar", "false", "--logging.tensorboard", "false"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("eq") / "train.jsonl", 48)


def train(dataset: Path, out: Path, world: int, batch: int, accum: int, finetune: str = "lora") -> list[float]:
    proc = run_phalanx("train", "--dataset_path", str(dataset), "--output_dir", str(out), "--world_size", str(world),
                       "--batch_size", str(batch), "--gradient_accumulation_steps", str(accum), "--finetune", finetune, *COMMON)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r["loss"] for r in read_metrics(out)]


@pytest.fixture(scope="module")
def single_lora(dataset, tmp_path_factory) -> tuple[Path, list[float]]:
    out = tmp_path_factory.mktemp("single-lora")
    return out, train(dataset, out, world=1, batch=4, accum=1)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_two_ranks_match_one_process_with_double_batch(dataset, tmp_path, finetune, single_lora):
    if finetune == "lora":
        single_dir, single = single_lora
    else:
        single_dir = tmp_path / "single"
        single = train(dataset, single_dir, world=1, batch=4, accum=1, finetune=finetune)
    ddp = train(dataset, tmp_path / "ddp", world=2, batch=2, accum=1, finetune=finetune)
    assert len(single) == len(ddp) == 5
    assert ddp == pytest.approx(single, abs=1e-5)
    assert single[-1] < single[0], "the loss moves: the comparison is not between two untrained models"
    weights = "adapter_model.safetensors" if finetune == "lora" else "model.safetensors"
    a, b = load_file(single_dir / weights), load_file(tmp_path / "ddp" / weights)
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] - b[key]).abs().max() < 1e-4, key


def test_accumulation_does_not_change_the_global_batch_loss(dataset, tmp_path, single_lora):
    _, single = single_lora
    accumulated = train(dataset, tmp_path / "accum", world=2, batch=1, accum=2)
    assert accumulated == pytest.approx(single, abs=1e-5)


def test_fp16_gradient_compression_stays_close(dataset, tmp_path, single_lora):
    """seed 000's comm hook: gradients travel as fp16, so the match is close rather than exact."""
    _, single = single_lora
    proc_losses = train_with(dataset, tmp_path / "hook", "--ddp_comm_hook", "fp16")
    assert proc_losses == pytest.approx(single, abs=1e-2)


def train_with(dataset: Path, out: Path, *extra: str) -> list[float]:
    proc = run_phalanx("train", "--dataset_path", str(dataset), "--output_dir", str(out), "--world_size", "2",
                       "--batch_size", "2", *COMMON, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r["loss"] for r in read_metrics(out)]
