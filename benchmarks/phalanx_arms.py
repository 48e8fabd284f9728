"""phalanx's own training arms, one after the other on the same rows: LoRA (the default path), QLoRA, full fine-tuning.

Each arm is one `python -m phalanx train` run as a user starts it (same model, data, steps, batch, sequence cap,
LoRA r/alpha/dropout, learning rate), time-boxed so a hang cannot take the whole call. Reported per arm: steady
tokens/s (input tokens over steps warmup+1..last, from metrics.jsonl, one log per step), seconds per step, MFU, peak
memory per rank (torch.cuda.max_memory_allocated on CUDA, max RSS on CPU), first and last loss.

MFU = model FLOPs / (seconds x ranks x peak). Per micro-batch of rows with lengths t_i (packed: no padding counted):
LoRA and QLoRA 4*N*sum(t_i) (forward 2N, input-gradient backward 2N; frozen weights get no weight gradient), full
fine-tuning 6*N*sum(t_i), plus attention 12*L*(heads*head_dim)*sum(t_i^2) in both (PaLM's count, not halved for the
causal mask). N counts the output head once and not the input embedding (untied: parameters minus the input
embedding; tied: all parameters), as issue 15 asks. Peak: the GPU's dense bf16 TFLOP/s (989 on H100 SXM).

  .venv/bin/python benchmarks/phalanx_arms.py                              # CPU: the embedded tiny model, fp32, 1 rank
  python benchmarks/phalanx_arms.py --gpu-shape r1-distill-qwen-1.5b --arms lora,qlora,full --steps 20
Results are appended to benchmarks/RESULTS.md (reported, never asserted).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from train_vs_hf import (  # noqa: E402
    GPU_SHAPES,
    HUGE,
    RESULTS,
    build_gpu_shape_folder,
    cpu_model,
    load_average,
    make_plan,
    matmul_parameters,
    peak_tflops_for,
    sh,
)

ARMS = {  # flags on top of the shared ones; FLOPs factor per token (4N frozen base, 6N everything trains)
    "lora": ([], 4),
    "qlora": (["--load_in_4bit", "true"], 4),
    "full": (["--finetune", "full"], 6),
    # A/B arms of the default LoRA path: regional compile (which replaces Liger's elementwise kernels), and eager
    # without Liger's kernels.
    "lora-compile": (["--training.compile", "true"], 4),
    "lora-plain": (["--training.compile", "false", "--training.liger_kernels", "false"], 4),
    # Compiled layers with phalanx's chunked head instead of Liger's fused linear cross-entropy (which reads its target
    # count and output gradient back to the host: three waits a step, profiled on an H200 on 2026-11-28).
    "lora-compile-chunked-head": (["--training.compile", "true", "--training.liger_kernels", "false"], 4),
    "full-compile": (["--finetune", "full", "--training.compile", "true"], 6),
    # Micro-batches of 16,384 tokens (about 4x the default's at batch 4 on the bundled rows): a step at batch 4 is bound
    # by the host launching kernels, so more tokens per launch show in MFU (RESULTS 2026-11-27: 9.4% -> 26.8% eager).
    "lora-16k": (["--training.batch_tokens", "16384"], 4),
    "lora-compile-16k": (["--training.compile", "true", "--training.batch_tokens", "16384"], 4),
    # Compiled layers whose kernels a C++ wrapper launches (ARM_ENV; models/compile.py CPP_WRAPPER_ENV): at batch 4 the
    # compiled step was still bound by the host launching ~3,900 kernels from Python.
    "lora-compile-cpp": (["--training.compile", "true"], 4),
    # Compiled layers captured as CUDA graphs (training.cuda_graphs, models/graphs.py): the batch-4 step without the
    # host launching each kernel; micro-batches padded to 16 token counts, each captured at its first use.
    "lora-graphs": (["--training.cuda_graphs", "true"], 4),
    "full-16k": (["--finetune", "full", "--training.batch_tokens", "16384"], 6),
    "full-compile-16k": (["--finetune", "full", "--training.compile", "true", "--training.batch_tokens", "16384"], 6),
    # The seeds' own setting (seed 002: batch 1, 8 micro-batches per step): one pass per micro-batch, the default
    # (a step's micro-batches merged into passes of at most batch_size x max_length = 2,048 tokens), and merged
    # into passes of at most 16,384 tokens. The same rows per optimizer step in all three.
    "seeds-unmerged": (
        ["--batch_size", "1", "--gradient_accumulation_steps", "8", "--training.merge_micro_batches", "false"],
        4,
    ),
    "seeds": (["--batch_size", "1", "--gradient_accumulation_steps", "8"], 4),
    "seeds-merge-16k": (
        ["--batch_size", "1", "--gradient_accumulation_steps", "8", "--training.merge_tokens", "16384"],
        4,
    ),
}


# Environment an arm runs with, on top of the caller's.
ARM_ENV = {
    "lora-compile-cpp": {"PHALANX_COMPILE_CPP_WRAPPER": "1"},
    # Why a graph was not captured, where one was not (the run also says how many were not).
    "lora-graphs": {"TORCH_LOGS": "recompiles,graph_breaks,cudagraphs"},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="lora,qlora,full", help=f"comma-separated, in this order: {', '.join(ARMS)}")
    p.add_argument(
        "--gpu-shape",
        dest="gpu_shape",
        choices=sorted(GPU_SHAPES),
        default=None,
        help="random-weight model of this shape, bf16 on CUDA (default: the embedded tiny model on CPU)",
    )
    p.add_argument("--model", default="embedded:tiny-qwen3")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steady figures")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--max_length", type=int, default=2048)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument(
        "--arm-timeout", dest="arm_timeout", type=float, default=300, help="seconds per arm before it is killed"
    )
    p.add_argument("--peak-tflops", dest="peak_tflops", type=float, default=None)
    p.add_argument("--extra", default="", help="more `phalanx train` flags for every arm (one shell-quoted string)")
    p.add_argument("--work_dir", default="/tmp/phalanx-bench")
    p.add_argument("--no-results", dest="no_results", action="store_true")
    p.add_argument("--note", default="")
    return p.parse_args(argv)


def flops_n(model_path: str) -> tuple[int, int, int]:
    """(N as defined above, layers, heads*head_dim), counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = int(text.num_attention_heads) * int(
        getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    )
    return matmul_parameters(model), int(text.num_hidden_layers), width


def flag_value(flags: list[str], name: str, default):
    """An arm's integer flag, or `default` where the arm leaves it to the shared flags."""
    return int(flags[flags.index(name) + 1]) if name in flags else default


def run_arm(name: str, flags: list[str], out: Path, timeout: float, nproc: int) -> dict:
    cmd = [sys.executable, "-m", "phalanx", "train", *flags, "--world_size", str(nproc), "--output_dir", str(out)]
    log = out.with_suffix(".log")
    print(f"\n== {name}: {shlex.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    # One thread per rank unless told otherwise: on a shared CPU, OpenMP's spinning threads multiply a busy
    # machine's slowdown (a tiny LoRA step took 20 s with torch's default threads at load 7 on 2 cores).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(ARM_ENV.get(name, {}))
    start = time.perf_counter()
    try:
        with log.open("w") as f:
            code = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    wall = time.perf_counter() - start
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        print(f"   {name}: failed ({code}) after {wall:.0f}s; last lines of {log}:\n{tail}", flush=True)
        return {"error": f"exit {code} after {wall:.0f}s (log {log})", "wall": wall}
    info = json.loads((out / "final_training_info.json").read_text())
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    return {
        "wall": wall,
        "ends": {r["step"]: r["time"] for r in train},
        "first_loss": train[0]["loss"],
        "last_loss": train[-1]["loss"],
        "peak": max(info["peak_memory_mb_per_rank"]),
        "log": str(log),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    gpu = args.gpu_shape is not None
    cuda = torch.cuda.is_available()
    if gpu and not cuda:
        sys.exit("--gpu-shape needs a CUDA device; leave it out for the CPU mode")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = (
        str(build_gpu_shape_folder(args.gpu_shape, work / f"{args.gpu_shape}-random", device="cuda"))
        if gpu
        else args.model
    )
    shared = [
        "--model_name",
        model,
        "--max_steps",
        str(args.steps),
        "--batch_size",
        str(args.batch_size),
        "--max_length",
        str(args.max_length),
        "--lora_dropout",
        repr(args.lora_dropout),
        "--test_size",
        "0",
        "--log_steps",
        "1",
        "--eval_steps",
        str(HUGE),
        "--save_steps",
        str(HUGE),
        "--checkpoint.save_best",
        "false",
        "--logging.tensorboard",
        "false",
        "--logging.progress_bar",
        "false",
        "--overwrite_output_dir",
        "true",
        "--mixed_precision",
        "bf16" if gpu else "auto",
        *shlex.split(args.extra),
    ]

    from phalanx.config.flags import split_flags
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.models.load import resolve_model_path
    from phalanx.train.run import load_data

    cfg = load_config(None, overrides_from_flags(split_flags(shared)[1]))
    _, data = load_data(cfg)  # the runs read these rows from the same cache
    plans: dict = {}  # by (token budget, batch_size, accumulation): the rows of each step
    n, layers, width = flops_n(resolve_model_path(model))
    peak_t = args.peak_tflops or (peak_tflops_for(torch.cuda.get_device_name(0)) if cuda and gpu else None)
    device = torch.cuda.get_device_name(0) if gpu else f"CPU ({cpu_model()}, nproc {os.cpu_count()})"
    print(f"phalanx arms on {device}: N = {n:,}, L = {layers}, heads*head_dim = {width}; load average {load_average()}")

    rows = []
    for name in [a.strip() for a in args.arms.split(",") if a.strip()]:
        extra, factor = ARMS[name]
        res = run_arm(name, [*shared, *extra], work / f"arm-{name}", args.arm_timeout, args.nproc)
        if "error" in res:
            rows.append((name, res["error"]))
            continue
        budget = flag_value(extra, "--training.batch_tokens", None)
        batch = flag_value(extra, "--batch_size", args.batch_size)
        accumulation = flag_value(extra, "--gradient_accumulation_steps", 1)
        key = (budget, batch, accumulation)
        if key not in plans:
            plans[key] = make_plan(data.train, args.nproc, batch, accumulation, args.steps, cfg.training.seed, budget)
        plan = plans[key]
        ends = res["ends"]
        first = max(min(ends), args.warmup)
        last = max(ends)
        steps = range(first + 1, last + 1)
        tokens = sum(plan.step_tokens(s - 1) for s in steps)
        sq = sum(plan.step_sq_lengths(s - 1) for s in steps)
        seconds = ends[last] - ends[first]
        flops = factor * n * tokens + 12.0 * layers * width * sq
        tflops = flops / seconds / args.nproc / 1e12
        mfu = f"{tflops / peak_t:.1%}" if peak_t else "n/a (CPU)"
        line = (
            f"{tokens / seconds:,.0f} tokens/s steady (steps {first + 1}-{last}), {seconds / len(steps):.3f} s/step, "
            f"{tflops:.2f} model TFLOP/s per {'GPU' if gpu else 'process'}, MFU {mfu}, peak {res['peak']:.0f} MB/rank "
            f"({'CUDA allocated' if gpu else 'RSS'}), loss {res['first_loss']:.4f} -> {res['last_loss']:.4f}, "
            f"wall {res['wall']:.0f}s"
        )
        print(f"   {name}: {line}", flush=True)
        rows.append((name, line))
    if args.no_results:
        return
    commit = sh(f"git -C {ROOT} rev-parse --short HEAD") or "unknown"
    dirty = bool(sh(f"git -C {ROOT} status --porcelain -- src"))
    entry = [
        f"\n### {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} - phalanx arms (benchmarks/phalanx_arms.py), "
        f"{'CUDA bf16' if gpu else 'CPU fp32'}, {args.nproc} rank(s), {args.steps} steps, batch {args.batch_size}/rank, "
        f"max_length {args.max_length}\n",
        f"- machine: {device}; torch {torch.__version__}",
        f"- commit: {commit}{' (with uncommitted changes under src/)' if dirty else ''}",
        f"- command: `python benchmarks/phalanx_arms.py {shlex.join(argv if argv is not None else sys.argv[1:])}`",
        f"- model: {args.gpu_shape + ' shape (random weights)' if gpu else model}; N = {n:,} (head once, input embedding "
        f"not counted); LoRA arms 4N, full 6N per token, + 12*L*(heads*head_dim)*t^2 attention; peak "
        f"{f'{peak_t:g} TFLOP/s' if peak_t else 'n/a'}",
        *([f"- note: {args.note}"] if args.note else []),
        "",
        *(f"- {name}: {line}" for name, line in rows),
        "",
    ]
    with RESULTS.open("a") as f:
        f.write("\n".join(entry))
    print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
