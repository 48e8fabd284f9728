"""The torch varlen_attn self-check (models/attention.py): trusted only after it equals the per-row path, and a
refusal is said once with its reason (CPU has no flash kernel, so CPU tensors exercise the refusal)."""

import torch

from phalanx.models import attention


def _heads(kv_heads: int = 2):
    return torch.randn(1, 4, 12, 8), torch.randn(1, kv_heads, 12, 8)


def test_refused_kernel_is_said_once_with_its_reason(monkeypatch, capsys):
    monkeypatch.setattr(attention, "_torch_varlen_ok", {})
    query, key = _heads()
    assert attention._torch_varlen_usable(None, query, key) is False
    assert attention._torch_varlen_usable(None, query, key) is False
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("🧮 torch varlen_attn is not used (") and "one SDPA call each" in lines[0]


def test_kernel_that_disagrees_is_refused_and_one_that_agrees_is_trusted(monkeypatch, capsys):
    monkeypatch.setattr(attention, "_torch_varlen_ok", {})
    query, key = _heads(kv_heads=4)  # the per-row reference needs the attention module for grouped heads
    monkeypatch.setattr(
        attention, "_torch_varlen", lambda m, q, k, v, rows, s: attention._per_row_sdpa(m, q, k, v, rows, s) + 1.0
    )
    assert attention._torch_varlen_usable(None, query, key) is False
    assert "differs from the per-row path by 1.0e+00" in capsys.readouterr().out

    monkeypatch.setattr(attention, "_torch_varlen_ok", {})
    monkeypatch.setattr(attention, "_torch_varlen", attention._per_row_sdpa)
    assert attention._torch_varlen_usable(None, query, key) is True
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
