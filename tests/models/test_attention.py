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
