"""CUDA graphs over the compiled decoder layers (training.cuda_graphs).

Why: a LoRA step at the seeds' batch 4 on an H100 is bound by the host launching kernels, compiled or not (device
busy 44% of a compiled step, ~3,900 launches; benchmarks/RESULTS.md 2026-11-27 06:00). A CUDA graph replays a
layer's kernels with one launch. Inductor captures them (its CUDA-graph trees, what torch.compile's
'reduce-overhead' turns on): one graph per compiled layer, forward and backward, for each micro-batch shape.

Measured (benchmarks/RESULTS.md, 2026-11-28 03:16, an H200, batch 4): slower than what it was to speed up. The first
logged step came 112 s after launch and the run then made 9,966 tokens/s, against 13,378 eager and 24,522-26,301 for
compiled layers without graphs. Inductor split each layer's forward at a small tensor built on the CPU and copied to
the GPU (not diagnosed further). So the flag stays off by default and is an experiment (gpu_suite.sh graphs).

Packed micro-batches change length every step, and a graph is captured for every new shape, so `GraphShapes` pads
each one to a few shapes: its tokens up to a multiple of `token_step` and its rows up to `row_slots`, with rows of
padding (data/collate.py:pad_packed) that hold no target and, being rows of their own in the row ends the attention
reads, are attended to by no real row. The loss, its normalisation and the gradients are the unpadded micro-batch's
(tests/models/test_graphs.py); the throughput counts real tokens only.

Two rules come with captured graphs. A pass's outputs live in the graphs' memory until the next pass replays over
it, so each pass starts with `begin_pass` (torch.compiler.cudagraph_mark_step_begin). And a gradient summed over
several passes of one step must not live there, so with more than one pass per step the trained parameters' .grad
are allocated once and zeroed in place after each step, not freed (Strategy.keep_gradient_buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from phalanx.config.schema import RunConfig
from phalanx.data.collate import micro_batch_bound, pad_packed

# Shapes per token bound: the token step is the bound over this (rounded up to TOKEN_ALIGN), so a run captures at
# most this many token counts for each row count. Fewer shapes capture sooner; more waste less compute on padding
# (on average half a step per micro-batch: about 290 of ~3,800 tokens at the seeds' batch 4, a step of 576, where the
# device is idle half of the step anyway).
SHAPES_PER_BOUND = 16
TOKEN_ALIGN = 64


@dataclass(frozen=True)
class GraphShapes:
    """The fixed shapes packed micro-batches are padded to before they reach graphed layers."""

    token_step: int  # a micro-batch's tokens are padded up to a multiple of this
    row_slots: int  # ... and its rows up to this many (or the next power of two above its rows, when it has more)
    pad_token_id: int

    @classmethod
    def for_run(cls, token_bound: int, row_bound: Optional[int], pad_token_id: int) -> "GraphShapes":
        """`token_bound`: the most tokens one pass holds; `row_bound`: the most rows one micro-batch holds (batch_size),
        or None where a token budget packs any number."""
        slots = (row_bound or 1) + 1
        step = -(-(token_bound + slots) // SHAPES_PER_BOUND)  # a full micro-batch and its padding rows fit 16 steps
        step = -(-step // TOKEN_ALIGN) * TOKEN_ALIGN
        return cls(token_step=step, row_slots=slots, pad_token_id=pad_token_id)

    @classmethod
    def for_config(cls, cfg: RunConfig, merge_tokens: Optional[int], pad_token_id: int) -> "GraphShapes":
        """The shapes of a run's passes: its token bound (a merged pass's, else a micro-batch's), and its rows where
        batch_size bounds them (training and evaluation batches), not where a token budget or a merge packs any
        number."""
        t = cfg.training
        rows = None if (t.batch_tokens or merge_tokens) else max(t.batch_size, cfg.eval.eval_batch_size or 0)
        return cls.for_run(merge_tokens or micro_batch_bound(cfg), rows, pad_token_id)

    def largest(self, tokens: int) -> int:
        """Tokens of the largest padded pass over passes of at most `tokens` tokens in fewer than row_slots rows."""
        return self.shape(tokens, self.row_slots - 1)[0]

    def shape(self, tokens: int, rows: int) -> tuple[int, int]:
        """(tokens, rows) a micro-batch of `tokens` tokens in `rows` rows is padded to: at least one padding row, and
        a token for each."""
        slots = self.row_slots if rows < self.row_slots else 1 << rows.bit_length()  # a power of two above `rows`
        total = tokens + (slots - rows)
        return -(-total // self.token_step) * self.token_step, slots

    def pad(self, batch: dict) -> dict:
        """`batch` padded to its shape; a padded (not packed) batch is returned as it is."""
        if batch.get("row_lengths") is None:
            return batch
        tokens, rows = self.shape(batch["input_ids"].shape[1], len(batch["row_lengths"]))
        return pad_packed(batch, tokens, rows, self.pad_token_id)

    def describe(self) -> str:
        return (
            f"packed micro-batches padded to a multiple of {self.token_step:,} tokens in {self.row_slots} rows "
            f"(padding rows hold no targets; one graph per layer and shape, captured at its first use)"
        )

    @staticmethod
    def begin_pass() -> None:
        """A forward/backward pass starts: the last pass's outputs in the graphs' memory may be replayed over."""
        torch.compiler.cudagraph_mark_step_begin()


def graph_skips() -> int:
    """Compiled graphs inductor ran without capturing a CUDA graph (TORCH_LOGS=cudagraphs says why)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def say_graph_skips(device: torch.device, say: Callable[[str], None]) -> None:
    """After the first step (whose passes compiled and captured the layers): say so if a graph was not captured on
    CUDA, where the run asked for graphs and would silently launch kernel by kernel instead."""
    skipped = graph_skips()
    if device.type == "cuda" and skipped:
        say(
            f"⚠️  training.cuda_graphs: {skipped} compiled graph(s) run without a CUDA graph (kernels launched one by "
            "one); TORCH_LOGS=cudagraphs says why."
        )
