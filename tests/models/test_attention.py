"""The torch varlen_attn self-check (models/attention.py): trusted only after it equals the per-row path, and a
refusal is said once with its reason (CPU has no flash kernel, so CPU tensors exercise the refusal)."""

import torch

from phalanx.models import attention


def _heads(kv_heads: int = 2):
    return torch.randn(1, 4, 12, 8), torch.randn(1, kv_heads, 12, 8)


def test_refused_kernel_is_said_once_with_its_reason(monkeypatch, capsys):
    monkeypatch.setattr(attention, "_torch_varlen_ok", {})
    query, key = _heads()
    assert attention._torch_varlen_usable(query, key) is False
    assert attention._torch_varlen_usable(query, key) is False
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("🧮 torch varlen_attn is not used (") and "one SDPA call each" in lines[0]


def test_kernel_that_disagrees_is_refused_and_one_that_agrees_is_trusted(monkeypatch, capsys):
    monkeypatch.setattr(attention, "_torch_varlen_ok", {})
    query, key = _heads()
    monkeypatch.setattr(
        attention,
        "_torch_varlen",
        lambda q, k, v, cu, longest, s: attention._per_row_sdpa(q, k, v, attention._lengths(cu), s) + 1.0,
    )
    assert attention._torch_varlen_usable(query, key) is False
    assert "differs from the per-row path by 1.0e+00" in capsys.readouterr().out

    monkeypatch.setattr(attention, "_torch_varlen_ok", {})
    monkeypatch.setattr(
        attention,
        "_torch_varlen",
        lambda q, k, v, cu, longest, s: attention._per_row_sdpa(q, k, v, attention._lengths(cu), s),
    )
    assert attention._torch_varlen_usable(query, key) is True
    assert capsys.readouterr().out == ""


def test_varlen_options_follow_the_installed_signature():
    def newer(
        q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        pass

    def older(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        pass

    def between(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        pass

    key = value = torch.randn(10, 2, 8)  # (T, H_kv, D)
    options, k, v = attention._varlen_options(newer, 0.5, key, value, query_heads=6)
    assert options == {"window_size": (-1, 0), "scale": 0.5, "enable_gqa": True} and k is key
    options, k, v = attention._varlen_options(between, None, key, value, query_heads=6)
    assert options == {"window_size": (-1, 0)} and k.shape == (10, 6, 8)
    assert torch.equal(k[:, :3], key[:, :1].expand(10, 3, 8)) and torch.equal(v[:, 3:], value[:, 1:].expand(10, 3, 8))
    options, k, v = attention._varlen_options(older, 8**-0.5, key, key, query_heads=2)  # the default scale: fine
    assert options == {"is_causal": True} and k is key
    try:
        attention._varlen_options(older, 0.5, key, value, query_heads=2)
    except TypeError as exc:
        assert "no scale" in str(exc)
    else:
        raise AssertionError("a scale the kernel cannot take must not be dropped")


def test_packed_operator_equals_the_per_row_path_with_its_gradients():
    """`phalanx::packed_causal_sdpa` (what a compiled layer calls where there is no varlen kernel) reads the rows from
    the device tensor and gives the per-row path's output and gradients, grouped heads included; opcheck tests its
    fake (shape-only) kernel and autograd registration as torch.compile uses them."""
    gen = torch.Generator().manual_seed(0)
    rows = (5, 1, 11, 7)
    query = torch.randn(1, 4, sum(rows), 8, generator=gen, dtype=torch.float64).transpose(1, 2).contiguous()
    query = query.transpose(1, 2)  # the (1, H, T, D) view of a (1, T, H, D) tensor, as the attention gets it
    key, value = (torch.randn(1, 2, sum(rows), 8, generator=gen, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, 5, 6, 17, 24], dtype=torch.int32)
    inputs = [t.clone().requires_grad_() for t in (query, key, value)]
    reference = [t.clone().requires_grad_() for t in (query, key, value)]
    out = torch.ops.phalanx.packed_causal_sdpa(*inputs, cu, 0.3)
    expected = attention._per_row_sdpa(*reference, rows, 0.3)
    assert out.shape == (1, sum(rows), 4, 8)
    torch.testing.assert_close(out, expected)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, reference, grad)):
        torch.testing.assert_close(got, want)
    # No position attends across a row: the second row (one token) is its own value.
    torch.testing.assert_close(out[0, 5], value[0, :, 5].repeat_interleave(2, dim=0))
    torch.library.opcheck(torch.ops.phalanx.packed_causal_sdpa.default, (*inputs, cu, 0.3))


def test_packed_kwargs_carry_host_lengths_until_the_layers_are_compiled(monkeypatch):
    monkeypatch.setattr(attention, "_active", attention.VARLEN)
    monkeypatch.setattr(attention, "_host_lengths", True)
    kwargs = attention.packed_attention_kwargs((3, 4), torch.device("cpu"))
    assert kwargs[attention.ROW_LENGTHS] == (3, 4) and kwargs[attention.CU_SEQ_LENS].tolist() == [0, 3, 7]
    attention.layers_compiled()
    kwargs = attention.packed_attention_kwargs((3, 4), torch.device("cpu"))
    assert list(kwargs) == [attention.CU_SEQ_LENS] and kwargs[attention.CU_SEQ_LENS].dtype == torch.int32


def test_the_kernel_check_at_setup_is_keyed_as_the_layers_look_it_up(monkeypatch):
    """On CUDA the varlen kernel is checked when packing is switched on (compiled layers cannot run the check while
    traced, only read its outcome): the check must be stored under the key a layer's attention looks up, or compiled
    layers would quietly take the per-row path. The key is built here on CPU from the embedded model's config, and
    compared with what its attention sees in a packed forward."""
    from phalanx.data.collate import collate
    from phalanx.models.load import load_model
    from phalanx.train.loss import model_inputs

    monkeypatch.setattr(attention, "_torch_varlen_ok", {})
    model = load_model("embedded:tiny-qwen3", torch.float32, False, device=torch.device("cpu"))
    attention.enable_varlen_attention(model, torch.device("cpu"))
    attention._check_torch_varlen_for(model, torch.device("cpu"), torch.float32)
    assert list(attention._torch_varlen_ok.values()) == [False]  # no flash kernel on CPU; the key is what matters
    seen = []
    per_row = attention._per_row_sdpa

    def record(query, key, value, rows, scaling):
        seen.append(attention._signature(query, key))
        return per_row(query, key, value, rows, scaling)

    monkeypatch.setattr(attention, "_per_row_sdpa", record)
    batch = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}], 0, True)
    with torch.no_grad():
        model(**model_inputs(batch))
    assert seen and set(seen) == set(attention._torch_varlen_ok)


def test_mixed_dtypes_under_autocast_run_in_autocasts_dtype():
    """Full fine-tuning under bf16 autocast: RoPE leaves q and k in fp32 (fp32 weights) while v comes out of an
    autocast linear in bf16. Eager SDPA is cast by autocast, but the varlen kernel and phalanx's operator run below
    autocast: a compiled layer gave them mixed dtypes and died ("Expected query, key, and value to have the same
    dtype", on an H100 on 2026-11-27). Both paths now run in bf16 and equal the per-row path in bf16."""
    gen = torch.Generator().manual_seed(0)
    rows = (5, 9)
    query, key = (torch.randn(1, h, sum(rows), 8, generator=gen) for h in (4, 2))
    value = torch.randn(1, 2, sum(rows), 8, generator=gen).bfloat16()
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    expected = attention._per_row_sdpa(query.bfloat16(), key.bfloat16(), value, rows, None)

    def packed(q, k, v, cu_seq_lens):
        kwargs = {attention.CU_SEQ_LENS: cu_seq_lens}
        return attention.varlen_attention_forward(None, q, k, v, None, **kwargs)[0]

    compiled = torch.compile(packed, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager_out = packed(query, key, value, cu)
        compiled_out = compiled(query, key, value, cu)
    for out in (eager_out, compiled_out):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected)
