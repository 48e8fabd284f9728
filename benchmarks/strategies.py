"""Every strategy side by side on the same ranks: step time and peak memory per rank, in one run.

Each strategy trains the embedded model on the same rows with the same settings through
`python -m phalanx train --world_size N` (as users start it), one after the other. Reported per
strategy: median step time over the steps after the first `--warmup` (rank 0's metrics.jsonl
timestamps), whole-run training seconds, and the peak memory of every rank (max RSS on CPU,
max allocated on CUDA) from final_training_info.json. Timings are reported, never asserted.

  .venv/bin/python benchmarks/strategies.py                  # 2 CPU ranks, LoRA, 20 steps
  .venv/bin/python benchmarks/strategies.py --finetune full --steps 10
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

from helpers import write_chat_jsonl  # noqa: E402  (the tests' synthetic tool-calling chats)

STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp FULL_SHARD": ["--strategy", "fsdp", "--sharding_strategy", "FULL_SHARD"],
    "fsdp SHARD_GRAD_OP": ["--strategy", "fsdp", "--sharding_strategy", "SHARD_GRAD_OP"],
    "ZeRO-1": ["--strategy", "deepspeed", "--zero_stage", "1"],
    "ZeRO-2": ["--strategy", "deepspeed", "--zero_stage", "2"],
    "ZeRO-3": ["--strategy", "deepspeed", "--zero_stage", "3"],
}


def run(name: str, flags: list[str], data: Path, out: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "phalanx", "train", "--dataset_path", str(data), "--output_dir", str(out),
           "--world_size", str(args.world_size), "--batch_size", str(args.batch_size), "--max_steps", str(args.steps),
           "--finetune", args.finetune, "--max_length", "768", "--test_size", "0", "--log_steps", "1",
           "--eval_steps", "1000000", "--save_steps", "1000000", "--checkpoint.save_best", "false",
           "--logging.tensorboard", "false", "--logging.progress_bar", "false", "--overwrite_output_dir", "true", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if r["kind"] == "train"]
    steps = [b - a for a, b in zip(times[args.warmup:], times[args.warmup + 1:])]
    info = json.loads((out / "final_training_info.json").read_text())
    return {"name": name, "step_s": statistics.median(steps) if steps else float("nan"),
            "train_s": info["train_seconds"], "peak_mb": info["peak_memory_mb_per_rank"],
            "final_loss": [r["loss"] for r in rows if r["kind"] == "train"][-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--finetune", choices=["lora", "full"], default="lora")
    parser.add_argument("--only", nargs="*", default=None, help="strategy names to run (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_chat_jsonl(Path(tmp) / "train.jsonl", 96)
        results = [run(name, flags, data, Path(tmp) / f"out{i}", args)
                   for i, (name, flags) in enumerate(STRATEGIES.items()) if not args.only or name in args.only]
    print(f"\n{args.world_size} ranks, {args.finetune}, batch {args.batch_size}/rank, {args.steps} steps\n")
    print("| strategy | median step (s) | train (s) | peak memory per rank (MB) | final loss |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error']} | | | |")
        else:
            print(f"| {r['name']} | {r['step_s']:.3f} | {r['train_s']:.1f} | {', '.join(f'{m:.0f}' for m in r['peak_mb'])} "
                  f"| {r['final_loss']:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
