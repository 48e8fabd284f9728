"""CUDA graphs over compiled layers (training.cuda_graphs, models/graphs.py): the parts a CPU can prove.

The graphs themselves exist on CUDA only (benchmarks/gpu_suite.sh compile-lora measures them). Here: every packed
micro-batch is padded to one of a few shapes; the padding changes no loss, no gradient and no count, through the
eager per-row attention and through compiled layers; gradients summed over several passes stay in the buffers
allocated before the first step; and a real 2-rank DDP CLI run with graphs asked for trains and evaluates exactly as a
run without them.
"""

import pytest
import torch

from helpers import read_metrics, run_phalanx, write_chat_jsonl
from models.tiny_lora import packed_batch, step, tiny_lora_model
from phalanx.config.flags import split_flags
from phalanx.config.loader import load_config, overrides_from_flags
from phalanx.data.collate import pad_packed
from phalanx.errors import ConfigError
from phalanx.models.compile import compile_decoder_layers
from phalanx.models.graphs import GraphShapes
from phalanx.parallel import Precision, Strategy
from phalanx.runtime.dist import RankInfo

CPU = torch.device("cpu")


def test_every_micro_batch_gets_one_of_a_few_shapes_with_room_for_its_padding():
    shapes = GraphShapes.for_run(token_bound=8192, row_bound=4, pad_token_id=0)
    seen = set()
    for tokens in range(1, 8193, 7):
        for rows in range(1, 5):
            padded_tokens, padded_rows = shapes.shape(tokens, rows)
            assert padded_rows == 5  # batch_size rows and one of padding, whatever the rows
            assert padded_tokens % shapes.token_step == 0 and padded_tokens % 64 == 0
            assert padded_tokens - tokens >= padded_rows - rows  # a token for every padding row
            assert padded_tokens - tokens < shapes.token_step + padded_rows  # never a whole step more than needed
            seen.add((padded_tokens, padded_rows))
    assert len(seen) <= 16
    # More rows than batch_size (evaluation at a larger batch, merged passes): the next power of two above them.
    assert shapes.shape(100, 5)[1] == 8 and shapes.shape(100, 9)[1] == 16


def test_padding_adds_rows_with_no_targets_and_changes_no_count():
    batch = packed_batch((37, 64, 23))
    padded = GraphShapes.for_run(token_bound=512, row_bound=4, pad_token_id=7).pad(batch)
    assert padded["input_ids"].shape[1] % 64 == 0 and len(padded["row_lengths"]) == 5
    assert padded["row_lengths"][:3] == (37, 64, 23) and min(padded["row_lengths"][3:]) >= 1
    tail = slice(124, None)
    assert (padded["input_ids"][0, tail] == 7).all() and (padded["labels"][0, tail] == -100).all()
    assert padded["position_ids"][0, 124:].tolist() == [0] + list(range(padded["row_lengths"][4]))
    for key in ("target_positions", "target_labels"):
        assert torch.equal(padded[key], batch[key])
    for key in ("rows", "input_tokens", "target_tokens"):
        assert padded[key] == batch[key]


def test_pad_packed_refuses_a_shape_the_micro_batch_does_not_fit():
    batch = packed_batch((10, 6))
    with pytest.raises(ValueError, match="padding rows need at least one token each"):
        pad_packed(batch, 17, 4, 0)  # 2 padding rows, 1 token
    with pytest.raises(ValueError, match="16 tokens in 2 rows to 32 tokens in 2 rows"):
        pad_packed(batch, 32, 2, 0)  # tokens but no row to hold them


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_padding_changes_neither_the_loss_nor_any_gradient(compiled):
    """Eager: the per-row attention slices the host lengths, padding rows included. Compiled (aot_eager, the graph
    inductor would capture): the layers read only the row ends on the device."""
    batch = packed_batch((37, 64, 23))
    padded = GraphShapes.for_run(token_bound=512, row_bound=4, pad_token_id=0).pad(batch)
    assert padded["input_ids"].shape[1] > batch["input_ids"].shape[1]
    results = []
    for b in (batch, padded):
        model = tiny_lora_model(gradient_checkpointing=False)
        if compiled:
            compile_decoder_layers(model, CPU, announce=False, backend="aot_eager")
        results.append(step(model, b))
    (loss, grads), (padded_loss, padded_grads) = results
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-5)
    assert grads.keys() == padded_grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(padded_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gradients_summed_over_passes_stay_in_the_buffers_allocated_up_front():
    """Several passes per step: .grad is allocated before the first pass and zeroed in place after each step, so the
    tensors autograd adds into are the same ones from the first step to the last (never an output of a graph)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    strategy = Strategy(RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU), Precision(None))
    model, optimizer = strategy.prepare(
        model, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1)
    )
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    assert strategy.keep_gradient_buffers() == len(trained) == 3
    buffers = [p.grad for p in trained]
    assert all(g is not None and not g.any() for g in buffers)
    for _ in range(2):
        for _ in range(3):  # passes of one step
            model(torch.randn(4, 8)).square().sum().backward()
        assert all(p.grad is g and g.abs().sum() > 0 for p, g in zip(trained, buffers))
        strategy.step(max_grad_norm=1.0)
        assert all(p.grad is g and not g.any() for p, g in zip(trained, buffers))
    assert model[0].weight.grad is None  # frozen: nothing allocated


@pytest.mark.system
@pytest.mark.distributed
def test_a_cli_run_with_cuda_graphs_trains_and_evaluates_as_an_eager_run(tmp_path):
    """2 DDP ranks, two micro-batches per step (gradients kept in place, then re-pointed into DDP's buckets),
    evaluation at a larger batch (other row counts), no dropout: every logged loss, gradient norm and eval loss
    equals the run without graphs, which is not compiled either (aot_eager's numerics are eager's; a second compiled
    run cost 30 s of the suite). On CPU no graph is captured; the run says so."""
    data = write_chat_jsonl(tmp_path / "rows.jsonl", 16)
    logs = {}
    for name, graphs in (("graphs", "true"), ("plain", "false")):
        proc = run_phalanx(
            "train",
            *("--dataset_path", str(data), "--output_dir", str(tmp_path / name), "--max_steps", "3"),
            *("--batch_size", "2", "--gradient_accumulation_steps", "2", "--eval.eval_batch_size", "3"),
            *("--test_size", "0.25", "--eval_steps", "2", "--save_steps", "1000", "--lora_dropout", "0"),
            *("--logging.tensorboard", "false", "--logging.progress_bar", "false", "--log_steps", "1"),
            *("--training.compile", graphs, "--training.cuda_graphs", graphs, "--world_size", "2"),
            env={"PHALANX_COMPILE_BACKEND": "aot_eager"},
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logs[name] = proc.stdout
        if graphs == "true":
            assert (
                "📐 training.cuda_graphs: packed micro-batches padded to a multiple of 192 tokens in 4 rows"
                in proc.stdout
            )
            assert "no CUDA graphs on the aot_eager backend" in proc.stdout
            # The compile flag reaches a CLI run (PHALANX_COMPILE_BACKEND chose the backend; test_compile.py checks
            # inductor's numerics in process).
            assert "Compiled 4 Qwen3DecoderLayer layers one by one (torch.compile, aot_eager)" in proc.stdout
        else:
            assert "Compiled" not in proc.stdout
    runs = {name: read_metrics(tmp_path / name) + read_metrics(tmp_path / name, "eval") for name in logs}
    assert len(runs["graphs"]) == len(runs["plain"]) == 5  # 3 train logs, 2 evals
    for got, want in zip(runs["graphs"], runs["plain"]):
        for key in ("loss", "grad_norm"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (key, got, want)


@pytest.mark.parametrize(
    "flags, named",
    [
        (("--training.compile", "false"), "training.compile false"),
        (("--packing", "false"), "data.packing false"),
        (("--strategy", "fsdp"), "--strategy fsdp"),
        (("--strategy", "deepspeed"), "--strategy deepspeed"),
        (("--gradient_checkpointing", "true"), "model.gradient_checkpointing"),
        (("--load_in_4bit", "true"), "model.load_in_4bit"),
    ],
)
def test_settings_graphs_cannot_run_with_are_refused_by_name(flags, named):
    with pytest.raises((ConfigError, ValueError)) as caught:
        load_config(None, overrides_from_flags(split_flags(["--training.cuda_graphs", "true", *flags])[1]))
    assert "training.cuda_graphs true cannot run with" in str(caught.value) and named in str(caught.value)
