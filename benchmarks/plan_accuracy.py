"""`phalanx plan` against measured peaks on a real device: one process, a few configurations, each in a fresh process.

For every case the plan's peak (bytes per rank) is set beside what a real `build_run` + training loop (3 optimizer
steps) allocated at most: `torch.cuda.max_memory_allocated` on CUDA, the tensor tracker's peak on CPU (the count
phalanx.observe.tensor_memory makes). On CUDA it also reports what the plan's fixed overhead and allocator slack
stand for: device memory in use that PyTorch did not reserve (context, cuBLAS, NCCL) and max reserved / max allocated.

  python benchmarks/plan_accuracy.py                         # CUDA: Qwen2.5-1.5B's shape, random weights, bf16
  python benchmarks/plan_accuracy.py --layers 8 --cases lora,full
  python benchmarks/plan_accuracy.py --layers 1 --cases lora,lora-ckpt,lora-b1-2048,full --steps 2   # no GPU: CPU

Results are reported (benchmarks/RESULTS.md, docs/plan.md), never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from plan.workers import write_rows  # noqa: E402  (the accuracy tests' padded rows)

CASES = {
    "lora": {"model.finetune": "lora", "training.batch_size": 4, "data.max_length": 1024},
    "lora-ckpt": {
        "model.finetune": "lora",
        "training.batch_size": 4,
        "data.max_length": 1024,
        "model.gradient_checkpointing": True,
    },
    "lora-b1-2048": {"model.finetune": "lora", "training.batch_size": 1, "data.max_length": 2048},
    "full": {"model.finetune": "full", "training.batch_size": 2, "data.max_length": 1024},
    "full-ckpt": {
        "model.finetune": "full",
        "training.batch_size": 2,
        "data.max_length": 1024,
        "model.gradient_checkpointing": True,
    },
}


def measure_one(overrides: dict) -> dict:
    """In this process: the plan's estimate, then the real run's peak."""
    import torch

    from phalanx.config.loader import load_config
    from phalanx.plan import model_facts, setup_from_config, strategy_rows
    from phalanx.plan.command import with_data_lengths
    from phalanx.runtime.dist import shutdown
    from phalanx.runtime.quiet import quiet_libraries
    from phalanx.train.loop import train
    from phalanx.train.run import build_run

    quiet_libraries()
    cfg = load_config(None, overrides)
    cuda = torch.cuda.is_available()
    # As `phalanx plan` does: packed micro-batches priced from the data's row lengths.
    setup = with_data_lengths(cfg, setup_from_config(cfg, "cuda" if cuda else "cpu"))
    rows = strategy_rows(model_facts(cfg), setup, device_memory=2**50)
    row = rows[0]  # the single-process row
    estimate = row.peak_ckpt if cfg.model.gradient_checkpointing else row.peak
    if cuda:
        run = build_run(cfg)
        run.strategy.unwrap().train()  # build_run leaves the model in eval mode, where checkpointing is skipped
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train(run)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()
        slack = torch.cuda.max_memory_reserved() / max(peak, 1)
    else:
        from phalanx.observe.tensor_memory import TensorMemoryTracker

        with TensorMemoryTracker() as tracker:
            run = build_run(cfg)
            run.strategy.unwrap().train()
            tracker.track_module(run.strategy.unwrap())
            gc.collect()
            tracker.reset_peak()
            train(run)
        peak, outside, slack = tracker.peak, None, None
    del run
    shutdown()
    return {
        "estimate": estimate,
        "measured": peak,
        "ratio": estimate / peak,
        "outside_torch": outside,
        "reserved_over_allocated": slack,
        "detail": row.detail,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape has")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one case (JSON overrides) and print it
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure_one(json.loads(args.one))), flush=True)
        return

    import torch
    from train_vs_hf import build_gpu_shape_folder

    work = Path(os.environ.get("PHALANX_BENCH", tempfile.gettempdir())) / "phalanx-plan-accuracy"
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_gpu_shape_folder(
        args.shape, work / f"{args.shape}-{args.layers or 'all'}", args.layers, device=device
    )
    print(
        f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"model {args.shape} ({args.layers or 'all'} layers)"
    )
    print(f"{'case':<14} {'estimate':>16} {'measured':>16} {'ratio':>6} {'outside torch':>14} {'reserved/alloc':>14}")
    for name in args.cases.split(","):
        case = dict(CASES[name])
        # 8 tokens of margin (room for the tokenizer's special tokens around a text row).
        data = write_rows(work / f"{name}.jsonl", 16, case["data.max_length"], margin=8)
        overrides = {
            "model.model_name": str(model),
            "data.dataset_path": str(data),
            "output_dir": str(work / name),
            "overwrite_output_dir": True,
            "data.test_size": 0.0,
            "training.max_steps": args.steps,
            "checkpoint.save_steps": 10**9,
            "eval.eval_steps": 10**9,
            "logging.tensorboard": False,
            "logging.progress_bar": False,
            "lora.dropout": 0.0,
            **case,
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(overrides)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"},
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{name:<14} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(line[7:])
        outside = f"{r['outside_torch'] / 2**30:.2f} GiB" if r["outside_torch"] is not None else "-"
        slack = f"{r['reserved_over_allocated']:.3f}" if r["reserved_over_allocated"] else "-"
        print(f"{name:<14} {r['estimate']:>16,} {r['measured']:>16,} {r['ratio']:>6.3f} {outside:>14} {slack:>14}")
        print("    " + json.dumps({k: round(v / 2**20, 1) for k, v in r["detail"].items()}), flush=True)


if __name__ == "__main__":
    main()
