"""Bytes per rank for each strategy: parameters, gradients, optimizer state, activations, and the peak.

Every number here is derived in docs/plan.md and checked against real training steps in
tests/plan/test_plan.py. All sizes are bytes; `c` is the compute dtype's size (2 under bf16/fp16
mixed precision, 4 in fp32), trainable weights and optimizer state are always fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

from phalanx.config.schema import UNMERGED_STRATEGIES, RunConfig
from phalanx.data.collate import merge_budget, passes_per_step
from phalanx.errors import ConfigError
from phalanx.models.compile import compile_wanted, liger_covers
from phalanx.models.graphs import GraphShapes
from phalanx.models.lora_fused import REDRAW_MASK_ON
from phalanx.parallel.deepspeed import reduce_bucket_elements
from phalanx.plan.model import ModelFacts
from phalanx.train.loss import CHUNK_LOGITS, chunk_rows

GiB = 2**30
FP32 = 4
# Memory a rank uses outside its tensors. CUDA: context, cuBLAS workspace and NCCL buffers, typically 0.5-1 GiB
# (an allowance, not measured by this project yet: benchmarks/plan_accuracy.py prints it on a GPU). CPU: the
# interpreter with torch and transformers loaded, peak RSS minus peak tensor bytes (measured, docs/plan.md).
OVERHEAD_BYTES = {"cuda": int(1.0 * GiB), "cpu": int(0.6 * GiB)}
# The CUDA caching allocator reserves more than the tensors it hands out (block rounding, fragmentation).
ALLOCATOR_SLACK = {"cuda": 0.10, "cpu": 0.0}
# DeepSpeed's defaults (deepspeed.runtime.zero.config) for the knobs phalanx leaves unset; the reduce bucket is
# sized by the strategy (reduce_bucket_elements).
DS_DEFAULTS = {
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


@dataclass(frozen=True)
class Strategy:
    """A row of the plan: how to ask for it, and what it costs in communication."""

    label: str
    flags: str
    comm: str


# Least communication first: one all-reduce's worth of traffic per step; then parameters gathered twice per step
# (1.5x); then host offload (PCIe copies and an optimizer step on the CPU, by far the slowest).
STRATEGIES = [
    Strategy("ddp", "--strategy ddp", "one all-reduce of gradients per step"),
    Strategy("fsdp NO_SHARD", "--strategy fsdp --sharding_strategy NO_SHARD", "one all-reduce of gradients per step"),
    Strategy(
        "ZeRO-1", "--strategy deepspeed --zero_stage 1", "all-reduce of gradients, all-gather of updated parameters"
    ),
    Strategy(
        "fsdp SHARD_GRAD_OP",
        "--strategy fsdp --sharding_strategy SHARD_GRAD_OP",
        "reduce-scatter of gradients, one all-gather of parameters per step",
    ),
    Strategy(
        "ZeRO-2", "--strategy deepspeed --zero_stage 2", "reduce-scatter of gradients, all-gather of updated parameters"
    ),
    Strategy(
        "fsdp FULL_SHARD",
        "--strategy fsdp --sharding_strategy FULL_SHARD",
        "reduce-scatter of gradients, two all-gathers of parameters per step",
    ),
    Strategy(
        "ZeRO-3",
        "--strategy deepspeed --zero_stage 3",
        "reduce-scatter of gradients, two all-gathers of parameters per step",
    ),
    Strategy(
        "ZeRO-2 +offload opt",
        "--strategy deepspeed --zero_stage 2 --offload_optimizer",
        "ZeRO-2's, plus the optimizer step on the host",
    ),
    Strategy(
        "ZeRO-3 +offload opt",
        "--strategy deepspeed --zero_stage 3 --offload_optimizer",
        "ZeRO-3's, plus the optimizer step on the host",
    ),
    Strategy(
        "fsdp FULL_SHARD +offload",
        "--strategy fsdp --sharding_strategy FULL_SHARD --offload_param",
        "FULL_SHARD's, plus host copies of every shard and the optimizer step on the host",
    ),
    Strategy(
        "ZeRO-3 +offload opt+param",
        "--strategy deepspeed --zero_stage 3 --offload_optimizer --offload_param",
        "ZeRO-3's, plus parameters fetched from the host and the optimizer step on the host",
    ),
]
BY_LABEL = {s.label: s for s in STRATEGIES}
SINGLE = Strategy("single process", "", "none")


@dataclass(frozen=True)
class Setup:
    """The run facts that decide bytes."""

    device: str  # "cuda" or "cpu"
    compute_bytes: int  # 2 under bf16/fp16 mixed precision, 4 in fp32
    batch: int  # sequences per micro-batch per rank
    seq: int  # data.max_length: the longest a padded micro-batch can be
    accumulation: int
    world: int
    finetune: str
    lora_dropout: float
    base_4bit_bytes: float = 0.0  # bytes per weight of a 4-bit base (QLoRA), 0 when the base is not quantized
    packing: bool = False  # data.packing: a micro-batch's rows concatenated, no padding (models that support it)
    # From the data, when plan read it: tokens and target positions of the largest micro-batch a rank can get (the
    # batch longest rows, the batch rows with the most targets). None: bounded by batch x max_length.
    data_tokens: Optional[int] = None
    data_targets: Optional[int] = None
    data_note: str = ""  # where the figures above come from, or why the data was not read
    token_budget: Optional[int] = None  # training.batch_tokens: packed micro-batches of at most this many tokens
    compiled: bool = False  # training.compile applies on this device (models/compile.py)
    # training.liger_kernels 'auto' with eager layers on CUDA: Liger's RMSNorm/SwiGLU kernels wherever
    # models/compile.py:liger_covers the model (installed here, a model type it patches)
    liger_kernels: bool = False
    merge_tokens: Optional[int] = None  # a step's micro-batches run as passes of at most this many tokens (merged)
    graph_shapes: Optional[GraphShapes] = None  # training.cuda_graphs: passes padded to fixed shapes

    @property
    def tokens(self) -> int:
        """Tokens of a padded micro-batch: every row as long as the longest, at most max_length."""
        return self.batch * self.seq

    @property
    def packed_tokens(self) -> int:
        """Tokens of the largest packed micro-batch: the sum of its rows' lengths (the data's, else the bound), at
        most the token budget when micro-batches are filled to one."""
        one = self.token_budget
        if one is None:
            one = min(self.data_tokens, self.tokens) if self.data_tokens is not None else self.tokens
        if self.merge_tokens is not None:  # merged passes (training.merge_micro_batches): up to a step's rows
            one = max(one, min(self.merge_tokens, one * self.accumulation))
        return self.graph_shapes.largest(one) if self.graph_shapes else one  # with its padding rows (models/graphs.py)

    def targets(self, tokens: int) -> int:
        """Positions that reach the output head: the data's count, else every position (an upper bound)."""
        return min(self.data_targets, tokens) if self.data_targets is not None else tokens


def setup_from_config(cfg: RunConfig, device: str) -> Setup:
    mp = cfg.training.mixed_precision
    if device == "cpu" and mp in ("fp16", "bf16"):
        raise ConfigError(
            f"training.mixed_precision = '{mp}' needs a CUDA device; plan with --device cuda, or use "
            "'auto' / 'no' for a CPU run"
        )
    compute = FP32 if device == "cpu" or mp == "no" else 2  # 'auto' on CUDA is bf16 (fp16 on old GPUs): 2 bytes
    four_bit = 0.0
    if getattr(cfg.model, "load_in_4bit", False):
        # 4 bits per weight and an fp32 scale per block of 64; double quantization stores the scales in 8 bits
        # with an fp32 scale per 256 of them.
        four_bit = 0.5 + (1 / 64 + 4 / (64 * 256) if cfg.model.bnb_4bit_use_double_quant else 4 / 64)
    merge = merge_budget(cfg, torch.device(device), cfg.data.packing)
    graphs = cfg.training.cuda_graphs and cfg.data.packing  # padded and compiled on any device, captured on CUDA
    # 'auto' compiles long runs (models/compile.py); the plan knows a run's length only from max_steps.
    compiled = graphs or compile_wanted(
        cfg.training.compile,
        torch.device(device),
        plain_lora=cfg.model.finetune == "lora" and not four_bit,
        packed=cfg.data.packing,
        strategy=cfg.distributed.strategy,
        micro_batches=(cfg.training.max_steps or 0) * passes_per_step(cfg, merge) or None,
    )
    return Setup(
        device=device,
        compute_bytes=compute,
        batch=cfg.training.batch_size,
        seq=cfg.data.max_length,
        accumulation=cfg.training.gradient_accumulation_steps,
        world=cfg.distributed.world_size,
        finetune=cfg.model.finetune,
        lora_dropout=cfg.lora.dropout,
        base_4bit_bytes=four_bit,
        packing=cfg.data.packing,
        token_budget=getattr(cfg.training, "batch_tokens", None),
        merge_tokens=merge,
        graph_shapes=GraphShapes.for_config(cfg, merge, pad_token_id=0) if graphs else None,
        compiled=compiled,
        liger_kernels=device == "cuda" and cfg.training.liger_kernels == "auto" and not compiled,
    )


# ------------------------------------------------------------------------------------------------ activations
@dataclass(frozen=True)
class Activations:
    saved: int  # what autograd keeps for backward, one micro-batch, whole model
    checkpointed: int  # the same with every decoder layer checkpointed (its input kept, one layer recomputed)
    logits: int  # the output head and loss at their largest (see loss_bytes), alive on top of `saved`
    # What the loss still holds once backward starts (its gradients), and what a checkpointed forward holds when the
    # loss runs (layer inputs only): with checkpointing, a layer is recomputed after the loss's chunks are gone.
    logits_kept: Optional[int] = None
    checkpointed_forward: int = 0

    @property
    def peak(self) -> int:
        return self.saved + self.logits

    @property
    def peak_checkpointed(self) -> int:
        if self.logits_kept is None:
            return self.checkpointed + self.logits
        return max(self.checkpointed_forward + self.logits, self.checkpointed + self.logits_kept)


def activation_bytes(m: ModelFacts, s: Setup, stream: int, compute: int) -> Activations:
    """Tensors a Llama-family decoder keeps for backward (docs/plan.md, "Activations").

    `stream`: bytes per element of the residual stream (the embedding output's dtype); `compute`: of
    linear outputs (the autocast dtype, else the weights'). RMSNorm computes in fp32; attention is
    flash/efficient SDPA, which keeps q, k, v, its output and a log-sum-exp, never seq x seq scores.

    Packed micro-batches (data.packing on a model that supports it) hold the sum of their rows' lengths in one
    row, with no mask and K/V at their own head count; padded ones hold batch x (longest row) tokens.
    """
    packed = s.packing and m.packable
    b, seq = s.batch, s.seq
    t = s.packed_tokens if packed else s.tokens
    h, i = m.hidden, m.intermediate
    nq, nkv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    logits, logits_kept = loss_bytes(m, s, compute, t)
    if not m.known_layout:  # 18 hidden-sized and 4 intermediate-sized tensors per token and layer
        layer = (18 * h + 4 * i) * compute * t
        return Activations(
            saved=layer * m.num_layers, checkpointed=m.num_layers * h * stream * t + layer, logits=logits
        )

    # Several rows per padded micro-batch: transformers then passes a mask, and SDPA converts it to an additive
    # mask in the query dtype per layer (kept for backward) and k/v heads are repeated to full size.
    padded = b > 1 and not packed
    dropout = s.lora_dropout > 0
    mask_bytes = 1 if s.device == "cuda" else stream  # fused CUDA dropout keeps a bool mask, CPU a scaled noise tensor
    trains, lora = m.trainable_linears, m.lora_ranks
    # phalanx's fused LoRA forward (models/lora_fused.py; a 4-bit base too) keeps the shared input once, in its
    # own dtype, and each adapter's r-wide x @ A^T; a dropout mask per adapter as bools on CPU, none on CUDA (eager
    # layers redraw it in backward; compiled ones are priced with none, below).
    fused = m.lora_fused
    # Liger's kernels (models/compile.py) keep less: its RMSNorm its input as it is (not an fp32 copy) and the rsqrt
    # per row, its SwiGLU gate and up only (act(gate) is recomputed in backward). Compiled layers on CUDA are priced
    # as lean, no masks either: their measured peak leaves no room for more (what inductor keeps was not inspected). On
    # an H200 this took the estimates of two measured LoRA steps from 1.20x (eager, Liger) and 1.43x (compiled) to
    # 0.97x and 1.02x the measured peaks (docs/plan.md, "Accuracy").
    liger = s.liger_kernels and liger_covers(torch.device(s.device), m.model_type)
    lean = liger or (s.compiled and s.device == "cuda")
    norm_input = stream if lean else FP32

    def rms_norm(dim: int, rows: int = 1) -> int:
        # x in fp32 (kept by pow), rsqrt per row, and x * rsqrt when the norm's weight trains (HF's RMSNorm).
        return norm_input * dim + FP32 * rows + (FP32 * dim if m.trainable_norms and not lean else 0)

    def linear_inputs(dim: int, roles: Sequence[str], kept_anyway: bool = False, x_bytes: int = stream) -> int:
        """The input shared by `roles`: kept if a weight trains or a LoRA A reads it; autocast casts it per linear."""
        out = 0
        if fused and any(r in lora for r in roles):
            if not kept_anyway:
                out += dim * x_bytes  # x itself, one tensor for every adapter that reads it
            adapters = [r for r in roles if r in lora]
            if dropout and s.device not in REDRAW_MASK_ON:
                # each adapter's dropout mask, as bools (on CUDA redrawn in backward, or from the seed when compiled)
                out += dim * len(adapters)
            return out + sum(lora[r] for r in adapters) * compute
        readers = [r for r in roles if r in trains or (r in lora and not dropout)]
        if readers and not kept_anyway:
            out += dim * compute * (len(readers) if stream != compute else 1)
        for r in roles:
            if r in lora:
                out += lora[r] * compute  # lora_A's output, kept by lora_B
                if dropout:
                    out += dim * stream + dim * mask_bytes  # each adapter's dropout output and mask
        return out

    kv = nq if padded else nkv
    attention = rms_norm(h) + linear_inputs(h, ("q", "k", "v"))
    if m.qk_norm:
        attention += rms_norm(nq, m.heads) + rms_norm(nkv, m.kv_heads)
    attention += (nq + 2 * kv) * compute  # rotated q, k and v as SDPA keeps them
    attention += nq * compute + FP32 * m.heads  # SDPA's output (o_proj's input too) and log-sum-exp
    attention += seq * compute if padded else 0  # the additive mask
    if packed and b > 1 and s.device == "cpu":
        attention += nq * compute  # CPU: one SDPA per row keeps its own output; o_proj reads their concatenation
    attention += linear_inputs(nq, ("o",), kept_anyway=True)
    mlp = rms_norm(h) + linear_inputs(h, ("gate", "up")) + (2 if lean else 3) * i * compute  # gate, up, act(gate)
    if "down" in trains or "down" in lora:
        mlp += linear_inputs(i, ("down",), x_bytes=compute)  # act(gate) * up
    per_layer = attention + mlp
    # Under LoRA the first layer's input comes from a frozen embedding: its norms keep no fp32 copy of it.
    first_layer = per_layer - (2 * norm_input * h if s.finetune == "lora" else 0)
    # A trainable plain head keeps its input; the target-only head keeps gradients instead (loss_bytes).
    final_norm = rms_norm(h) + (h * compute if m.head_trainable and not m.target_head else 0)
    # input ids, labels and position ids or a mask (int64), the boolean mask when padded; per target position its
    # flat index and label (int64, the collator's).
    shared = 3 * 8 + (seq if padded else 0)
    targets = 2 * 8 * s.targets(t)
    rope = 2 * (t if packed else seq) * m.head_dim * compute  # cos and sin per position of the (packed) row
    saved = (first_layer + per_layer * (m.num_layers - 1) + final_norm + shared) * t + targets + rope
    inputs = (m.num_layers * h * stream + final_norm + shared) * t + targets + rope
    return Activations(
        saved=saved,
        checkpointed=inputs + per_layer * t,
        logits=logits,
        logits_kept=logits_kept,
        checkpointed_forward=inputs,
    )


def loss_bytes(m: ModelFacts, s: Setup, compute: int, tokens: int) -> tuple[int, int]:
    """The output head and cross-entropy at their largest, on top of the saved activations (train/loss.py), and
    what of it backward still needs.

    Target-only head (model types whose logits are lm_head(hidden), an unadapted head): the hidden states at the
    N target positions are selected (N x hidden, compute dtype) and the loss runs in chunks of R = CHUNK_LOGITS /
    vocab positions: R x vocab fp32 logits turned into probabilities in place, plus their compute-dtype copy for
    the gradient matmuls (none in fp32), two chunks' worth when there are several (the loop still holds the last
    chunk's while it makes the next; measured on the 151,936 vocabulary, benchmarks/plan_accuracy.py). Each
    chunk's gradient with respect to the hidden states is what backward
    needs (N x hidden fp32, kept), and with respect to the head's weight when it trains (vocab x hidden fp32).
    No [tokens x vocab] tensor exists.

    Other models (full_logits_bytes): the model's logits at every position, those of the target positions
    selected, and one chunk's fp32 copy and log-softmax (each chunk is recomputed in backward, not kept)."""
    n = s.targets(tokens)
    if not m.target_head:
        return full_logits_bytes(m, compute, tokens, n), 0
    rows = min(n, chunk_rows(m.vocab, CHUNK_LOGITS))
    # A chunk's fp32 logits (probabilities in place) and, below fp32, the compute-dtype gradient copy. From the
    # second chunk on, the previous chunk's are still referenced while the next one's logits are made: two chunks.
    chunk = rows * m.vocab * (FP32 + (compute if compute != FP32 else 0)) * (2 if n > rows else 1)
    kept = n * m.hidden * FP32 + (m.vocab * m.hidden * FP32 if m.head_trainable else 0)
    return n * m.hidden * compute + chunk + kept, kept


def full_logits_bytes(m: ModelFacts, compute: int, tokens: int, targets: int) -> int:
    """The logits path: [tokens x vocab] logits, the targets' rows of them, one chunk's fp32 logits and log-softmax."""
    rows = min(targets, chunk_rows(m.vocab, CHUNK_LOGITS))
    return (tokens + targets) * m.vocab * compute + rows * m.vocab * 2 * FP32


# ------------------------------------------------------------------------------------------------ strategies
@dataclass
class Row:
    """One strategy's bytes per rank. `params` includes parameters gathered or cast for compute."""

    strategy: str
    flags: str
    comm: str
    params: int
    grads: int
    optimizer: int
    activations: int
    activations_ckpt: int
    peak: int
    peak_ckpt: int
    host: int = 0  # bytes per rank offloaded to host memory
    total: int = 0  # peak with allocator slack and fixed overhead: what must fit in device memory
    total_ckpt: int = 0
    fits: bool = False
    fits_ckpt: bool = False
    detail: dict = field(default_factory=dict)


def _shard(n: int, world: int) -> int:
    return math.ceil(n / world)


def strategy_rows(m: ModelFacts, s: Setup, *, device_memory: int, ds_config: Optional[dict] = None) -> list[Row]:
    """Every strategy phalanx offers, least communication first (on one rank only offloading saves anything, but
    every row is listed: a config may ask for any of them)."""
    n, c = s.world, s.compute_bytes
    T, P = m.trainable_params, m.total_params
    lora, mixed = s.finetune == "lora", c != FP32
    rows: list[Row] = []

    def scratch(trainable: int, largest: int) -> int:
        # AdamW's temporaries at step(): phalanx uses the fused kernel on CUDA (none); torch's for-loop version on
        # CPU holds two of one tensor at a time.
        return 2 * largest * FP32 if s.device == "cpu" else 0

    # DDP: a full replica. LoRA's frozen base is loaded in the compute dtype; what trains is fp32, and under autocast
    # its bf16 copies are cached for the forward and kept for backward (LoRA's A and B: kept between steps too,
    # models/lora_fused.KeptCasts; compiled layers hold theirs from forward to backward). DDP's gradients are views into its all-reduce
    # buckets (gradient_as_bucket_view), which stay allocated between steps: one copy of the grads, always kept.
    act = activation_bytes(m, s, stream=c if (lora and mixed) else FP32, compute=c)
    buckets = T * FP32 if n > 1 else 0
    frozen = m.frozen_params * (c if lora else FP32)
    if s.base_4bit_bytes:  # QLoRA: the decoder layers' linear weights in 4 bits, the rest of the base as loaded
        frozen = int(m.quantizable_params * s.base_4bit_bytes) + (m.frozen_params - m.quantizable_params) * c
    rows.append(
        _row(
            BY_LABEL["ddp"] if n > 1 else SINGLE,
            s,
            act,
            params=frozen + T * FP32,
            optimizer=2 * T * FP32,
            grads=T * FP32,
            grads_kept=buckets,
            working=T * c if mixed else 0,
            scratch=scratch(T, m.largest_trainable),
        )
    )

    # FSDP2: shards of what trains in fp32; a LoRA base stays in the compute dtype it was loaded in (parallel/fsdp.py).
    # The mixed-precision policy gathers units in the compute dtype. One unit per decoder layer plus the root
    # (embeddings, norm, head), which stays gathered through backward.
    fsdp_act = activation_bytes(m, s, stream=c, compute=c)
    unit, root = m.layer_params, m.root_params
    unit_grads = m.layer_trainable * (c + FP32)  # a unit's unsharded gradients and the fp32 reduce-scatter input
    fsdp_frozen = m.frozen_params * (c if lora else FP32)  # bytes of the frozen base, before sharding
    for label, div, gathered in (
        ("fsdp NO_SHARD", 1, P * c),  # a gathered copy of everything, kept from forward to the end of backward
        ("fsdp SHARD_GRAD_OP", n, (root + m.num_layers * unit) * c),  # every layer stays gathered until backward
        ("fsdp FULL_SHARD", n, (root + 2 * unit) * c),  # the running layer and the prefetched one
    ):
        rows.append(
            _row(
                BY_LABEL[label],
                s,
                fsdp_act,
                params=_shard(fsdp_frozen, div) + _shard(T, div) * FP32,
                working=gathered + unit_grads,
                grads=_shard(T, div) * FP32,
                grads_kept=0,
                optimizer=2 * _shard(T, div) * FP32,
                scratch=scratch(_shard(T, div), _shard(m.largest_trainable, div)),
            )
        )
    # CPU offload: shards, gradients and the optimizer step live on the host; the device holds what is gathered.
    rows.append(
        _row(
            BY_LABEL["fsdp FULL_SHARD +offload"],
            s,
            fsdp_act,
            params=0,
            working=(root + 2 * unit) * c + unit_grads,
            grads=0,
            grads_kept=0,
            optimizer=0,
            scratch=0,
            host=_shard(fsdp_frozen, n) + 4 * _shard(T, n) * FP32,
        )
    )

    knobs = _ds_knobs(ds_config, m.trainable_params)
    # A strategy that never merges micro-batches (UNMERGED_STRATEGIES: DeepSpeed) prices one micro-batch's pass.
    ds_setup = replace(s, merge_tokens=None) if "deepspeed" in UNMERGED_STRATEGIES else s
    ds_act = activation_bytes(m, ds_setup, stream=c, compute=c)
    for stage, off_opt, off_param in (
        (1, False, False),
        (2, False, False),
        (3, False, False),
        (2, True, False),
        (3, True, False),
        (3, True, True),
    ):
        rows.append(_zero_row(stage, off_opt, off_param, m, s, ds_act, knobs))

    for row in rows:
        slack, overhead = ALLOCATOR_SLACK[s.device], OVERHEAD_BYTES[s.device]
        row.total = int(row.peak * (1 + slack)) + overhead
        row.total_ckpt = int(row.peak_ckpt * (1 + slack)) + overhead
        row.fits, row.fits_ckpt = row.total <= device_memory, row.total_ckpt <= device_memory
    return rows


def _ds_knobs(ds_config: Optional[dict], trainable: int) -> dict[str, int]:
    """DeepSpeed's bucket sizes in elements: the user's JSON where it gives numbers ("auto" means the default), and
    the reduce bucket the strategy gives the engine."""
    zero = (ds_config or {}).get("zero_optimization") or {}
    out = {"reduce_bucket_size": reduce_bucket_elements(ds_config or {}, trainable)}
    for key, default in DS_DEFAULTS.items():
        value = zero.get(key, default)
        out[key] = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
    return out


def zero_label(stage: int, off_opt: bool, off_param: bool) -> str:
    """A ZeRO row's name: the table's rows and the one a config runs as (plan.fit.configured_strategy)."""
    return f"ZeRO-{stage}" + (" +offload opt" if off_opt else "") + ("+param" if off_param else "")


def _zero_row(
    stage: int, off_opt: bool, off_param: bool, m: ModelFacts, s: Setup, act: Activations, knobs: dict[str, int]
) -> Row:
    """DeepSpeed ZeRO: the model in the compute dtype, an fp32 master copy of the rank's partition of what trains,
    AdamW on that copy, and a reduce bucket of reduce_bucket_size elements allocated whole (reduce_bucket_elements)."""
    n, c, T, P = s.world, s.compute_bytes, m.trainable_params, m.total_params
    label = zero_label(stage, off_opt, off_param)
    part = _shard(T, n)
    master, moments = part * FP32, 2 * part * FP32
    bucket = knobs["reduce_bucket_size"] * (FP32 if stage == 1 else c)  # ZeRO-1 accumulates in fp32
    fp32_grads = part * FP32 if c != FP32 else 0  # the partition's gradient cast for the fp32 step
    small, working = 0, 0
    if stage == 3:
        # Parameters up to the persistence threshold stay whole on every rank; the rest are partitioned and gathered
        # ahead of use up to the prefetch bucket (so a small model is gathered whole), plus the all-gather's buffer.
        small = sum(k for k in m.param_sizes if k <= knobs["stage3_param_persistence_threshold"])
        params = (small + _shard(P - small, n)) * c
        biggest_unit = max(m.layer_params, m.root_params)  # the embedding is gathered too, whole
        working = 2 * min(P - small, knobs["stage3_prefetch_bucket_size"] + biggest_unit) * c
    else:
        params = P * c
    grads_kept = bucket + (part * c if stage == 3 else 0)  # ZeRO-3 keeps the partition's gradients in a flat buffer
    grads = bucket + part * c + fp32_grads
    # DeepSpeed gets the unfused AdamW (foreach on CUDA), over one flat fp32 partition.
    scratch = 2 * part * FP32 if s.device == "cpu" else part * FP32
    host = 0
    if off_opt:
        host += master + moments + part * FP32
        master = moments = scratch = 0
        grads -= fp32_grads
    if off_param:
        host += params - small * c
        params = small * c
    return _row(
        BY_LABEL[label],
        s,
        act,
        params=params + master,
        working=working,
        grads=grads,
        grads_kept=grads_kept,
        optimizer=moments,
        scratch=scratch,
        host=host,
        detail={"fp32_master": master, "reduce_bucket": bucket},
    )


def _row(
    strategy: Strategy,
    s: Setup,
    act: Activations,
    *,
    params: int,
    working: int,
    grads: int,
    grads_kept: int,
    optimizer: int,
    scratch: int,
    host: int = 0,
    detail: Optional[dict] = None,
) -> Row:
    """The peak of a training step (docs/plan.md, "Peak"). Activations are largest when backward starts, gradients
    when it ends, so the peak is the larger of the two moments, not their sum:

        forward/backward = params + working + optimizer + grads kept between steps (all grads when accumulating)
                           + activations
        optimizer step   = params + optimizer + grads + optimizer scratch
    """
    kept = grads if s.accumulation > 1 else grads_kept

    def peak(activations: int) -> int:
        return max(params + working + optimizer + kept + activations, params + optimizer + grads + scratch)

    return Row(
        strategy=strategy.label,
        flags=strategy.flags,
        comm=strategy.comm,
        params=params + working,
        grads=grads,
        optimizer=optimizer,
        activations=act.peak,
        activations_ckpt=act.peak_checkpointed,
        peak=peak(act.peak),
        peak_ckpt=peak(act.peak_checkpointed),
        host=host,
        detail={
            "resident_params": params,
            "working_params": working,
            "grads_kept": grads_kept,
            "optimizer_scratch": scratch,
            "activations_saved": act.saved,
            "activations_checkpointed": act.checkpointed,
            "logits": act.logits,
            **(detail or {}),
        },
    )
