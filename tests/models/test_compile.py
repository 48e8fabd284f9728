"""Regional torch.compile (training.compile, models/compile.py): compiled decoder layers train exactly as eager ones.

On CPU with the inductor backend (gcc is on this machine; without a C++ compiler inductor cannot build its kernels
and the test would have to use "aot_eager"): the embedded tiny model with LoRA (phalanx's fused forward) and
activation checkpointing, a packed micro-batch through the target-only loss, one step: loss and every LoRA
gradient equal the uncompiled ones to 1e-5, also with the layers' kernels launched from inductor's C++ wrapper
(PHALANX_COMPILE_CPP_WRAPPER=1). 'auto' leaves a CPU model alone. The flag reaches a real CLI run in
tests/models/test_graphs.py (2 ranks, with the aot_eager backend: inductor's kernels for a packed run take minutes on
2 shared cores, and their numerics are the tests here).
"""

import copy
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from models.tiny_lora import packed_batch, step, tiny_lora_model
from phalanx.models.blocks import decoder_layers
from phalanx.models.compile import (
    AUTO_COMPILE_MIN_MICRO_BATCHES,
    CPP_WRAPPER_ENV,
    auto_compile_line,
    compile_decoder_layers,
    compile_wanted,
    fuse_elementwise,
)

CPU = torch.device("cpu")


@pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="inductor needs a C++ compiler on CPU"
)
def test_compiled_layers_match_eager_loss_and_gradients():
    eager = tiny_lora_model(gradient_checkpointing=True)
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled, CPU, announce=False) is compiled
    layers = decoder_layers(compiled)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    # Names are untouched (compiled in place, not wrapped): checkpoints and FSDP see the same model.
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    batch = packed_batch()
    loss_e, grads_e = step(eager, batch)
    torch._dynamo.reset()
    counters.clear()
    loss_c, grads_c = step(compiled, batch)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo traced and compiled the layers, not a silent eager run
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    assert grads_e.keys() == grads_c.keys() and any("lora_A" in n for n in grads_e)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="inductor needs a C++ compiler on CPU"
)
def test_cpp_wrapper_launches_the_layers_from_cpp_with_the_same_loss_and_gradients(monkeypatch):
    """PHALANX_COMPILE_CPP_WRAPPER=1: inductor writes each layer graph's launcher in C++ (forward and backward), and
    the step is the eager one."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    wrappers = []
    create = CppWrapperCpu.create

    def counted(*args, **kwargs):
        wrappers.append(1)
        return create(*args, **kwargs)

    monkeypatch.setattr(CppWrapperCpu, "create", staticmethod(counted))
    # Inductor's on-disk caches outlive the session: a second run loaded the graphs an earlier one compiled, wrote no
    # wrapper and failed. Compiled here every time, as the first run on a machine compiles them.
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    monkeypatch.setenv(CPP_WRAPPER_ENV, "1")
    eager = tiny_lora_model(gradient_checkpointing=False)
    compiled = copy.deepcopy(eager)
    compile_decoder_layers(compiled, CPU, announce=False)
    batch = packed_batch()
    loss_e, grads_e = step(eager, batch)
    torch._dynamo.reset()
    loss_c, grads_c = step(compiled, batch)
    assert len(wrappers) >= 2  # a forward and a backward graph, each launched from C++
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-5, msg=name)


def test_compiled_layers_compile_once_for_any_number_of_rows():
    """A packed micro-batch's number of rows changes from step to step. The layers see the rows' ends as a device
    tensor only, so the graphs of the first step serve every later one (before, each new number of rows recompiled
    every layer until dynamo's recompile limit left them eager: benchmarks/RESULTS.md, compile_warmup.py), and each
    step still equals the eager model."""
    eager = tiny_lora_model(gradient_checkpointing=False)
    compiled = copy.deepcopy(eager)
    compile_decoder_layers(compiled, CPU, announce=False, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    first_graphs = None
    for lengths in ((37, 64, 23), (90,), (12, 30, 41, 18, 7), (55, 3)):
        batch = packed_batch(lengths)
        loss_e, grads_e = step(eager, batch)
        loss_c, grads_c = step(compiled, batch)
        eager.zero_grad(set_to_none=True)
        compiled.zero_grad(set_to_none=True)
        graphs = counters["stats"]["unique_graphs"]
        first_graphs = first_graphs or graphs
        assert graphs == first_graphs >= 1, f"{len(lengths)} rows compiled new graphs ({first_graphs} -> {graphs})"
        assert not counters["graph_break"], dict(counters["graph_break"])  # each layer is one graph, attention inside
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-5, msg=name)


def test_auto_compiles_only_where_measured_and_never_patches_liger_on_cpu():
    """'auto' compiles where a GPU measurement showed it pays (LoRA, CUDA, DDP or one process, a long run), and
    nowhere else; an explicit setting always wins."""
    cuda, measured = torch.device("cuda"), dict(plain_lora=True, packed=True, strategy="ddp")
    long_run = AUTO_COMPILE_MIN_MICRO_BATCHES
    assert compile_wanted("auto", cuda, **measured, micro_batches=long_run)
    assert not compile_wanted("auto", cuda, **measured, micro_batches=long_run - 1)
    assert not compile_wanted("auto", cuda, **measured, micro_batches=None)
    for other in (dict(plain_lora=False), dict(packed=False), dict(strategy="fsdp"), dict(strategy="deepspeed")):
        assert not compile_wanted("auto", cuda, **{**measured, **other}, micro_batches=long_run), other
    assert not compile_wanted("auto", CPU, **measured, micro_batches=long_run)
    assert compile_wanted("true", CPU) and not compile_wanted("false", cuda, **measured, micro_batches=long_run)
    model = tiny_lora_model(gradient_checkpointing=False)
    forwards = [layer.mlp.forward for layer in decoder_layers(model)]
    assert fuse_elementwise(model, False, "auto", CPU) is model
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in decoder_layers(model))
    assert [layer.mlp.forward for layer in decoder_layers(model)] == forwards  # Liger is CUDA-only


def test_the_log_says_what_auto_chose_where_the_runs_length_decided_it():
    """A LoRA run on CUDA long enough is told it compiles; a shorter one that a longer run would compile is told it
    stays eager, from how many passes 'auto' compiles, and how to compile anyway; where length does not matter (CPU,
    full fine-tuning, FSDP) or the user chose, nothing is said."""
    cuda, lora = torch.device("cuda"), dict(plain_lora=True, packed=True, strategy="ddp")
    long_run = auto_compile_line("auto", cuda, **lora, micro_batches=AUTO_COMPILE_MIN_MICRO_BATCHES, steps=100)
    assert long_run.startswith("🧩 training.compile auto: compiling") and "100 optimizer steps" in long_run
    short = auto_compile_line("auto", cuda, **lora, micro_batches=120, steps=30)
    assert short.startswith("🧩 training.compile auto: eager, as this LoRA run is 120 passes long")
    assert f"from {AUTO_COMPILE_MIN_MICRO_BATCHES:,}" in short and "--training.compile true" in short
    for device, kind in ((CPU, lora), (cuda, {**lora, "plain_lora": False}), (cuda, {**lora, "strategy": "fsdp"})):
        assert auto_compile_line("auto", device, **kind, micro_batches=120, steps=30) is None
        assert auto_compile_line("auto", device, **kind, micro_batches=10**6, steps=10**5) is None
    assert auto_compile_line("false", cuda, **lora, micro_batches=120, steps=30) is None
    assert auto_compile_line("true", cuda, **lora, micro_batches=10**6, steps=10**5) is None
