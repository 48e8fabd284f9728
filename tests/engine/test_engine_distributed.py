"""TrainingEngine on real gloo ranks: 2 ranks with batch b train exactly like 1 process with batch 2b.

fp32 on CPU. Tolerances: epoch losses/accuracies 1e-6 absolute, weights and running statistics
1e-5 absolute; the differences measured are about 1e-7 (float sums in another order).
One launch checks both models (with and without BatchNorm), the uneven metric reduction and
reduce_tensor; a second goes through launch_distributed_training + distributed_train_worker.
"""

import math

import pytest
import torch
from torch import nn

from dist_workers import run_ranks
from engine import engine_ranks
from phalanx import distributed_train_worker, launch_distributed_training
from phalanx.engine.checkpoint import load_weights
from phalanx.errors import RanksFailed

pytestmark = pytest.mark.distributed
LOSS_TOL, WEIGHT_TOL = 1e-6, 1e-5


def assert_histories_match(single: dict, ddp: dict) -> None:
    assert single.keys() == ddp.keys()
    for key in single:
        if key != "epoch_time":
            assert ddp[key] == pytest.approx(single[key], abs=LOSS_TOL), key


def assert_states_match(single: dict, ddp: dict) -> None:
    assert single.keys() == ddp.keys()
    for key in single:
        assert (single[key].double() - ddp[key].double()).abs().max() <= WEIGHT_TOL, key


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return out, run_ranks(engine_ranks.rank_checks, 2, str(out))


@pytest.mark.parametrize("kind", ["mlp", "bn"])
def test_two_ranks_match_one_process_with_double_batch(ranks, kind, tmp_path):
    out, results = ranks
    single = engine_ranks.train_case(kind, 0, 1, str(tmp_path))
    r0, r1 = results[0][kind], results[1][kind]
    assert_histories_match(single["history"], r0["history"])
    assert r0["history"] == r1["history"], "every rank returns the same reduced history"
    assert single["history"]["train_loss"][-1] < single["history"]["train_loss"][0], "the model trains"
    assert_states_match(single["weights"], r0["weights"])  # includes BatchNorm running statistics
    assert_states_match(r0["weights"], r1["weights"])
    if kind == "bn":
        assert r0["bn_layers"] == ["CPUSyncBatchNorm"] and single["bn_layers"] == ["BatchNorm1d", "BatchNorm2d"]
        # Saved by rank 0, unwrapped, and loadable into the plain (non-synchronised) model on CPU.
        plain = engine_ranks.bn_cnn()
        plain.load_state_dict(load_weights(out / "bn" / "checkpoint-last", map_location="cpu"))
        assert_states_match(single["weights"], plain.state_dict())
        assert {p.name for p in (out / "bn" / "checkpoint-last").glob("rng_state_*.pt")} == {
            "rng_state_0.pt",
            "rng_state_1.pt",
        }
    else:
        assert_states_match(single["ema"], r0["ema"])
        assert_states_match(r0["ema"], r1["ema"])


def test_metrics_are_weighted_by_sample_counts_across_uneven_ranks(ranks):
    _, results = ranks
    rank0, rank1 = results[0]["uneven"], results[1]["uneven"]
    outputs = torch.cat([rank0["outputs"], rank1["outputs"]])
    targets = torch.cat([rank0["targets"], rank1["targets"]])
    expected_loss = nn.functional.cross_entropy(outputs, targets).item()
    expected_acc = (outputs.argmax(1) == targets).float().mean().item()
    for r in (rank0, rank1):
        assert r["reduced"]["samples"] == 7
        assert r["reduced"]["loss"] == pytest.approx(expected_loss, abs=1e-6)
        assert r["reduced"]["accuracy"] == pytest.approx(expected_acc, abs=1e-9)
        assert r["weighted_mean"] == pytest.approx(expected_loss, abs=1e-6)
    mean_of_means = (
        nn.functional.cross_entropy(rank0["outputs"], rank0["targets"]).item()
        + nn.functional.cross_entropy(rank1["outputs"], rank1["targets"]).item()
    ) / 2
    assert not math.isclose(mean_of_means, expected_loss, abs_tol=1e-3), "the data tells the two reductions apart"


def test_reduce_tensor_averages_or_sums_a_copy(ranks):
    _, results = ranks
    for r in results:
        assert r["reduce_mean"].tolist() == [1.5, 10.0]
        assert r["reduce_sum"].tolist() == [3.0, 20.0]
    assert results[1]["value_untouched"].tolist() == [2.0, 10.0]


def test_launch_with_the_worker_matches_one_process(tmp_path):
    """Seed 004's Method 2: spawned ranks, phalanx's sampler and shards, SyncBN, EMA, scheduler, checkpoints."""
    launched = launch_distributed_training(
        distributed_train_worker, 2, backend="gloo", **engine_ranks.worker_config(str(tmp_path / "ddp"), batch=6)
    )
    single = distributed_train_worker(0, 1, **engine_ranks.worker_config(str(tmp_path / "one"), batch=12))
    assert_histories_match(single, launched)
    assert launched["lr"] == [0.05, 0.025]
    for ema in (False, True):
        assert_states_match(
            load_weights(tmp_path / "one" / "worker" / "checkpoint-last", ema=ema),
            load_weights(tmp_path / "ddp" / "worker" / "checkpoint-last", ema=ema),
        )


def test_a_failing_rank_stops_the_others_and_is_named():
    with pytest.raises(
        RanksFailed, match=r"rank 1 failed; the other ranks were stopped(.|\n)*rank one fails on purpose"
    ):
        launch_distributed_training(engine_ranks.fail_on_rank_one, 2)
