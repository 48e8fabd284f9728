"""Evaluation is token-weighted over every rank's shard (real gloo ranks with different token counts)."""

import contextlib

import pytest
import torch

from dist_workers import TinyLM, eval_batches_for, evaluate_on_rank, run_ranks
from phalanx.train.evaluate import evaluate


@pytest.mark.distributed
def test_eval_loss_is_weighted_by_tokens_across_ranks():
    per_rank = run_ranks(evaluate_on_rank, 2)
    everything = eval_batches_for(0) + eval_batches_for(1)
    reference = evaluate(TinyLM(), everything, torch.device("cpu"), contextlib.nullcontext)
    assert per_rank[0] == per_rank[1], "every rank reports the same reduced loss"
    assert per_rank[0]["tokens"] == reference["tokens"] == 3 * 11 + 3
    assert per_rank[0]["loss"] == pytest.approx(reference["loss"], abs=1e-6)
    rank0_only = evaluate(TinyLM(), eval_batches_for(0), torch.device("cpu"), contextlib.nullcontext)
    mean_of_means = (
        rank0_only["loss"]
        + evaluate(TinyLM(), eval_batches_for(1), torch.device("cpu"), contextlib.nullcontext)["loss"]
    ) / 2
    assert per_rank[0]["loss"] != pytest.approx(mean_of_means, abs=1e-4), "a mean of per-rank means would differ"
    assert per_rank[0]["loss"] != pytest.approx(rank0_only["loss"], abs=1e-4)
