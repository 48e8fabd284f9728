"""Every strategy side by side on the same ranks: step time, tokens/s and peak memory per rank, in one run.

Each strategy trains the same model on the same rows with the same settings through
`python -m phalanx train --world_size N` (as users start it), one after the other. Reported per
strategy: median step time over the steps after the first `--warmup` (rank 0's metrics.jsonl
timestamps), tokens/s over those steps, whole-run training seconds, and the peak memory of every rank
(max RSS on CPU, torch.cuda.max_memory_allocated on CUDA) from final_training_info.json, plus each
one's step time and memory relative to the first variant (DDP). Timings are reported, never asserted.

  .venv/bin/python benchmarks/strategies.py                  # 2 CPU ranks, LoRA, 20 steps
  .venv/bin/python benchmarks/strategies.py --finetune full --steps 10
  python benchmarks/strategies.py --gpu-shape r1-distill-qwen-1.5b --world_size 1 --offload   # one GPU, bf16, seq 2048

On one rank, 'ddp' is plain single-process training; fsdp and deepspeed run on a one-rank group, where
what they can add is CPU offload (`--offload` adds those variants).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from helpers import write_chat_jsonl  # noqa: E402  (the tests' synthetic tool-calling chats)

STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp FULL_SHARD": ["--strategy", "fsdp", "--sharding_strategy", "FULL_SHARD"],
    "fsdp SHARD_GRAD_OP": ["--strategy", "fsdp", "--sharding_strategy", "SHARD_GRAD_OP"],
    "ZeRO-1": ["--strategy", "deepspeed", "--zero_stage", "1"],
    "ZeRO-2": ["--strategy", "deepspeed", "--zero_stage", "2"],
    "ZeRO-3": ["--strategy", "deepspeed", "--zero_stage", "3"],
}
OFFLOAD = {
    "fsdp FULL_SHARD + offload": ["--strategy", "fsdp", "--sharding_strategy", "FULL_SHARD", "--offload_param", "true"],
    "ZeRO-2 + optimizer offload": ["--strategy", "deepspeed", "--zero_stage", "2", "--offload_optimizer", "true"],
    "ZeRO-3 + param/optimizer offload": [
        "--strategy",
        "deepspeed",
        "--zero_stage",
        "3",
        "--offload_param",
        "true",
        "--offload_optimizer",
        "true",
    ],
}


def run(name: str, flags: list[str], model: str, data: Path, out: Path, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "train",
        "--model_name",
        model,
        "--dataset_path",
        str(data),
        "--output_dir",
        str(out),
        "--world_size",
        str(args.world_size),
        "--batch_size",
        str(args.batch_size),
        "--max_steps",
        str(args.steps),
        "--finetune",
        args.finetune,
        "--max_length",
        str(args.max_length),
        "--mixed_precision",
        args.mixed_precision,
        "--test_size",
        "0",
        "--log_steps",
        "1",
        "--eval_steps",
        "1000000",
        "--save_steps",
        "1000000",
        "--checkpoint.save_best",
        "false",
        "--logging.tensorboard",
        "false",
        "--logging.progress_bar",
        "false",
        "--overwrite_output_dir",
        "true",
        *(["--gradient_checkpointing", "true"] if args.gradient_checkpointing else []),
        *flags,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"name": name, "error": lines[-1][:300] if lines else "failed"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    times = [r["time"] for r in train]
    steps = [b - a for a, b in zip(times[args.warmup :], times[args.warmup + 1 :])]
    tokens = [r["tokens_per_s"] for r in train[args.warmup + 1 :]]
    info = json.loads((out / "final_training_info.json").read_text())
    return {
        "name": name,
        "step_s": statistics.median(steps) if steps else float("nan"),
        "tokens_s": statistics.median(tokens) if tokens else float("nan"),
        "train_s": info["train_seconds"],
        "peak_mb": info["peak_memory_mb_per_rank"],
        "final_loss": train[-1]["loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max_length", type=int, default=None, help="default 768; 2048 with --gpu-shape")
    parser.add_argument("--finetune", choices=["lora", "full"], default="lora")
    parser.add_argument("--mixed_precision", default=None, help="default auto; bf16 with --gpu-shape")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--model", default="embedded:tiny-qwen3")
    parser.add_argument(
        "--gpu-shape",
        dest="gpu_shape",
        default=None,
        help="random-weight model of a published shape (see train_vs_hf.py), written once under --work_dir",
    )
    parser.add_argument("--work_dir", default="/tmp/phalanx-bench")
    parser.add_argument("--offload", action="store_true", help="add the CPU-offload variants")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    args = parser.parse_args()
    args.max_length = args.max_length or (2048 if args.gpu_shape else 768)
    args.mixed_precision = args.mixed_precision or ("bf16" if args.gpu_shape else "auto")
    model = args.model
    if args.gpu_shape:
        from train_vs_hf import build_gpu_shape_folder

        model = str(
            build_gpu_shape_folder(args.gpu_shape, Path(args.work_dir) / f"{args.gpu_shape}-random", device="cuda")
        )
    variants = {**STRATEGIES, **(OFFLOAD if args.offload else {})}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_chat_jsonl(Path(tmp) / "train.jsonl", 96 * max(args.world_size, 1) * max(args.batch_size // 2, 1))
        results = []
        for i, (name, flags) in enumerate(variants.items()):
            if args.only and name not in args.only:
                continue
            results.append(run(name, flags, model, data, Path(tmp) / f"out{i}", args))
            r = results[-1]
            print(
                f"   {name}: " + (r["error"] if "error" in r else f"{r['step_s']:.3f} s/step, peak {r['peak_mb']} MB"),
                flush=True,
            )
    print(
        f"\n{args.world_size} rank(s), {args.finetune}, {args.model if not args.gpu_shape else args.gpu_shape}, "
        f"{args.mixed_precision}, batch {args.batch_size}/rank, max_length {args.max_length}, {args.steps} steps"
        f"{', activation checkpointing' if args.gradient_checkpointing else ''}\n"
    )
    base = next((r for r in results if "error" not in r), None)
    print(
        "| strategy | median step (s) | tokens/s | step vs first | train (s) | peak memory per rank (MB) | memory vs first | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error']} | | | | | | |")
            continue
        step_ratio = r["step_s"] / base["step_s"] if base else float("nan")
        mem_ratio = max(r["peak_mb"]) / max(base["peak_mb"]) if base else float("nan")
        print(
            f"| {r['name']} | {r['step_s']:.3f} | {r['tokens_s']:.0f} | {step_ratio:.2f}x | {r['train_s']:.1f} "
            f"| {', '.join(f'{m:.0f}' for m in r['peak_mb'])} | {mem_ratio:.2f}x | {r['final_loss']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
