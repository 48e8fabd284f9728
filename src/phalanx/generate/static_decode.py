"""Decoding over a KV cache of fixed size, so that on CUDA a decoding step is one CUDA graph replay.

A decoding step of a 1.5B model at a few dozen rows is a few milliseconds of GPU work (by estimate:
its weights and KV cache read once) behind several hundred kernel launches, each issued by Python
through transformers' modules. On an H100 the growing-cache loop (engine.py) took about 131 ms per
step (not profiled; the host's launches are the likely rest). Here every tensor a step touches has a
fixed shape and address:

- the cache is preallocated, [rows, kv_heads, capacity, head_dim] per layer, each prompt's prefill
  copied in right-aligned at `longest` (the padding before a short prompt is masked out), and step s
  writes position `longest + s` of every row (one index tensor on the device, advanced in place);
- the attention mask is a prepared [rows, 1, 1, capacity] tensor (transformers passes a 4-D mask
  through untouched), opened one position per step, in place;
- rows that finish stay in the batch (their tokens are ignored afterwards) and the tokens and stop
  flags stay on the device: the host looks at them every CHECK_EVERY steps, not after every step.

The same step runs eagerly on CPU (the tests compare it token for token with the growing-cache loop)
and is captured as a CUDA graph on CUDA, checked against the eager step, and kept for the later
batches that fit in its cache (StaticDecoder). Models this cannot serve (a sliding window shorter
than prompt + answer, linear-attention layers, an attention other than sdpa/eager) are named by
`kv_cache.fixed_cache_problem`.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import torch
from transformers import DynamicCache

from phalanx.errors import ConfigError
from phalanx.generate.kv_cache import FixedLayer, cache_keyword, fixed_cache_problem, inner_model, sliding_window_of
from phalanx.generate.sampling import SamplingParams, next_tokens

# How many decoding steps run between two looks at the stop flags (each look waits for the device).
CHECK_EVERY = 8
# Cache capacities are rounded up to this, so batches of similar prompt lengths reuse one captured graph.
CAPACITY_STEP = 256


class _Batch:
    """Every tensor one batch shape decodes with, and the step (captured as a CUDA graph where there is one)."""

    def __init__(self, model, rows: int, capacity: int, layer_shapes: list[tuple[torch.Size, torch.Size]], dtype):
        device = next(model.parameters()).device
        self.model, self.rows, self.capacity, self.device = model, rows, capacity, device
        self.index = torch.zeros(1, dtype=torch.long, device=device)
        self.keys = [torch.zeros((rows, k[1], capacity, k[3]), dtype=dtype, device=device) for k, _ in layer_shapes]
        self.values = [torch.zeros((rows, v[1], capacity, v[3]), dtype=dtype, device=device) for _, v in layer_shapes]
        config = inner_model(model).config
        self.cache = DynamicCache(config=config)
        self.cache.layers = [FixedLayer(k, v, self.index) for k, v in zip(self.keys, self.values)]
        self.input_ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.position_ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        # sdpa takes a boolean mask (True = attend); eager attention adds the mask to its scores.
        if config._attn_implementation == "sdpa":
            self.mask = torch.zeros((rows, 1, 1, capacity), dtype=torch.bool, device=device)
            self.open, self.shut = True, False
        else:
            self.mask = torch.full((rows, 1, 1, capacity), torch.finfo(dtype).min, dtype=dtype, device=device)
            self.open, self.shut = 0.0, torch.finfo(dtype).min
        self.cache_keyword = cache_keyword(model)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None

    def step(self) -> torch.Tensor:
        """One decoding step from `input_ids`: open the written position, run the model, advance. Logits [rows, vocab]."""
        self.mask.index_fill_(-1, self.index, self.open)
        out = self.model(
            input_ids=self.input_ids,
            attention_mask=self.mask,
            position_ids=self.position_ids,
            use_cache=True,
            **{self.cache_keyword: self.cache},
        )
        self.index.add_(1)
        self.position_ids.add_(1)
        return out.logits[:, -1]

    def capture(self, warn: Callable[[str], None]) -> None:
        """Record the step as a CUDA graph (after two eager runs on a side stream, which set up cuBLAS workspaces
        and lazy state, as capture requires), then check that replays compute what the eager step computes. Any
        failure leaves the eager step, which is always correct. What these runs write is overwritten by `load`."""
        try:
            with torch.cuda.device(self.device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self.step()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    logits = self.step()
        except Exception as exc:  # noqa: BLE001 - whatever the model does that a graph cannot hold
            warn(f"⚠️  CUDA graph capture of the decoding step failed ({type(exc).__name__}: {exc}); decoding eagerly")
            return
        self.graph, self.logits = graph, logits
        try:
            problem = self.replay_problem()
        except Exception as exc:  # noqa: BLE001 - a graph that cannot even be replayed is not used
            problem = f"could not be replayed ({type(exc).__name__}: {exc})"
        if problem:
            self.graph, self.logits = None, None
            warn(f"⚠️  the CUDA graph of the decoding step {problem}; decoding eagerly")

    def replay_problem(self) -> Optional[str]:
        """None when two replays from a reset state give the logits of two eager steps from it, else what differs.

        Two steps, because a value the graph froze at capture (a position read on the host, say) shows only once the
        state has moved on from where it was captured."""
        runs = []
        for replay in (False, True):
            self.index.zero_()
            self.position_ids.zero_()
            self.mask.fill_(self.shut)
            logits = []
            for token in (1, 2):  # two different tokens: with equal ones, attention averages equal values
                self.input_ids.fill_(token)
                logits.append((self.run_step() if replay else self.step()).float().clone())
            runs.append(logits)
        for step, (eager, replayed) in enumerate(zip(*runs), start=1):
            gap = (eager - replayed).abs().max().item()
            largest = eager.abs().max().item()
            if not gap <= 1e-2 * max(largest, 1.0):  # also catches NaN
                return f"gave other logits than the eager step at step {step} (largest gap {gap:.3g}, largest logit {largest:.3g})"
        return None

    def run_step(self) -> torch.Tensor:
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.logits  # type: ignore[return-value]

    def load(self, prompt_states: list[list[tuple[torch.Tensor, torch.Tensor]]], row_prompt: Sequence[int]) -> int:
        """Lay each row's prompt keys/values right-aligned at `longest`, open its positions; returns `longest`."""
        lengths = [states[0][0].shape[-2] for states in prompt_states]
        longest = max(lengths)
        for buffer in (*self.keys, *self.values):
            buffer.zero_()  # stale values are masked, but must be finite (0 x NaN is NaN)
        self.mask.fill_(self.shut)
        rows_of: dict[int, list[int]] = {}
        for row, prompt in enumerate(row_prompt):
            rows_of.setdefault(prompt, []).append(row)
        for prompt, rows in rows_of.items():
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            start = longest - lengths[prompt]
            for layer, (k, v) in enumerate(prompt_states[prompt]):
                self.keys[layer][index, :, start:longest] = k
                self.values[layer][index, :, start:longest] = v
            self.mask[index, :, :, start:longest] = self.open
        self.position_ids.copy_(
            torch.tensor([[lengths[p]] for p in row_prompt], dtype=torch.long).to(self.device, non_blocking=True)
        )
        self.index.fill_(longest)
        return longest


class StaticDecoder:
    """Decodes batches over fixed-size caches, keeping the last one (and its graph) for the batches that follow.

    `rows` and `capacity` (a job's batch size, and its longest prompt plus max_new_tokens) make every batch of a job
    decode over a cache of that one shape, whichever batches came before: in bf16 a kernel's rounding can depend on
    its sizes (the number of rows a GEMM gets, the key length an attention splits), so a shape that followed the
    batch history would let a resumed job draw other tokens than an uninterrupted one. Fewer rows are padded with
    copies of the first and thrown away; a graph replay pays for them anyway, and it is captured once.

    Without them each batch gets a cache of its own size, kept (with its graph) for a next batch of that size.
    `graphs`: capture the step as a CUDA graph (only on CUDA)."""

    def __init__(
        self,
        graphs: bool = True,
        warn: Callable[[str], None] = lambda message: warnings.warn(message, stacklevel=2),
        rows: Optional[int] = None,
        capacity: Optional[int] = None,
    ):
        self.graphs = graphs
        self.warn = warn
        self.rows, self.capacity = rows, capacity
        self._batch: Optional[_Batch] = None

    def release(self, rows: Optional[int] = None) -> None:
        """Drop the kept cache and graph: after an out-of-memory error, the batches that follow have `rows` rows."""
        self._batch = None
        if self.rows is not None and rows is not None:
            self.rows = rows

    def _batch_for(self, model, rows: int, needed: int, prompt_states) -> _Batch:
        first = prompt_states[0]
        dtype = first[0][0].dtype
        rows = max(rows, self.rows or 0)
        capacity = -(-max(needed, self.capacity or 0) // CAPACITY_STEP) * CAPACITY_STEP
        window = sliding_window_of(inner_model(model).config)
        if window is not None:  # every position must stay inside the window, where attention is the full one
            if needed > window:
                raise ValueError(
                    f"a fixed cache of {needed} positions does not fit the model's sliding window {window}"
                )
            capacity = min(capacity, window)
        batch = self._batch
        shape = (rows, capacity, dtype)
        if batch is None or batch.model is not model or (batch.rows, batch.capacity, batch.keys[0].dtype) != shape:
            self._batch = None  # the old graph and cache go before the new ones are allocated
            batch = _Batch(model, rows, capacity, [(k.shape, v.shape) for k, v in first], dtype)
            if self.graphs and batch.device.type == "cuda":
                batch.capture(self.warn)
            self._batch = batch
        return batch

    def decode(
        self,
        model,
        first_logits: torch.Tensor,
        prompt_states: list[list[tuple[torch.Tensor, torch.Tensor]]],
        row_prompt: Sequence[int],
        uniforms: torch.Tensor,
        params: SamplingParams,
        stops: torch.Tensor,
        vocab_limit: Optional[int],
    ) -> tuple[list[list[int]], int]:
        """Tokens [rows][steps] drawn from `first_logits` (each row's prompt's last logits) onwards, and the steps run.

        Decoding ends after max_new_tokens steps, or at the first look at the stop flags that finds every row
        stopped; a row's tokens after its first stop token are not its own (the caller cuts them)."""
        rows = len(row_prompt)
        longest = max(states[0][0].shape[-2] for states in prompt_states)
        batch = self._batch_for(model, rows, longest + params.max_new_tokens, prompt_states)
        padding = batch.rows - rows  # rows that repeat the first one, drawn and thrown away
        if padding:
            row_prompt = [*row_prompt, *[row_prompt[0]] * padding]
            first_logits = torch.cat([first_logits, first_logits[:1].expand(padding, -1)])
            uniforms = torch.cat([uniforms, uniforms[:1].expand(padding, -1)])
        batch.load(prompt_states, row_prompt)
        device = batch.device
        drawn = torch.empty((batch.rows, params.max_new_tokens), dtype=torch.long, device=device)
        stopped = torch.zeros(batch.rows, dtype=torch.bool, device=device)
        stopped[rows:] = True
        logits = first_logits
        steps = 0
        for step in range(params.max_new_tokens):
            chosen = next_tokens(logits, uniforms[:, step], params, vocab_limit)
            drawn[:, step] = chosen
            steps = step + 1
            if steps == params.max_new_tokens:
                break
            stopped |= torch.isin(chosen, stops)
            if steps % CHECK_EVERY == 0 and bool(stopped.all()):
                break
            batch.input_ids.copy_(chosen.unsqueeze(-1))
            logits = batch.run_step()
        return drawn[:rows, :steps].tolist(), steps


KV_CACHES = ("auto", "fixed", "growing")


def choose_decoder(
    kv_cache: str,
    model: torch.nn.Module,
    flag: str = "--kv_cache",
    warn: Optional[Callable[[str], None]] = None,
    rows: Optional[int] = None,
    capacity: Optional[int] = None,
) -> Optional[StaticDecoder]:
    """The decoder `kv_cache` asks for: a StaticDecoder for "fixed" (of `rows` x `capacity` for every batch, when
    given), None (the growing cache) for "growing"; "auto" is fixed on CUDA where the model allows it (the step is
    bound by launching kernels there, which a graph removes) and growing on CPU (where finished rows leaving the
    batch saves real compute)."""
    if kv_cache not in KV_CACHES:
        raise ConfigError(f"{flag} {kv_cache!r}: expected one of {', '.join(KV_CACHES)}")
    if kv_cache == "growing":
        return None
    problem = fixed_cache_problem(model, capacity)
    if kv_cache == "fixed" and problem:
        raise ConfigError(f"{flag} fixed: this model cannot decode over a fixed-size cache: {problem}; use growing")
    on_cuda = next(model.parameters()).device.type == "cuda"
    if problem or (kv_cache == "auto" and not on_cuda):
        return None
    return StaticDecoder(graphs=True, rows=rows, capacity=capacity, **({"warn": warn} if warn else {}))
