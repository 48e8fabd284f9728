"""Sampling that depends on nothing but the row: per-(prompt, sequence) random streams and row-wise filters.

Every generated sequence owns a random stream seeded from (seed, prompt id, sequence index). Its
uniforms are drawn up front, one per new token, on the CPU, so which rows share a batch, how
many ranks there are and which device runs the model do not change what a row draws. Sampling
itself is inverse-CDF on the filtered distribution: token t is the first one whose cumulative
probability exceeds the row's t-th uniform. Temperature, top-k and top-p act on each row alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.7  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    seed: int = 42

    def as_dict(self) -> dict:
        return asdict(self)


def row_seed(seed: int, prompt_id: int, sequence_index: int) -> int:
    """A 63-bit seed for one (prompt, sequence) pair; a hash, so neighbouring pairs get unrelated streams."""
    digest = hashlib.blake2b(f"phalanx-generate:{seed}:{prompt_id}:{sequence_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def row_uniforms(pairs: list[tuple[int, int]], params: SamplingParams) -> torch.Tensor:
    """[rows, max_new_tokens] uniforms in [0, 1): row i is the stream of pairs[i] = (prompt id, sequence index)."""
    out = torch.empty(len(pairs), params.max_new_tokens, dtype=torch.float64)
    generator = torch.Generator(device="cpu")
    for i, (prompt_id, sequence_index) in enumerate(pairs):
        generator.manual_seed(row_seed(params.seed, prompt_id, sequence_index))
        out[i] = torch.rand(params.max_new_tokens, generator=generator, dtype=torch.float64)
    return out


def next_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams, vocab_limit: int | None = None
) -> torch.Tensor:
    """One token per row from [rows, vocab] logits and [rows] uniforms (float64, on any device).

    Only ids below `vocab_limit` are drawn: embedding tables are often padded past the tokenizer's
    vocabulary, and an id the tokenizer does not know cannot be written out.
    """
    logits = logits[:, :vocab_limit].float()
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the first one always stays).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) > params.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniforms.to(cdf.device).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=vocab - 1)
