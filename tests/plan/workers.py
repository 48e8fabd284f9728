"""Measured peaks for the plan's accuracy tests: real phalanx training steps, in fresh processes, per rank.

"Measured peak" is the largest sum of live tensor storage bytes in a rank during its training steps,
counted by `TensorMemoryTracker` (every tensor any operator returns, the model's parameters and
buffers, each storage once, until it is freed): what `torch.cuda.max_memory_allocated` reports on a
GPU, here on CPU.
"""

import gc
import json
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

# The "small" model of the tests: 12.7M parameters, so weights, gradients and AdamW state outweigh activations.
SMALL = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)


def write_model(folder: Path, vocab_size: int = 264, **shape) -> Path:
    """A randomly initialised Qwen3 with the embedded byte tokenizer, saved like any local model. A `vocab_size` above
    the tokenizer's 264 gives the output head a real model's weight (those ids are never read)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from phalanx.models.presets import build_embedded_tokenizer

    tokenizer = build_embedded_tokenizer()
    config = Qwen3Config(
        vocab_size=vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **shape,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_rows(path: Path, rows: int, max_length: int, margin: int = 1) -> Path:
    """Plain-text rows `margin` to `margin`+2 tokens short of max_length (byte-level tokenizers): every micro-batch
    is padded (a mask is built) and as long as the plan assumes, give or take two tokens."""
    text = "lorem ipsum dolor sit amet " * (max_length // 20 + 1)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps({"text": f"row {i} {text}"[: max_length - margin - i % 3]}) + "\n")
    return path


def measure_run(overrides: dict) -> dict:
    """Peak live tensor bytes of this rank over a few optimizer steps of `phalanx train` as configured."""
    from phalanx.config.loader import load_config
    from phalanx.observe.tensor_memory import TensorMemoryTracker
    from phalanx.runtime.dist import shutdown
    from phalanx.train.loop import train
    from phalanx.train.run import build_run

    cfg = load_config(None, overrides)
    # Tracking from before the run is built sees what strategies allocate at set-up (DDP's gradient buckets).
    with TensorMemoryTracker() as tracker:
        run = build_run(cfg)
        tracker.track_module(run.strategy.unwrap())
        gc.collect()
        tracker.reset_peak()
        train(run)
    result = {"peak": tracker.peak, "peak_op": tracker.peak_op}
    del run
    shutdown()
    return result


def _worker(rank: int, world: int, runs: list, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        from phalanx.runtime.quiet import quiet_libraries

        quiet_libraries()
        results = []
        for overrides, port in runs:
            os.environ["MASTER_PORT"] = str(port)
            results.append(measure_run(overrides))
        queue.put((rank, results))
    except BaseException:
        queue.put((rank, "ERROR " + traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(runs: list[dict], world: int = 1, timeout: float = 300) -> list[list[dict]]:
    """Train each config of `runs` in turn on `world` fresh gloo ranks; returns [run][rank] -> {"peak", "peak_op"}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    plan = [(overrides, _free_port()) for overrides in runs]
    procs = [ctx.Process(target=_worker, args=(rank, world, plan, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        answers = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, answer in answers.items():
        if isinstance(answer, str):
            raise AssertionError(f"rank {rank} failed:\n{answer}")
    return [[answers[rank][k] for rank in range(world)] for k in range(len(runs))]
