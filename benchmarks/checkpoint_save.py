"""How long a checkpoint save holds up training: synchronous vs `checkpoint.async_save`, side by side in one run.

Both arms run `python -m phalanx train` as users start it: full fine-tuning under FSDP2 (FULL_SHARD) of a
Qwen3-architecture model big enough for the write to matter (default ~47M parameters: 0.19 GB of fp32
weights, 0.57 GB with AdamW's two moments, sharded over the ranks), saving every `--save_steps` steps.
Each save logs to metrics.jsonl (kind "save") how long the training loop was blocked by it, measured on
rank 0 from entering the save to leaving it; for async that includes waiting for the previous background
write, if it was still running. Reported per arm: the median and every blocked time, the median time between
consecutive steps' log lines when a save falls between them (the save plus the next step) and when none does
(a background write shares the machine with training: on CPU ranks it competes for the same cores), the
whole training time, and the size of one checkpoint. Intermediate checkpoints of a full fine-tune under
FSDP2 hold the sharded state only (no model gathered to rank 0), so the save is the state itself.

  .venv/bin/python benchmarks/checkpoint_save.py                    # 2 CPU ranks (or the GPUs: device auto)
  .venv/bin/python benchmarks/checkpoint_save.py --hidden 2048 --layers 8 --world_size 8   # on a GPU box

Timings are reported (and appended to benchmarks/RESULTS.md), never asserted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def write_short_chats(path: Path, rows: int) -> Path:
    """Short two-turn chats (about 100 byte-tokens): the benchmark is about saving, so steps are kept cheap."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"What is {i} plus {i % 7}?"},
                            {"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}."},
                        ]
                    }
                )
                + "\n"
            )
    return path


def build_model(folder: Path, hidden: int, layers: int) -> int:
    """A from_pretrained folder: the embedded model's tokenizer and architecture, `hidden` wide and `layers` deep."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from phalanx.models.load import resolve_model_path

    tiny = Path(resolve_model_path("embedded:tiny-qwen3"))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    base = json.loads((tiny / "config.json").read_text())
    heads = max(hidden // 128, 1)
    config = Qwen3Config(
        **{
            **{
                k: base[k]
                for k in (
                    "vocab_size",
                    "bos_token_id",
                    "eos_token_id",
                    "pad_token_id",
                    "rms_norm_eps",
                    "tie_word_embeddings",
                )
                if k in base
            },
            "hidden_size": hidden,
            "intermediate_size": hidden * 11 // 4 // 64 * 64,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(heads // 2, 1),
            "head_dim": 128,
            "max_position_embeddings": 4096,
        }
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def train(name: str, flags: list[str], model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "train",
        "--model_name",
        str(model),
        "--finetune",
        "full",
        "--dataset_path",
        str(data),
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        "true",
        "--strategy",
        "fsdp",
        "--sharding_strategy",
        "FULL_SHARD",
        "--world_size",
        str(args.world_size),
        "--batch_size",
        "1",
        "--max_length",
        str(args.max_length),
        "--max_steps",
        str(args.steps),
        "--save_steps",
        str(args.save_steps),
        "--test_size",
        "0",
        "--eval_steps",
        "1000000",
        "--log_steps",
        "1",
        "--checkpoint.save_best",
        "false",
        "--logging.tensorboard",
        "false",
        "--logging.progress_bar",
        "false",
        *flags,
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in rows if r["kind"] == "save"]
    steps = [r for r in rows if r["kind"] == "train"]
    times = {r["step"]: r["time"] for r in steps}
    saved_at = {r["step"] for r in saves}
    after_save, others = [], []
    for step in sorted(times):
        if step - 1 in times and step > 2:  # step 1 and 2 pay start-up costs
            # From one step's log line to the next: a save at step-1 (logged after its step) falls in this interval.
            (after_save if step - 1 in saved_at else others).append(times[step] - times[step - 1])
    blocked = [r["blocked_s"] for r in saves]
    waited = [r["waited_for_previous_s"] for r in saves]
    checkpoint = out / f"checkpoint-{args.save_steps}"
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    contents = (
        "sharded state + the gathered HF model"
        if (checkpoint / "model.safetensors").is_file()
        else "sharded state only: no gathered HF model in checkpoint-{step}"
    )
    info = json.loads((out / "final_training_info.json").read_text())
    return {
        "name": name,
        "blocked": blocked,
        "blocked_median": statistics.median(blocked),
        "waited": waited,
        "after_save": after_save,
        "others": others,
        "train_s": info["train_seconds"],
        "wall_s": wall,
        "checkpoint_mb": size / 2**20,
        "contents": contents,
        "losses": [r["loss"] for r in steps],
        "device": _device(proc.stdout),
    }


def _device(stdout: str) -> str:
    line = next((text for text in stdout.splitlines() if "World Size:" in text), "")
    return line.split("World Size:", 1)[-1].strip()


def machine() -> str:
    import torch

    cpu = (
        next(
            (
                text.split(":", 1)[1].strip()
                for text in Path("/proc/cpuinfo").read_text().splitlines()
                if text.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"nproc {os.cpu_count()}, {cpu}, {gpu}; torch {torch.__version__}"


def commit() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return head + (" (with uncommitted changes)" if dirty else "")


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--note", default="")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="phalanx-ckpt-bench-") as tmp:
        tmp = Path(tmp)
        params = build_model(tmp / "model", args.hidden, args.layers)
        data = write_short_chats(tmp / "train.jsonl", 64)
        arms = [
            train("sync", [], tmp / "model", data, tmp / "sync", args),
            train("async", ["--checkpoint.async_save", "true"], tmp / "model", data, tmp / "async", args),
        ]
        shutil.rmtree(tmp / "model")
    load_after = os.getloadavg()
    sync, asyn = arms
    state_gb = params * 4 * 3 / 1e9
    lines = [
        f"### {dt.datetime.now():%Y-%m-%d %H:%M} - `checkpoint_save.py`: training blocked by a save, sync vs async_save",
        "",
        f"- machine: {machine()}",
        f"- commit: {commit()}",
        f"- command: `.venv/bin/python benchmarks/checkpoint_save.py {shlex.join(sys.argv[1:])}`".replace(" `", "`"),
        f"- run: {sync['device']}; full fine-tuning, FSDP2 FULL_SHARD, Qwen3 hidden {args.hidden} x {args.layers} layers = "
        f"{params / 1e6:.1f}M parameters ({state_gb:.2f} GB of fp32 weights + AdamW moments); {args.steps} steps, "
        f"batch 1/rank x {args.max_length} tokens, a checkpoint every {args.save_steps} steps "
        f"({sync['checkpoint_mb']:.0f} MB on disk each; {sync['contents']})",
        f"- load average (1/5/15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
        f"after {' '.join(f'{x:.2f}' for x in load_after)}",
        f"- identical losses in both arms: {'yes' if sync['losses'] == asyn['losses'] else 'NO'}",
    ]
    if args.note:
        lines.append(f"- note: {args.note}")
    lines += [
        "",
        "| | sync | async_save | sync / async |",
        "|---|---|---|---|",
        f"| training blocked per save, median (s) | {sync['blocked_median']:.2f} | {asyn['blocked_median']:.2f} | "
        f"**{sync['blocked_median'] / max(asyn['blocked_median'], 1e-9):.1f}x** |",
        f"| blocked per save, each (s) | {fmt(sync['blocked'])} | {fmt(asyn['blocked'])} | |",
        f"| of which waiting for the previous background write (s) | {fmt(sync['waited'])} | {fmt(asyn['waited'])} | |",
        f"| step-to-step time, median, with a save in between (s) | {statistics.median(sync['after_save']):.2f} | "
        f"{statistics.median(asyn['after_save']):.2f} | |",
        f"| step-to-step time, median, no save in between (s) | {statistics.median(sync['others']):.2f} | "
        f"{statistics.median(asyn['others']):.2f} | |",
        f"| training time, whole run (s) | {sync['train_s']:.1f} | {asyn['train_s']:.1f} | "
        f"{sync['train_s'] / asyn['train_s']:.2f} |",
        f"| command wall clock (s) | {sync['wall_s']:.1f} | {asyn['wall_s']:.1f} | |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
