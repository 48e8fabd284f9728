"""The fused LoRA forward (models/lora_fused.py) computes what PEFT's does, over the same parameters and files.

fp32 on CPU: outputs and the gradients of A, B and the input equal PEFT's to 1e-6, with dropout 0 and with dropout
(the masks are PEFT's own draws). bf16: within bf16 rounding of PEFT, adapters stay fp32. save_pretrained output
loads with PeftModel.from_pretrained. A 4-bit (QLoRA) base runs the fused forward too. Layers the fused path does not
cover keep PEFT's forward, and the run says so.

PHALANX_TEST_DEVICE=cuda runs the same tests on a GPU (benchmarks/gpu_suite.sh lora-tests: CUDA's dropout kernel,
generator and mixed-dtype kernels are not on CPU); CI runs them on CPU."""

import copy
import os

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from phalanx.config.schema import LoraConfig, ModelConfig
from phalanx.models import lora_fused
from phalanx.models.adapters import apply_finetuning
from phalanx.models.lora_fused import FusedLoraLinear, install_fused_lora

DEVICE = torch.device(os.environ.get("PHALANX_TEST_DEVICE", "cpu"))

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
LINEARS = 7 * TINY["num_hidden_layers"]


def base_model(dtype=torch.float32):
    torch.manual_seed(0)
    # Qwen2: q/k/v carry biases, so their outputs are views of a flattened addmm, the case in-place addition must handle.
    return Qwen2ForCausalLM(Qwen2Config(**TINY)).to(dtype)


def lora_model(kernel, dropout=0.0, dtype=torch.float32, gradient_checkpointing=False):
    model = apply_finetuning(
        base_model(dtype),
        ModelConfig(gradient_checkpointing=gradient_checkpointing),
        LoraConfig(r=8, alpha=16, dropout=dropout, kernel=kernel),
    )
    # PEFT starts B at zero, where the update and A's gradient vanish: give B values so the test means something.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model.to(DEVICE)


def inputs(*shape, dtype=torch.float32, seed=None, scale=1.0):
    """Random input embeddings on the test device (drawn on CPU: the same values on every device)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def run(model, seed=3, autocast=None, train=True):
    """Logits, gradients of every adapter weight and of the input embeddings, for one forward+backward."""
    model.train(train)
    embeds = inputs(2, 24, TINY["hidden_size"], dtype=model.dtype, seed=2, scale=0.5).requires_grad_(True)
    torch.manual_seed(seed)  # the dropout masks
    with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
        logits = model(inputs_embeds=embeds).logits
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1], device=DEVICE)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logits.detach().float(), grads, embeds.grad.float()


@pytest.fixture(params=["keep", "redraw"])
def mask_policy(request, monkeypatch):
    """Both ways backward gets the dropout mask: kept as bools (CPU's default), or redrawn from the saved generator
    state (CUDA's default), whatever the test device's default is."""
    redraw_on = frozenset({DEVICE.type}) if request.param == "redraw" else frozenset()
    monkeypatch.setattr(lora_fused, "REDRAW_MASK_ON", redraw_on)
    return request.param


def assert_close(fused, peft, atol, rtol):
    (out_f, grads_f, gx_f), (out_p, grads_p, gx_p) = fused, peft
    torch.testing.assert_close(out_f, out_p, atol=atol, rtol=rtol)
    assert grads_f.keys() == grads_p.keys() and len(grads_f) == 2 * LINEARS
    for name in grads_p:
        torch.testing.assert_close(grads_f[name], grads_p[name], atol=atol, rtol=rtol, msg=name)
    torch.testing.assert_close(gx_f, gx_p, atol=atol, rtol=rtol)


class Calls(TorchDispatchMode):
    """The operators dispatched while active, by name (`aten.mm`), each call once: what launches kernels on a GPU."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_fused_is_the_default_and_covers_every_linear():
    model = lora_model("fused")
    assert LoraConfig().kernel == "fused"
    fused = [m for m in model.modules() if isinstance(m, FusedLoraLinear)]
    assert len(fused) == LINEARS
    peft = lora_model("peft")
    assert not any(isinstance(m, FusedLoraLinear) for m in peft.modules())
    # Same parameters, names, dtypes and trainability: optimizers, DDP/FSDP wrapping and checkpoints see no change.
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters()] == [
        (n, p.shape, p.dtype, p.requires_grad) for n, p in peft.named_parameters()
    ]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fp32_matches_peft(dropout, mask_policy):
    fused, peft = run(lora_model("fused", dropout)), run(lora_model("peft", dropout))
    assert_close(fused, peft, atol=1e-6, rtol=1e-5)
    if dropout:  # the masks are live: another seed gives other outputs, and the same seed PEFT's
        assert not torch.allclose(run(lora_model("fused", dropout), seed=4)[0], fused[0])


def test_dropout_masks_survive_activation_checkpointing(mask_policy):
    """Non-reentrant checkpointing recomputes the forward with the RNG restored; the redrawn masks must agree."""
    fused = run(lora_model("fused", 0.1, gradient_checkpointing=True))
    assert_close(fused, run(lora_model("peft", 0.1)), atol=1e-6, rtol=1e-5)


def test_dropout_is_one_operator_per_draw_and_backward_leaves_the_generator_where_it_was(mask_policy):
    """Each adapter's dropout is one `native_dropout` (CUDA: one fused kernel that draws and scales), no separate
    draw, multiply or cast of a mask; a redrawn mask is one more `native_dropout` in backward, whose masked input is
    the forward's exactly. Backward puts the default generator back: the draws after a step are those after its
    forward alone."""
    model = lora_model("fused", 0.1).train()
    embeds = inputs(2, 24, TINY["hidden_size"]).requires_grad_(True)
    torch.manual_seed(5)
    with Calls() as forward_calls:
        logits = model(inputs_embeds=embeds).logits
    after_forward = torch.randint(0, 2**30, (4,), device=DEVICE)
    torch.manual_seed(5)
    logits = model(inputs_embeds=embeds).logits
    with Calls() as backward_calls:
        logits.sum().backward()
    assert torch.equal(torch.randint(0, 2**30, (4,), device=DEVICE), after_forward)
    assert forward_calls.names.count("aten.native_dropout") == LINEARS
    assert "aten.bernoulli_" not in forward_calls.names + backward_calls.names
    redrawn = backward_calls.names.count("aten.native_dropout")
    assert redrawn == (LINEARS if mask_policy == "redraw" else 0)
    # The input's gradient takes the mask in the pass that adds the base's gradient to the update's (addcmul_), once
    # per adapter; a kept mask also rebuilds the masked input, for A's gradient.
    assert backward_calls.names.count("aten.addcmul_") == LINEARS
    rebuilt = backward_calls.names.count("aten.native_dropout_backward")
    assert rebuilt == (LINEARS if mask_policy == "keep" else 0)


def test_eval_mode_has_no_dropout():
    out = run(lora_model("fused", 0.3), train=False)[0]
    torch.testing.assert_close(out, run(lora_model("peft", 0.0), train=False)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_bf16_matches_peft_and_adapters_stay_fp32(autocast):
    # A bf16 base as phalanx loads it for LoRA runs, with and without autocast on top (DDP/single use autocast).
    fused_model, peft_model = lora_model("fused", dtype=torch.bfloat16), lora_model("peft", dtype=torch.bfloat16)
    fused, peft = run(fused_model, autocast=autocast), run(peft_model, autocast=autocast)
    for model in (fused_model, peft_model):
        assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
        assert {p.grad.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    # PEFT runs the update in fp32 without autocast, the fused path in bf16: bf16 rounding apart.
    scale = fused[0].abs().max()
    torch.testing.assert_close(fused[0], peft[0], atol=0.02 * scale, rtol=0.02)
    for name in peft[1]:
        ref = peft[1][name]
        assert (fused[1][name] - ref).norm() <= 0.03 * ref.norm() + 1e-6, name
    assert (fused[2] - peft[2]).norm() <= 0.03 * peft[2].norm()


def test_bf16_saves_far_fewer_activation_bytes(mask_policy):
    """What backward keeps, counted per storage (parameters aside): the fused path keeps no fp32, cast or dropped
    copies of the inputs; dropout costs it one byte per input element per adapter (kept bool mask) or nothing
    (redrawn mask). It does keep its bf16 casts of A and B (r x features each, so that backward launches no casts of
    its own): a fixed size, which at these 48 tokens is an eighth of the total, and is set apart below."""

    def saved_bytes(model):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        model.train()
        embeds = inputs(2, 24, TINY["hidden_size"], dtype=torch.bfloat16).requires_grad_(True)
        autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model(inputs_embeds=embeds).logits.float().sum().backward()
        return sum(seen.values())

    fused = {p: saved_bytes(lora_model("fused", p, dtype=torch.bfloat16)) for p in (0.0, 0.1)}
    peft = {p: saved_bytes(lora_model("peft", p, dtype=torch.bfloat16)) for p in (0.0, 0.1)}
    assert fused[0.0] < peft[0.0] < peft[0.1]
    model = lora_model("fused", 0.0, dtype=torch.bfloat16)
    weight_casts = 2 * sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)  # bf16 A and B
    # Masks: every adapter's input, once per adapter (q/k/v and gate/up read theirs separately, as in PEFT).
    cfg, tokens = Qwen2Config(**TINY), 2 * 24
    mask_bytes = tokens * cfg.num_hidden_layers * (4 * cfg.hidden_size + 2 * cfg.hidden_size + cfg.intermediate_size)
    assert fused[0.1] - fused[0.0] == (mask_bytes if mask_policy == "keep" else 0)
    assert fused[0.1] - fused[0.0] <= (peft[0.1] - peft[0.0]) / 4, (fused, peft)
    assert fused[0.1] - weight_casts < 0.6 * peft[0.1], (fused, peft, weight_casts)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiles_in_one_graph_and_matches_eager(dropout, mask_policy):
    """Regional torch.compile (training.compile) traces a fused layer without graph breaks, and its forward and
    backward match eager (aot_eager: no Inductor on CI's two cores). Compiled graphs add the update out of place."""
    model = lora_model("fused", dropout).train()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = inputs(2, 16, TINY["hidden_size"]).requires_grad_(True)
    weight = torch.linspace(0, 1, layer.out_features, device=DEVICE)
    results = []
    torch._dynamo.reset()
    for forward in (torch.compile(layer, backend="aot_eager", fullgraph=True), layer):
        torch.manual_seed(0)
        (forward(x) * weight).sum().backward()
        results.append([x.grad.clone(), *(p.grad.clone() for p in layer.parameters() if p.requires_grad)])
        x.grad = None
        model.zero_grad()
    for compiled, eager in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)


def test_save_pretrained_loads_with_peft(tmp_path):
    model = lora_model("fused", 0.1)
    out = run(model, train=False)[0]
    model.save_pretrained(tmp_path / "fused")
    lora_model("peft", 0.1).save_pretrained(tmp_path / "peft")
    from safetensors.torch import load_file

    fused_file, peft_file = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("fused", "peft"))
    assert {k: v.shape for k, v in fused_file.items()} == {k: v.shape for k, v in peft_file.items()}
    loaded = PeftModel.from_pretrained(base_model(), tmp_path / "fused")
    assert not any(isinstance(m, FusedLoraLinear) for m in loaded.modules())
    torch.testing.assert_close(run(loaded, train=False)[0], out, atol=1e-6, rtol=1e-5)


def test_disabled_and_merged_adapters_take_peft_paths():
    model = lora_model("fused")
    model.eval()
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
        torch.testing.assert_close(plain, base_model()(input_ids=ids).logits)
        assert not torch.allclose(plain, adapted)
        merged = copy.deepcopy(model).merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)


def test_variants_keep_peft_forward_and_the_run_says_so(capsys):
    model = get_peft_model(base_model(), PeftLoraConfig(r=4, target_modules="all-linear", use_dora=True))
    fused, others = install_fused_lora(model)
    assert fused == 0 and sum(others.values()) == LINEARS
    from phalanx.models.adapters import use_fused_kernel

    use_fused_kernel(get_peft_model(base_model(), PeftLoraConfig(r=4, target_modules="all-linear", use_dora=True)))
    said = capsys.readouterr().out
    assert said.count("LoRA kernel") == 1 and "PEFT's forward on" in said


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_qlora_base_runs_the_fused_forward_and_matches_peft(dropout, mask_policy, capsys):
    """A 4-bit base (bitsandbytes NF4, on CPU) gets the fused forward too: outputs and the gradients of A, B and the
    input equal PEFT's Linear4bit forward (fp32 compute, dropout masks PEFT's own draws), and nothing is said about
    layers keeping PEFT's forward."""
    pytest.importorskip("bitsandbytes")
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.models.load import load_model, quantization_config

    def qlora(kernel):
        flags = [("load_in_4bit", "true"), ("lora_dropout", str(dropout)), ("lora.kernel", kernel)]
        cfg = load_config(None, overrides_from_flags(flags))
        model = load_model("embedded:tiny-qwen3", torch.float32, quantization=quantization_config(cfg.model, None))
        torch.manual_seed(0)
        model = apply_finetuning(model, cfg.model, cfg.lora)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B starts at zero in PEFT: give it values so the comparison means something
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        return model.to(DEVICE)

    capsys.readouterr()
    fused, peft = qlora("fused"), qlora("peft")
    assert "LoRA kernel" not in capsys.readouterr().out
    kinds = {type(m).__name__ for m in fused.modules() if hasattr(m, "lora_A")}
    assert kinds == {"FusedLoraLinear4bit"}, kinds
    assert not any(type(m).__name__.startswith("Fused") for m in peft.modules())

    def run(model):
        model.train()
        embeds = inputs(2, 24, model.config.hidden_size, seed=2, scale=0.5).requires_grad_(True)
        torch.manual_seed(3)  # the dropout masks
        logits = model(inputs_embeds=embeds).logits
        (logits.float() * torch.linspace(-1, 1, logits.shape[-1], device=DEVICE)).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        return logits.detach(), grads, embeds.grad

    (logits_f, grads_f, input_f), (logits_p, grads_p, input_p) = run(fused), run(peft)
    torch.testing.assert_close(logits_f, logits_p, rtol=1e-6, atol=1e-6)
    assert grads_f.keys() == grads_p.keys() and any("lora_A" in n for n in grads_f)
    # fp32 rounding apart (the update's scale sits inside the GEMM here, after it in PEFT): measured up to 1e-5 on
    # gradients of size 30, so relative to each tensor's own scale.
    for name in grads_p:
        assert (grads_f[name] - grads_p[name]).norm() <= 2e-6 * grads_p[name].norm(), name
    assert (input_f - input_p).norm() <= 2e-6 * input_p.norm()


@pytest.mark.distributed
def test_cli_training_with_dropout_matches_the_peft_kernel(equivalence_data, tmp_path):
    """Through `phalanx train` (one process, fp32 CPU, dropout live): PEFT's draws on CPU are the fused path's, so the
    runs agree to rounding. The first two steps' gradient norms agree to 1e-6 (different masks would move them by
    percents; measured 1.1e-7, the fused backward scaling inside its GEMMs); after that the order of fp32 roundings
    differs (the LoRA scale sits inside a GEMM) and Adam at lr 1e-2 with clipping grows it: measured 3e-5 relative in
    the step-5 loss."""
    from safetensors.torch import load_file

    from equivalence import grad_norms, train

    runs = {
        kernel: train(
            equivalence_data, tmp_path / kernel, 1, 4, "lora", "--lora_dropout", "0.1", "--lora.kernel", kernel
        )
        for kernel in ("fused", "peft")
    }
    assert grad_norms(tmp_path / "fused")[:2] == pytest.approx(grad_norms(tmp_path / "peft")[:2], rel=1e-6)
    assert runs["fused"] == pytest.approx(runs["peft"], rel=2e-4)
    assert runs["fused"][-1] < runs["fused"][0]
    fused, peft = (load_file(tmp_path / k / "adapter_model.safetensors") for k in ("fused", "peft"))
    assert fused.keys() == peft.keys()
    for key in peft:
        assert (fused[key] - peft[key]).norm() <= 1e-3 * peft[key].norm(), key


class _ViewingMatmul(torch.autograd.Function):
    """A base layer's matmul that returns a view made inside a custom Function, as bitsandbytes' MatMul4Bit does on
    CUDA: autograd forbids modifying such a view in place."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return (x.reshape(-1, x.shape[-1]) @ weight.t()).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, None


def _base_outputs_made_by_a_custom_function(model):
    for module in model.modules():
        if hasattr(module, "lora_A"):
            base = module.get_base_layer()
            base.forward = lambda x, base=base: (
                _ViewingMatmul.apply(x, base.weight)
                if base.bias is None
                else _ViewingMatmul.apply(x, base.weight) + base.bias
            )


def _backward_nodes(tensor) -> set[str]:
    seen, names, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_base_output_that_is_a_view_gets_the_update_out_of_place(dropout, mask_policy):
    """Qwen2's q/k/v (biased linears) return views: an in-place update made autograd copy each whole output back in
    backward (CopySlices, a clone and two copies per layer). A view made inside a custom Function (the 4-bit base on
    CUDA) could not be modified at all: 'Output 0 of MatMul4BitBackward is a view and is being modified inplace'."""
    model = lora_model("fused", dropout)
    logits = model(inputs_embeds=inputs(1, 8, TINY["hidden_size"])).logits
    assert "CopySlices" not in _backward_nodes(logits)

    fused, peft = lora_model("fused", dropout), lora_model("peft", dropout)
    for m in (fused, peft):
        _base_outputs_made_by_a_custom_function(m)
    assert_close(run(fused), run(peft), atol=1e-6, rtol=1e-5)


def test_a_plain_frozen_base_runs_inside_the_adapter_one_node_and_one_input_gradient():
    """Over a plain frozen nn.Linear the fused Function applies the base itself: one autograd node per adapter (none
    of the base linear's own), and x's gradient is the base's and the update's summed in the same pass, not two
    gradients that autograd adds. A base that is hooked or trained is called as a module instead, and the result is
    still PEFT's (outputs and every gradient, the trained base's own included)."""
    model = lora_model("fused", 0.1)
    logits = model(inputs_embeds=inputs(1, 8, TINY["hidden_size"]).requires_grad_(True)).logits
    counts: dict[str, int] = {}
    seen, stack = set(), [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] = counts.get(type(node).__name__, 0) + 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    assert counts["_LoraUpdateBackward"] == LINEARS
    linear_nodes = sum(counts.get(name, 0) for name in ("MmBackward0", "AddmmBackward0", "LinearBackward0"))
    assert linear_nodes == 1, counts  # the output head's; no adapter's base adds one

    calls = []
    fused, peft = lora_model("fused", 0.1), lora_model("peft", 0.1)
    for m in (fused, peft):
        layer = m.base_model.model.model.layers[1]
        layer.self_attn.q_proj.base_layer.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
        layer.mlp.down_proj.base_layer.weight.requires_grad_(True)
    (out_f, grads_f, gx_f), (out_p, grads_p, gx_p) = run(fused), run(peft)
    assert len(calls) == 2  # the hooked base was called as a module, by each model
    torch.testing.assert_close(out_f, out_p, atol=1e-6, rtol=1e-5)
    assert grads_f.keys() == grads_p.keys() and len(grads_f) == 2 * LINEARS + 1
    for name in grads_p:
        torch.testing.assert_close(grads_f[name], grads_p[name], atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(gx_f, gx_p, atol=1e-6, rtol=1e-5)


def _train(model, steps, kept=False, on_step=None):
    """`steps` AdamW steps of one forward+backward each under bf16 autocast; the losses, and the dispatched operators
    of each step's forward."""
    from phalanx.models.lora_fused import keep_casts

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if kept:
        assert keep_casts(model, optimizer, torch.bfloat16, "single", compiled=False) is not None
    model.train()
    losses, forward_ops = [], []
    for step in range(steps):
        embeds = inputs(2, 24, TINY["hidden_size"], dtype=model.dtype, seed=20 + step, scale=0.5)
        torch.manual_seed(10 + step)
        with Calls() as calls, torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = model(inputs_embeds=embeds).logits
        forward_ops.append(calls.names)
        loss = (logits.float() * torch.linspace(-1, 1, logits.shape[-1], device=DEVICE)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if on_step:
            on_step(model, step)
    return losses, forward_ops


def test_kept_casts_train_exactly_as_casting_in_every_forward_with_two_casts_fewer_per_adapter():
    """KeptCasts (one process or DDP under autocast, eager): A and B kept in bf16 between optimizer steps, refreshed
    in one foreach copy after each step. Training is bit for bit the same as casting in every forward; from the second
    step on, a forward casts no adapter weight (2 casts fewer per adapter)."""
    plain, kept = lora_model("fused", 0.1, dtype=torch.bfloat16), lora_model("fused", 0.1, dtype=torch.bfloat16)
    losses_plain, ops_plain = _train(plain, 3)
    losses_kept, ops_kept = _train(kept, 3, kept=True)
    assert losses_kept == losses_plain
    for (name, p), q in zip(plain.named_parameters(), kept.parameters()):
        assert torch.equal(p, q), name
    for step in (1, 2):
        assert ops_plain[step].count("aten._to_copy") - ops_kept[step].count("aten._to_copy") == 2 * LINEARS
        assert "aten._foreach_copy_" not in ops_kept[step]  # refreshed after the step, not in the forward


def test_kept_casts_follow_a_weight_changed_outside_the_optimizer():
    """A LoRA weight changed in place, or swapped under `.data`, between steps is copied again in the next forward:
    the losses equal a run that casts in every forward and has the same changes."""

    def change(model, step):
        layer = model.base_model.model.model.layers[0].mlp.up_proj
        with torch.no_grad():
            if step == 0:
                layer.lora_A["default"].weight.mul_(1.5)
            elif step == 1:
                layer.lora_B["default"].weight.data = layer.lora_B["default"].weight.data * -2.0

    plain, kept = lora_model("fused", 0.0, dtype=torch.bfloat16), lora_model("fused", 0.0, dtype=torch.bfloat16)
    assert _train(kept, 3, kept=True, on_step=change)[0] == _train(plain, 3, on_step=change)[0]


def test_kept_casts_only_for_eager_single_process_or_ddp_runs_under_autocast():
    from phalanx.models.lora_fused import keep_casts

    model = lora_model("fused", 0.0, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert keep_casts(model, optimizer, None, "single", compiled=False) is None  # fp32: nothing to cast
    assert keep_casts(model, optimizer, torch.bfloat16, "fsdp", compiled=False) is None  # sharded weights
    assert keep_casts(model, optimizer, torch.bfloat16, "deepspeed", compiled=False) is None
    assert keep_casts(model, optimizer, torch.bfloat16, "ddp", compiled=True) is None  # graphs cast for themselves
    peft = lora_model("peft", 0.0, dtype=torch.bfloat16)
    assert keep_casts(peft, optimizer, torch.bfloat16, "ddp", compiled=False) is None  # no fused layers
    assert len(keep_casts(model, optimizer, torch.bfloat16, "ddp", compiled=False).layers) == LINEARS
