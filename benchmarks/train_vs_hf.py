"""Training speed of `phalanx train` side by side with Hugging Face Trainer + PEFT, same model, data and settings.

One invocation runs both, one after the other, with the same number of DDP ranks:

  (a) phalanx, started the way users start it (`python -m phalanx train ... --world_size N`, torch's
      elastic launcher), or under `torchrun` with `--phalanx-launcher torchrun`;
  (b) `transformers.Trainer` with a PEFT LoRA adapter, under `torchrun` (Trainer reads the torchrun
      environment; gloo on CPU, NCCL on CUDA).

What is held equal: the model folder, the tokenized rows (phalanx's `prepare_data` runs once, here; the
Trainer run reads the very same cached `datasets` folder), and the order in which each rank sees them
(the Trainer dataset is laid out so that its sequential sampler, sharded by accelerate, hands every rank
the micro-batches phalanx's sampler hands it), right padding to the longest row of a micro-batch, the
sequence cap, per-rank batch, gradient accumulation, LoRA r/alpha/dropout/target modules, learning rate,
linear schedule without warm-up, gradient clipping at 1.0, weight decay 0, the number of optimizer steps.
Both normalise the loss by the number of target tokens of the global batch. Turned off in both: evaluation,
checkpoints, TensorBoard, progress bars. Both log every `--log_steps` steps.

What is measured, for each:
  * steady tokens/s: input (non-pad) tokens of every rank over steps warmup+1 .. last, divided by the
    wall time between the end of step `warmup` and the end of the last step (rank 0 clock: phalanx's
    metrics.jsonl timestamps, a TrainerCallback's on_step_end for Trainer);
  * whole-run wall clock (launch to exit, start-up included) and tokens/s over it;
  * peak memory per rank: max RSS on CPU, torch.cuda.max_memory_allocated on CUDA;
  * the loss at the first logged step (same model, same rows: the two must agree closely).

phalanx runs as users run it: packed (padding-free) micro-batches by default, the loss at target positions
only. Trainer pads (its collator is phalanx's `pad_batch`, as users' own would). `--with-unpacked` adds a
third run, phalanx with `--packing false` (the old path), as the A/B of phalanx's own change. `--with-trl` adds
TRL's `SFTTrainer` as its docs recommend for speed (padding-free, Liger kernels on CUDA when liger-kernel is
installed; without Liger on CPU, where it needs triton), on the same rows in the same order, under torchrun. The same rows
reach both sides, so *seconds per row* (steady seconds per step / rows per step) compares the work each side
needs for the same data. Both running orders are measured in one call by default (`--orders both`:
phalanx then Trainer, then Trainer then phalanx) and the time-per-row ratio is reported per order and as
their geometric mean: on a shared machine one order alone is not a comparison.

`--gpu-shape r1-distill-qwen-1.5b` builds a Qwen2-architecture model with DeepSeek-R1-Distill-Qwen-1.5B's shape
(random weights, untied head; `qwen2.5-1.5b` is the tied one of the earlier entries), runs at sequence length 2048
in bf16 on CUDA and adds MFU. `--dry-run` prints the plan (and builds the
model on CPU in gpu-shape mode) without training.

`--host-proxy r1-distill-qwen-1.5b` is that model's 28 layers and 196 adapters at tiny widths on short chats, on CPU:
the arithmetic is negligible, so a step costs what the framework spends on the host (Python, dispatch, autograd),
the cost that bounds an eager GPU step at batch 4 (RESULTS 2026-11-26: ~0.25 s of host per ~0.1 s of GPU work).

Run from the repository root:
  .venv/bin/python benchmarks/train_vs_hf.py                # 2 CPU ranks, 30 steps, batch 4, max_length 2048, both orders
  .venv/bin/python benchmarks/train_vs_hf.py --gpu-shape r1-distill-qwen-1.5b --dry-run
Results are appended to benchmarks/RESULTS.md (never asserted: timings are reported, not tested).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
HUGE = 10**9  # "never" for eval / save intervals

# Qwen2.5-1.5B's published config values (the architecture and sizes; the weights here are random).
GPU_SHAPES = {
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,
    ),
}
# The seeds' model, DeepSeek-R1-Distill-Qwen-1.5B (its config.json): Qwen2.5-1.5B's sizes with an untied output head
# (a second 151,936 x 1,536 matrix: 0.47 GB more in bf16) and rope_theta 10,000.
GPU_SHAPES["r1-distill-qwen-1.5b"] = {
    **GPU_SHAPES["qwen2.5-1.5b"],
    "max_position_embeddings": 131072,
    "rope_theta": 10_000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}

# Dense bf16 tensor-core peak per GPU (no structured sparsity), from the vendors' data sheets.
PEAK_BF16_TFLOPS = [
    ("H200", 989.4),
    ("GH200", 989.4),
    ("H100 NVL", 835.0),
    ("H100 PCIE", 756.0),
    ("H100", 989.4),  # SXM
    ("A100", 312.0),
    ("L40S", 362.1),
    ("A10G", 70.0),
    ("L4", 121.0),
]


# ----------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """Which rows every rank reads at every optimizer step, replayed from phalanx's own sampler."""

    steps: list[list[list[list[int]]]]  # steps[s][rank][micro] = row indices
    lengths: list[int]  # tokens of every row of the training set
    targets: list[int]  # target tokens (labels != -100 at positions 1..) of every row
    short_groups: bool  # an epoch ended inside the run with a short accumulation group
    uneven_micro: bool  # some micro-batch holds fewer than batch_size rows

    def step_tokens(self, s: int) -> int:
        return sum(self.lengths[i] for rank in self.steps[s] for mb in rank for i in mb)

    def step_targets(self, s: int) -> int:
        return sum(self.targets[i] for rank in self.steps[s] for mb in rank for i in mb)

    def step_sq_lengths(self, s: int) -> int:
        return sum(self.lengths[i] ** 2 for rank in self.steps[s] for mb in rank for i in mb)

    def global_order(self) -> list[int]:
        """Row order for Trainer's sequential sampler: accelerate gives batch k to rank k % world_size."""
        order = []
        for step in self.steps:
            for micro in range(len(step[0])):
                for rank in step:
                    order.extend(rank[micro])
        return order


def make_plan(
    train, world: int, batch: int, accum: int, steps: int, seed: int, batch_tokens: Optional[int] = None
) -> Plan:
    """The rows of every micro-batch of every rank, as the runs' loaders draw them: `batch` rows each, or packed to
    `batch_tokens` (training.batch_tokens) by phalanx's own token-budget sampler."""
    from phalanx.data.sampler import StatefulDistributedSampler, TokenBudgetBatchSampler

    lengths = [len(x) for x in train["input_ids"]]
    targets = [sum(1 for y in labels[1:] if y != -100) for labels in train["labels"]]
    if batch_tokens:
        samplers = [TokenBudgetBatchSampler(lengths, batch_tokens, r, world, seed=seed) for r in range(world)]
    else:
        samplers = [StatefulDistributedSampler(len(train), r, world, seed=seed) for r in range(world)]
    plan_steps, epoch, short, uneven = [], 0, False, False
    while len(plan_steps) < steps:
        per_rank = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            rows = list(sampler)
            if batch_tokens:
                per_rank.append(rows)  # the sampler yields micro-batches
                continue
            per_rank.append([rows[i : i + batch] for i in range(0, len(rows), batch)])  # DataLoader, no drop_last
        micro = len(per_rank[0])
        for start in range(0, micro, accum):
            group = [mbs[start : start + accum] for mbs in per_rank]
            if len(group[0]) < accum:
                short = True
            if not batch_tokens and any(len(mb) < batch for mbs in group for mb in mbs):
                uneven = True
            plan_steps.append(group)
            if len(plan_steps) == steps:
                break
        epoch += 1
    return Plan(plan_steps, lengths, targets, short, uneven)


# ----------------------------------------------------------------------------- model folders


def byte_level_qwen2_tokenizer():
    """A byte-level tokenizer of Qwen2's own class: 256 byte tokens, no merges, ChatML specials and template.

    transformers 5 loads the tokenizer class registered for a config's model type when that type is
    listed as having wrong Hub tokenizer classes (qwen2 is), whatever tokenizer_config.json says; the
    embedded ByT5 tokenizer saved next to a Qwen2 config would come back as an empty Qwen2Tokenizer.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    from phalanx.models.presets import CHAT_TEMPLATE

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=ord))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --host-proxy: a GPU shape's layers, projections and adapters (the same modules, kernels and launches per step) at
# widths where the arithmetic is negligible on a CPU, so a step's time is what the framework costs on the host. Grouped
# key/value heads kept (2 of 4), vocabulary just above the byte-level tokenizer's.
HOST_PROXY_WIDTHS = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
)


def build_gpu_shape_folder(
    shape: str, folder: Path, layers: Optional[int] = None, device: str = "cpu", widths: Optional[dict] = None
) -> Path:
    """A from_pretrained folder: a Qwen2 model with `shape`'s sizes (`widths` overriding some) and random weights,
    and a byte-level tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    values = {**GPU_SHAPES[shape], **(widths or {})}
    if layers:
        values["num_hidden_layers"] = layers
    marker = folder / "phalanx-bench.json"
    stamp = {**values, "tokenizer": "byte-level Qwen2Tokenizer"}
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return folder
    tokenizer = byte_level_qwen2_tokenizer()
    config = Qwen2Config(
        **values,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="bfloat16",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "phalanx-bench.json").write_text(json.dumps(stamp))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def write_short_chats(path: Path, rows: int = 400, seed: int = 0) -> Path:
    """--host-proxy's rows: short one-exchange chats (about 60 to 120 tokens with the byte-level tokenizer), so that
    attention over long rows does not dominate a CPU step. Deterministic; written once."""
    import random

    if path.is_file():
        return path
    rng = random.Random(seed)
    words = "dose water sleep walk heart rate fever pain rest meal salt sugar tea".split()
    lines = []
    for _ in range(rows):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(4, 10)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        chat = {"messages": [{"role": "user", "content": question + "?"}, {"role": "assistant", "content": answer}]}
        lines.append(json.dumps(chat))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def construct_gpu_shape_on_cpu(shape: str, layers: Optional[int]) -> tuple[int, dict]:
    """Dry run: build the model for real on CPU (bf16) and count its parameters; nothing is written."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    values = dict(GPU_SHAPES[shape])
    if layers:
        values["num_hidden_layers"] = layers
    config = Qwen2Config(**values)
    start = time.perf_counter()
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    print(
        f"   built {type(model).__name__} on CPU in {time.perf_counter() - start:.1f}s: {total:,} parameters "
        f"({total * 2 / 2**30:.2f} GiB in bf16)"
    )
    n = matmul_parameters(model)
    del model
    return n, values


def matmul_parameters(model) -> int:
    """N of the FLOP count: every parameter, the output head once, the input embedding not at all (a lookup, no
    matmul). A tied head is the embedding matrix: counted once, as the head; an untied one (R1-Distill) adds its own."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    return total if tied else total - embed.numel()


def lora_flops(n_params: int, layers: int, attn_width: int, tokens: int, sq_lengths: int) -> float:
    """LoRA training FLOPs: 4N per token (forward 2N + input-gradient backward 2N; frozen weights get no
    weight gradient, the adapters' own FLOPs are negligible) plus attention 12*L*(heads*head_dim)*t per
    token of a t-token sequence (forward 4*L*d*t for QK^T and AV, backward twice that; not halved for the
    causal mask, as in the PaLM paper's accounting)."""
    return 4.0 * n_params * tokens + 12.0 * layers * attn_width * sq_lengths


def peak_tflops_for(name: str) -> Optional[float]:
    upper = name.upper()
    for key, value in PEAK_BF16_TFLOPS:
        if key in upper:
            return value
    return None


# ----------------------------------------------------------------------------- machine facts


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - facts for the report only
        return ""


def cpu_model() -> str:
    for line in sh("lscpu").splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def child_env(threads: Optional[int]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def cpu_busy_seconds() -> Optional[float]:
    """Core-seconds all processes have spent busy since boot (Linux /proc/stat), or None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU time of this process (the watcher thread) and of its finished children (the run)."""
    import resource

    usage = [resource.getrusage(who) for who in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def busy_fraction(seconds: float = 2.0) -> Optional[float]:
    a = cpu_busy_seconds()
    time.sleep(seconds)
    b = cpu_busy_seconds()
    return None if a is None else (b - a) / seconds / (os.cpu_count() or 1)


def wait_until_idle(limit: float) -> None:
    """Wait (up to `limit` seconds) for other processes to leave the CPUs alone: < 10% busy over 2 s."""
    deadline = time.time() + limit
    while time.time() < deadline:
        busy = busy_fraction()
        if busy is None or busy < 0.10:
            return
        print(f"   waiting for an idle machine ({busy:.0%} busy)", flush=True)
    print("   the machine stayed busy; measuring anyway", flush=True)


THREADS: dict[str, list[int]] = {}  # label -> busy threads of each rank (measured)


SPAWNED: dict[str, float] = {}  # label -> when the first rank process was created (epoch seconds)
CPU_SERIES: dict[str, dict[int, list]] = {}  # label -> rank -> [(time, CPU seconds of the rank so far)]
LAST_SEEN: dict[str, float] = {}  # label -> last time a rank process was seen alive (0.5 s resolution)


def thread_census(pid: int, stop, census: dict, label: str) -> None:
    """Every 0.5 s, the CPU time of every thread of every rank (a descendant with LOCAL_RANK in its environment)."""
    try:
        import psutil
    except ImportError:
        return
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    while not stop.is_set():
        try:
            kids = root.children(recursive=True)
        except psutil.Error:
            return
        for kid in kids:
            try:
                env = kid.environ()
                if "LOCAL_RANK" in env:
                    SPAWNED.setdefault(label, kid.create_time())
                    LAST_SEEN[label] = time.time()
                    rank = int(env.get("RANK", 0))
                    census[rank] = {t.id: t.user_time + t.system_time for t in kid.threads()}
                    times = kid.cpu_times()
                    CPU_SERIES.setdefault(label, {}).setdefault(rank, []).append(
                        (time.time(), times.user + times.system)
                    )
            except psutil.Error:
                pass
        stop.wait(0.5)


def cpu_between(label: str, start: float, end: float) -> Optional[float]:
    """CPU seconds all ranks of run `label` used between two wall-clock times (linear between 0.5 s samples).

    Unlike wall time, this hardly moves when other people's jobs share the cores, so it is the steadier
    figure on a busy machine (caches and memory bandwidth are still shared)."""
    total = 0.0
    for series in CPU_SERIES.get(label, {}).values():
        if len(series) < 2 or series[0][0] > start or series[-1][0] < end:
            return None

        def at(t, series=series):
            for (t0, c0), (t1, c1) in zip(series, series[1:]):
                if t0 <= t <= t1:
                    return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)
            return series[-1][1]

        total += at(end) - at(start)
    return total if CPU_SERIES.get(label) else None


def busy_threads(census: dict) -> list[int]:
    """Threads per rank that did real work: at least 10% of the CPU time of that rank's busiest thread."""
    out = []
    for rank in sorted(census):
        times = census[rank].values()
        top = max(times, default=0.0)
        out.append(sum(1 for t in times if top > 0 and t >= 0.1 * top))
    return out


OTHERS: dict[str, tuple[float, float]] = {}  # label -> (core-seconds other processes used during the run, run wall)


def gpu_state() -> Optional[str]:
    """The GPU as a run starts: busy, clock, temperature, power, and processes still holding memory (None: no
    nvidia-smi). The Trainer's step took 2.3x longer after phalanx than after TRL (RESULTS 2026-11-27 05:54): a
    process left behind, or a hot, clocked-down GPU, shows here."""
    if shutil.which("nvidia-smi") is None:
        return None

    def query(*args: str) -> list[str]:
        try:
            out = subprocess.run(
                ["nvidia-smi", *args, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return [f"nvidia-smi failed: {exc}"]
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    gpus = query("--query-gpu=utilization.gpu,clocks.sm,clocks_throttle_reasons.active,temperature.gpu,power.draw")
    apps = query("--query-compute-apps=pid,process_name,used_memory")
    return (
        f"GPU (busy, SM clock, throttle reasons, temperature, power): {'; '.join(gpus)}; "
        f"{len(apps)} process(es) holding GPU memory{': ' + '; '.join(apps) if apps else ''}"
    )


def run_logged(cmd: list[str], env: dict, log: Path, label: str) -> tuple[float, float, float]:
    """Run `cmd` with its output in `log`; return (wall seconds, launch time, exit time). Exit on failure with the log's tail."""
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    state = gpu_state()
    if state:
        print(f"   before {label}: {state}", flush=True)
    import threading

    for facts in (
        THREADS,
        SPAWNED,
        CPU_SERIES,
        LAST_SEEN,
        OTHERS,
    ):  # a label measured again (both orders) starts afresh
        facts.pop(label, None)

    busy0, ours0 = cpu_busy_seconds(), children_cpu_seconds()
    launched = time.time()
    start = time.perf_counter()
    census: dict = {}
    stop = threading.Event()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=thread_census, args=(proc.pid, stop, census, label), daemon=True)
        watcher.start()
        proc.wait()
        stop.set()
        watcher.join()
    wall = time.perf_counter() - start
    exited = time.time()
    THREADS[label] = busy_threads(census)
    if busy0 is not None:
        # CPU time the machine spent busy minus what this run's processes used: other people's work.
        OTHERS[label] = (max(0.0, (cpu_busy_seconds() - busy0) - (children_cpu_seconds() - ours0)), wall)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        sys.exit(f"{label} failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    others = OTHERS.get(label)
    print(
        f"   {label}: finished in {wall:.1f}s (log: {log}); busy threads per rank {THREADS[label]}"
        + (
            f"; other processes used {others[0]:.1f} core-s ({others[0] / (wall * (os.cpu_count() or 1)):.0%} of the machine)"
            if others
            else ""
        ),
        flush=True,
    )
    return wall, launched, exited


# ----------------------------------------------------------------------------- Trainer worker


def hf_worker(spec_path: str, kind: str = "hf") -> None:
    """One Trainer rank (started by torchrun). Writes {kind}-rank{R}.json next to the spec.

    kind "trl": TRL's SFTTrainer instead, as its docs recommend for speed: `padding_free=True` (its collator
    concatenates the micro-batch's rows, position ids restart per row) and, on CUDA with liger-kernel installed,
    `use_liger_kernel=True`; flash_attention_2 when importable, else sdpa (transformers derives the per-row causal
    mask from the position ids). The rows, their order and the labels are the same as Trainer's (the pre-tokenized
    `labels` column is used as is)."""
    import importlib.util
    import resource

    import datasets
    import torch
    import transformers
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from phalanx.data.collate import pad_batch
    from phalanx.data.rows import TokenizedRows

    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec_path).parent
    rank = int(os.environ.get("RANK", 0))
    cuda = spec["cuda"]
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()

    # The same tokenized rows as phalanx's, in the plan's order, as the datasets.Dataset Trainer and TRL expect.
    rows = datasets.Dataset.from_list(TokenizedRows.read(Path(spec["train_rows"])).__getitems__(spec["global_order"]))
    seen: list[list[int]] = []  # row lengths of every micro-batch this rank collated, in order

    def collate(examples):
        seen.append([len(e["input_ids"]) for e in examples])
        return pad_batch(examples, pad_token_id=spec["pad_token_id"])

    # Same seed before the adapter is created as phalanx (seed_everything, then load, then LoRA).
    transformers.set_seed(spec["seed"])
    dtype = torch.bfloat16 if cuda else torch.float32
    trl = kind == "trl"
    attn = {}
    if trl:
        attn = {
            "attn_implementation": "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
        }
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=dtype, **attn)
    model = get_peft_model(
        model,
        LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            r=spec["lora_r"],
            lora_alpha=spec["lora_alpha"],
            lora_dropout=spec["lora_dropout"],
            target_modules=spec["target_modules"],
        ),
    )

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.begin = None

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.time()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.time())

    clock = StepClock()
    liger = bool(trl and cuda and importlib.util.find_spec("liger_kernel"))
    if trl:
        from trl import SFTConfig

        Arguments = SFTConfig
        extra = {
            "padding_free": True,
            "use_liger_kernel": liger,
            "max_length": None,
            "packing": False,  # rows fit already
            "dataset_num_proc": None,
            # SFTConfig turns activation checkpointing on by default; phalanx and Trainer do not checkpoint here, so
            # TRL does not either (held equal, as its speed docs assume). The 2026-11-26 H100 row ran with it on.
            "gradient_checkpointing": False,
        }
    else:
        Arguments, extra = TrainingArguments, {}
    args = Arguments(
        output_dir=str(out_dir / f"{kind}-output"),
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"],
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=spec["steps"],
        seed=spec["seed"],
        logging_steps=spec["log_steps"],
        logging_first_step=True,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",  # the rows are already in phalanx's per-rank order
        dataloader_num_workers=0,
        dataloader_pin_memory=cuda,
        remove_unused_columns=False,
        ddp_backend="nccl" if cuda else "gloo",
        ddp_find_unused_parameters=False,
        ddp_broadcast_buffers=False,
        use_cpu=not cuda,
        bf16=cuda,
        **({"optim": spec["hf_optim"]} if spec.get("hf_optim") else {}),
        **extra,
    )
    if trl:
        from transformers import AutoTokenizer
        from trl import SFTTrainer

        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=rows,
            callbacks=[clock],
            processing_class=AutoTokenizer.from_pretrained(spec["model_path"]),
        )
        trl_collate = trainer.data_collator

        def recorded(examples):  # TRL's own padding-free collator; the lengths are recorded to check the rows
            seen.append([len(e["input_ids"]) for e in examples])
            return trl_collate(examples)

        trainer.data_collator = recorded
    else:
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[clock])
    start = time.time()
    result = trainer.train()
    end = time.time()
    trainer.save_model(str(out_dir / f"{kind}-output"))  # phalanx writes its final adapter too
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record = {
        "rank": rank,
        "threads": torch.get_num_threads(),
        "peak_memory_mb": peak,
        "step_ends": clock.ends,
        "train_begin": clock.begin,
        "train_start": start,
        "train_end": end,
        "micro_lengths": seen,
        "log_history": trainer.state.log_history,
        "train_runtime": result.metrics.get("train_runtime"),
        "optimizer": type(
            trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        ).__name__,
        "optim_arg": str(args.optim),
        "world_size": args.world_size,
        "liger": liger,
        "attn": attn.get("attn_implementation", "sdpa (default)"),
    }
    (out_dir / f"{kind}-rank{rank}.json").write_text(json.dumps(record))


# ----------------------------------------------------------------------------- phalanx under torchrun (+ profile)


def phalanx_worker(flags: list[str], profile_dir: Optional[str]) -> None:
    """`phalanx train FLAGS` in this torchrun rank; rank 0 runs under cProfile when asked."""
    from phalanx.cli import main

    rank = int(os.environ.get("RANK", 0))
    if profile_dir and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        code = prof.runcall(main, ["train", *flags])
        prof.dump_stats(str(Path(profile_dir) / "phalanx-rank0.prof"))
    else:
        code = main(["train", *flags])
    sys.exit(code)


def hf_worker_profiled(spec_path: str, profile_dir: Optional[str], kind: str = "hf") -> None:
    rank = int(os.environ.get("RANK", 0))
    if profile_dir and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.runcall(hf_worker, spec_path, kind)
        prof.dump_stats(str(Path(profile_dir) / f"{kind}-rank0.prof"))
    else:
        hf_worker(spec_path, kind)


# ----------------------------------------------------------------------------- results


def steady(step_ends: dict[int, float], plan: Plan, first: int, last: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) over steps first+1..last, timed from the end of step `first`."""
    tokens = sum(plan.step_tokens(s - 1) for s in range(first + 1, last + 1))
    seconds = step_ends[last] - step_ends[first]
    return tokens / seconds, tokens, seconds


def fmt(x, nd=1):
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def table(rows: list[tuple[str, str, str, str]]) -> str:
    head = ("", "phalanx", "HF Trainer", "phalanx/HF")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]

    def line(r):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *map(line, rows)])


def ratio(a, b, nd=2):
    return f"{a / b:.{nd}f}" if a and b else "n/a"


# ----------------------------------------------------------------------------- orchestration


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks for both runs (default 2 on CPU, the GPU count in gpu-shape mode)",
    )
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--batch_size", type=int, default=None, help="per-rank micro-batch (default 4)")
    p.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    p.add_argument(
        "--max_length",
        type=int,
        default=None,
        help="sequence cap in tokens (default 2048: the bundled rows whole, mean 944 tokens, max 1956)",
    )
    p.add_argument("--model", default="embedded:tiny-qwen3", help="model for both runs (phalanx model_name syntax)")
    p.add_argument(
        "--dataset_path", default=None, help="jsonl for both runs (default: phalanx's bundled health-agent chats)"
    )
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_steps", type=int, default=1, help="both log every this many steps (default 1)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the steady timing (default 2)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for both runs (default: unset, i.e. each launcher's own default)",
    )
    p.add_argument(
        "--phalanx-launcher",
        dest="phalanx_launcher",
        choices=["native", "torchrun"],
        default="native",
        help="native: `python -m phalanx train --world_size N` (what users run); torchrun: `torchrun -m phalanx`",
    )
    p.add_argument(
        "--only", choices=["both", "phalanx", "hf"], default="both", help="run one side only (for profiling)"
    )
    p.add_argument(
        "--hf-first",
        dest="hf_first",
        action="store_true",
        help="run Trainer first, one order only (same as --orders hf-first)",
    )
    p.add_argument(
        "--orders",
        choices=["both", "phalanx-first", "hf-first"],
        default=None,
        help="both (default): phalanx then Trainer, then Trainer then phalanx, reported per order and together",
    )
    p.add_argument(
        "--with-unpacked",
        dest="with_unpacked",
        action="store_true",
        help="also run phalanx with --packing false (its padded path) in each order, after phalanx",
    )
    p.add_argument(
        "--hf-optim",
        dest="hf_optim",
        default=None,
        help="Trainer's optim (default: Trainer's own default; phalanx uses torch.optim.AdamW)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="cProfile rank 0 of both runs into DIR (phalanx then runs under torchrun); timings are perturbed",
    )
    p.add_argument(
        "--gpu-shape",
        dest="gpu_shape",
        choices=sorted(GPU_SHAPES),
        default=None,
        help="random-weight model with this published shape, seq 2048, bf16 on CUDA, with MFU",
    )
    p.add_argument(
        "--gpu-shape-layers",
        dest="gpu_shape_layers",
        type=int,
        default=None,
        help="override the layer count of --gpu-shape (smoke tests, small GPUs)",
    )
    p.add_argument(
        "--host-proxy",
        dest="host_proxy",
        choices=sorted(GPU_SHAPES),
        default=None,
        help="CPU: that shape's layers and adapters at tiny widths (HOST_PROXY_WIDTHS) on short generated chats "
        "(max_length 256 unless given), so a step's time is the framework's own cost on the host: what bounds an "
        "eager GPU step at batch 4",
    )
    p.add_argument(
        "--peak-tflops",
        dest="peak_tflops",
        type=float,
        default=None,
        help="peak dense bf16 TFLOP/s per GPU for MFU (default: looked up from the GPU's name)",
    )
    p.add_argument(
        "--dry-run",
        dest="dry_run",
        action="store_true",
        help="print the plan (build the gpu-shape model on CPU) and stop",
    )
    p.add_argument("--work_dir", default="/tmp/phalanx-bench", help="scratch folder for outputs and logs")
    p.add_argument(
        "--wait-idle",
        dest="wait_idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each run, wait up to SECONDS for the CPUs to be idle (other people's jobs)",
    )
    p.add_argument(
        "--no-results", dest="no_results", action="store_true", help="do not append to benchmarks/RESULTS.md"
    )
    p.add_argument("--note", default="", help="free text added to the RESULTS.md entry")
    p.add_argument(
        "--with-trl",
        dest="with_trl",
        action="store_true",
        help="add TRL SFTTrainer with padding_free (and Liger kernels on CUDA when installed), same rows",
    )
    p.add_argument(
        "--phalanx-flags",
        dest="phalanx_flags",
        default="",
        help="more `phalanx train` flags for the phalanx runs only (one shell-quoted string), e.g. an A/B of a default",
    )
    p.add_argument("--_worker", choices=["hf", "trl", "phalanx"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_profile", default=None, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    args.rest = rest
    return args


def main(argv=None) -> None:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    sys.path.insert(0, str(SRC))
    if args._worker in ("hf", "trl"):
        return hf_worker_profiled(args._spec, args._profile, args._worker)
    if args._worker == "phalanx":
        return phalanx_worker([a for a in args.rest if a != "--"], args._profile)

    import torch

    gpu = args.gpu_shape is not None
    cuda = torch.cuda.is_available()
    if gpu and not cuda and not args.dry_run:
        sys.exit(
            "--gpu-shape needs a CUDA device (bf16 on GPU); add --dry-run to check the plan on a machine without one."
        )
    if args.host_proxy and gpu:
        sys.exit("--host-proxy and --gpu-shape are two different models; give one")
    nproc = args.nproc or ((max(torch.cuda.device_count(), 1) if cuda else 1) if gpu else 2)
    batch = args.batch_size or 4
    max_length = args.max_length or (256 if args.host_proxy else 2048)
    orders = (
        ["hf-first"]
        if args.hf_first and not args.orders
        else (["phalanx-first", "hf-first"] if (args.orders or "both") == "both" else [args.orders])
    )
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    commit = sh(f"git -C {ROOT} rev-parse --short HEAD") or "unknown"
    dirty = bool(sh(f"git -C {ROOT} status --porcelain -- src"))
    command = "python benchmarks/train_vs_hf.py" + ("" if not raw_argv else " " + shlex.join(raw_argv))

    print(
        f"== phalanx vs HF Trainer: {nproc} rank(s), {args.steps} steps, batch {batch}/rank, accumulation "
        f"{args.grad_accum}, max_length {max_length}, {'CUDA bf16' if gpu else 'CPU fp32'}"
    )
    print(
        f"   machine: nproc {os.cpu_count()}, {cpu_model()}, "
        f"{torch.cuda.get_device_name(0) if cuda else 'no GPU'}; commit {commit}{' (src/ modified)' if dirty else ''}; "
        f"load average {load_before}"
    )

    # -- model
    n_params, shape_values = None, None
    if gpu:
        if args.dry_run:
            print(f"-- gpu-shape {args.gpu_shape}: constructing on CPU (dry run)")
            n_params, shape_values = construct_gpu_shape_on_cpu(args.gpu_shape, args.gpu_shape_layers)
            model_path = str(work / f"{args.gpu_shape}-random")
        else:
            print(f"-- gpu-shape {args.gpu_shape}: writing a random-weight model folder (once)")
            model_path = str(
                build_gpu_shape_folder(
                    args.gpu_shape, work / f"{args.gpu_shape}-random", args.gpu_shape_layers, device="cuda"
                )
            )
    elif args.host_proxy:
        print(f"-- host proxy of {args.host_proxy}: its layers and adapters at widths {HOST_PROXY_WIDTHS}")
        model_path = str(
            build_gpu_shape_folder(
                args.host_proxy, work / f"{args.host_proxy}-host-proxy", args.gpu_shape_layers, widths=HOST_PROXY_WIDTHS
            )
        )
        args.dataset_path = args.dataset_path or str(write_short_chats(work / "host-proxy-chats.jsonl"))
    else:
        from phalanx.models.load import resolve_model_path

        model_path = resolve_model_path(args.model)
    model_flag = model_path if (gpu or args.host_proxy) else args.model

    # -- phalanx flags, and the same config phalanx will build from them
    flags = [
        "--model_name",
        model_flag,
        "--max_steps",
        str(args.steps),
        "--batch_size",
        str(batch),
        "--gradient_accumulation_steps",
        str(args.grad_accum),
        "--max_length",
        str(max_length),
        "--learning_rate",
        repr(args.learning_rate),
        "--lora_r",
        str(args.lora_r),
        "--lora_alpha",
        str(args.lora_alpha),
        "--lora_dropout",
        repr(args.lora_dropout),
        "--lora.target_modules",
        "all-linear",
        "--seed",
        str(args.seed),
        "--lr_scheduler",
        "linear",
        "--warmup_ratio",
        "0",
        "--weight_decay",
        "0",
        "--max_grad_norm",
        "1.0",
        "--test_size",
        "0",
        "--log_steps",
        str(args.log_steps),
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
        "--mixed_precision",
        "bf16" if gpu else "auto",  # auto = fp32 on CPU
        "--overwrite_output_dir",
        "true",
    ]
    if args.dataset_path:
        flags += ["--dataset_path", args.dataset_path]
    flags += shlex.split(args.phalanx_flags)

    import datasets

    datasets.disable_progress_bars()
    from phalanx.config.flags import split_flags
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.train.run import load_data

    cfg = load_config(None, overrides_from_flags(split_flags(flags)[1]))
    if args.dry_run and gpu and not Path(model_path).is_dir():
        # The folder is written only for a real run; plan the data with the same (embedded byte-level) tokenizer.
        cfg_data = load_config(
            None, overrides_from_flags(split_flags([*flags[:1], "embedded:tiny-qwen3", *flags[2:]])[1])
        )
        tokenizer, data = load_data(cfg_data)
    else:
        tokenizer, data = load_data(cfg)  # tokenize once, into phalanx's cache; both runs read these rows
    plan = make_plan(data.train, nproc, batch, args.grad_accum, args.steps, args.seed)
    if plan.short_groups or plan.uneven_micro:
        print(
            "   WARNING: the run crosses an epoch end with a short accumulation group or a short micro-batch; "
            "Trainer's batches then drift from phalanx's. Use fewer steps to compare identical data."
        )
    total_tokens = sum(plan.step_tokens(s) for s in range(args.steps))
    rows_used = sum(len(mb) for step in plan.steps for rank in step for mb in rank)
    if total_tokens / max(rows_used, 1) < 64:
        sys.exit(
            f"the rows average {total_tokens / max(rows_used, 1):.0f} tokens: the tokenizer in {model_path} does not "
            "encode the chats (check which tokenizer class AutoTokenizer loads there); timings would be meaningless."
        )
    print(
        f"-- data: {len(data.train)} rows tokenized once ({data.report.cache_dir}); {total_tokens:,} input tokens "
        f"({total_tokens / rows_used:.0f} per row on average) over the {args.steps} steps on all ranks, "
        f"{sum(plan.step_targets(s) for s in range(args.steps)):,} target tokens"
    )

    env = child_env(args.threads)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    native = args.phalanx_launcher == "native" and not args.profile
    if native:
        phalanx_cmd = [sys.executable, "-m", "phalanx", "train", *flags, "--world_size", str(nproc)]
    elif not args.profile:
        phalanx_cmd = [*torchrun(nproc), "-m", "phalanx", "train", *flags]
    else:
        phalanx_cmd = [
            *torchrun(nproc),
            str(Path(__file__)),
            "--_worker",
            "phalanx",
            "--_profile",
            args.profile,
            "--",
            *flags,
        ]
    spec_path = work / "hf-spec.json"
    hf_cmd = [
        *torchrun(nproc),
        str(Path(__file__)),
        "--_worker",
        "hf",
        "--_spec",
        str(spec_path),
        *(["--_profile", args.profile] if args.profile else []),
    ]

    flops_note = None
    if gpu:
        values = shape_values or dict(
            GPU_SHAPES[args.gpu_shape],
            **({"num_hidden_layers": args.gpu_shape_layers} if args.gpu_shape_layers else {}),
        )
        if n_params is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                n_params = matmul_parameters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)))
        layers = values["num_hidden_layers"]
        attn_width = values["hidden_size"]  # heads * head_dim = 12 * 128
        peak = args.peak_tflops or (peak_tflops_for(torch.cuda.get_device_name(0)) if cuda else None)
        flops_note = (
            f"MFU = model FLOPs / (seconds x ranks x peak). LoRA FLOPs per sequence of t tokens = "
            f"4*N*t + 12*L*(heads*head_dim)*t^2 with N = {n_params:,} base parameters (the output head once, the "
            f"input embedding not counted), L = {layers}, heads*head_dim = {attn_width}; "
            f"peak assumed: {f'{peak:g} TFLOP/s dense bf16 per GPU' if peak else 'unknown (pass --peak-tflops)'}"
        )
        print("-- " + flops_note)

    print("-- plan:")

    def omp(by_torchrun):
        return env.get("OMP_NUM_THREADS") or ("1 (torchrun's default)" if by_torchrun and nproc > 1 else "unset")

    print(
        f"   phalanx ({'native launcher' if native else 'torchrun'}, OMP_NUM_THREADS {omp(not native)}): {shlex.join(phalanx_cmd)}"
    )
    print(f"   Trainer (torchrun, OMP_NUM_THREADS {omp(True)}): {shlex.join(hf_cmd)}")
    if args.dry_run:
        print("-- dry run: nothing trained.")
        return

    spec = {
        "cuda": gpu,
        "model_path": model_path,
        "train_rows": str(Path(data.report.cache_dir) / "train.arrow"),
        "global_order": plan.global_order(),
        "pad_token_id": tokenizer.pad_token_id,
        "seed": args.seed,
        "batch_size": batch,
        "grad_accum": args.grad_accum,
        "learning_rate": args.learning_rate,
        "steps": args.steps,
        "log_steps": args.log_steps,
        "lora_r": args.lora_r,
        "lora_alpha": args.lora_alpha,
        "lora_dropout": args.lora_dropout,
        "target_modules": "all-linear",
        "hf_optim": args.hf_optim,
        "max_length": max_length,
    }
    spec_path.write_text(json.dumps(spec))

    def run_phalanx(label="phalanx", extra=()):
        if args.wait_idle:
            wait_until_idle(args.wait_idle)
        out = work / ("phalanx-output" if label == "phalanx" else "phalanx-unpacked-output")
        cmd = [*phalanx_cmd, *extra, "--output_dir", str(out)]
        log = work / f"{label.replace(' ', '-')}.log"
        return read_phalanx(out, plan, args, run_logged(cmd, env, log, label), data.report.cache_dir, log, label)

    def run_hf(kind="hf"):
        if args.wait_idle:
            wait_until_idle(args.wait_idle)
        for old in work.glob(f"{kind}-rank*.json"):
            old.unlink()
        label = "HF Trainer" if kind == "hf" else TRL
        cmd = (
            hf_cmd
            if kind == "hf"
            else [*hf_cmd[: hf_cmd.index("--_worker") + 1], "trl", *hf_cmd[hf_cmd.index("--_worker") + 2 :]]
        )
        return read_hf(work, plan, args, run_logged(cmd, env, work / f"{kind}.log", label), nproc, kind)

    pairs, entries = [], []
    for order in orders:
        sides = [s for s in (("phalanx", run_phalanx), ("hf", run_hf)) if args.only in ("both", s[0])]
        if args.with_unpacked and args.only in ("both", "phalanx"):
            sides.insert(1, ("unpacked", lambda: run_phalanx(UNPACKED, ("--packing", "false"))))
        if args.with_trl and args.only in ("both", "hf"):
            sides.append(("trl", lambda: run_hf("trl")))
        if order == "hf-first":
            sides.reverse()
        results, loads_between = {}, []
        for name, fn in sides:
            results[name] = fn()
            loads_between.append(load_average())
        px, hf, unpacked, trl = results.get("phalanx"), results.get("hf"), results.get("unpacked"), results.get("trl")
        loads = (load_before, loads_between[0], load_average())
        load_before = loads[2]
        if px and hf:
            pairs.append((order, px, hf, unpacked, trl))
            entries.append(
                report(
                    args,
                    px,
                    hf,
                    unpacked,
                    plan,
                    nproc,
                    batch,
                    max_length,
                    order,
                    loads,
                    flops_note,
                    n_params,
                    gpu,
                    cuda,
                    torch,
                    trl,
                )
            )
        for name, res in (("phalanx", px), (UNPACKED, unpacked), ("HF Trainer", hf), (TRL, trl)):
            if res:
                print(
                    f"{name}: steady {res['steady_tps']:,.0f} tok/s, {seconds_per_row(res, nproc, batch):.4f} s/row, "
                    f"wall {res['wall']:.1f}s, peak {res['peak']} MB/rank, first loss {res['first_loss']}"
                )
    if pairs:
        summary = order_summary(pairs, nproc, batch)
        print("\n" + "\n".join(summary))
        if not args.no_results:
            write_entry(args, entries, summary, nproc, batch, max_length, command, commit, dirty, gpu, cuda, torch)
    if args.profile:
        summarize_profiles(Path(args.profile))


UNPACKED = "phalanx --packing false"
TRL = "TRL SFTTrainer"


def seconds_per_row(res: dict, nproc: int, batch: int) -> float:
    """Steady seconds per training row (every rank reads `batch` rows per step; accumulation multiplies both)."""
    a, b = res["steady_steps"]
    return res["steady_seconds"] / (b - a + 1) / (nproc * batch * res.get("grad_accum", 1))


def order_summary(pairs: list, nproc: int, batch: int) -> list[str]:
    """Time per row, phalanx / Trainer, per order and as the geometric mean of the orders."""
    lines, ratios, unpacked_ratios, trl_ratios = [], [], [], []
    for order, px, hf, unpacked, trl in pairs:
        r = seconds_per_row(px, nproc, batch) / seconds_per_row(hf, nproc, batch)
        ratios.append(r)
        line = (
            f"- {order}: time per row phalanx {seconds_per_row(px, nproc, batch) * 1e3:.2f} ms, Trainer "
            f"{seconds_per_row(hf, nproc, batch) * 1e3:.2f} ms: **{r:.2f}x**"
        )
        if unpacked:
            u = seconds_per_row(unpacked, nproc, batch) / seconds_per_row(hf, nproc, batch)
            unpacked_ratios.append(u)
            line += f"; {UNPACKED} {seconds_per_row(unpacked, nproc, batch) * 1e3:.2f} ms ({u:.2f}x Trainer)"
        if trl:
            t = seconds_per_row(trl, nproc, batch) / seconds_per_row(hf, nproc, batch)
            trl_ratios.append(seconds_per_row(px, nproc, batch) / seconds_per_row(trl, nproc, batch))
            line += (
                f"; {TRL} ({trl_arm(trl)}) {seconds_per_row(trl, nproc, batch) * 1e3:.2f} ms ({t:.2f}x Trainer, "
                f"phalanx / TRL {trl_ratios[-1]:.2f}x)"
            )
        lines.append(line)
    geo = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
    lines.append(
        f"- time per row, phalanx / Trainer+PEFT, geometric mean of {len(ratios)} order(s): **{geo(ratios):.2f}x**"
        + (f"; {UNPACKED} / Trainer: {geo(unpacked_ratios):.2f}x" if unpacked_ratios else "")
        + (f"; phalanx / {TRL}: **{geo(trl_ratios):.2f}x**" if trl_ratios else "")
    )
    return lines


def trl_arm(res: dict) -> str:
    return (
        f"padding-free, {'Liger kernels' if res.get('liger') else 'no Liger (CUDA only; not installed or no GPU)'}, "
        f"{res.get('attn')}, no activation checkpointing"
    )


def read_phalanx(out: Path, plan: Plan, args, run: tuple, cache_dir: str, log: Path, label: str = "phalanx") -> dict:
    wall, launched, exited = run
    info = json.loads((out / "final_training_info.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    ends = {r["step"]: r["time"] for r in train}
    last = max(ends)
    first = min(s for s in ends if s >= args.warmup) if any(s >= args.warmup for s in ends) else min(ends)
    tps, tokens, seconds = steady(ends, plan, first, last)
    # Check that phalanx read the rows the plan says (target tokens per step add up to tokens_seen).
    expected_seen = sum(plan.step_targets(s) for s in range(last))
    same_rows = info["tokens_seen"] == expected_seen and cache_dir in log.read_text()
    return {
        "steady_tps": tps,
        "steady_tokens": tokens,
        "steady_seconds": seconds,
        "steady_steps": (first + 1, last),
        "wall": wall,
        "train_seconds": info["train_seconds"],
        "peak_list": info["peak_memory_mb_per_rank"],
        "peak": max(info["peak_memory_mb_per_rank"]),
        "first_loss": train[0]["loss"],
        "first_loss_steps": train[0]["step"],
        "last_loss": train[-1]["loss"],
        "data_check": same_rows,
        "steps": info["global_step"],
        "startup": ends[min(ends)] - launched,
        "teardown": exited - ends[last],
        "cpu_steady": cpu_between(label, ends[first], ends[last]),
        "grad_accum": args.grad_accum,
        "spawn": SPAWNED.get(label, launched) - launched,
        "after_ranks": exited - LAST_SEEN.get(label, exited),
    }


def read_hf(work: Path, plan: Plan, args, run: tuple, nproc: int, kind: str = "hf") -> dict:
    wall, launched, exited = run
    label = "HF Trainer" if kind == "hf" else TRL
    ranks = [json.loads((work / f"{kind}-rank{r}.json").read_text()) for r in range(nproc)]
    r0 = ranks[0]
    ends = {i + 1: t for i, t in enumerate(r0["step_ends"])}
    logs = [h for h in r0["log_history"] if "loss" in h]
    logged = sorted({h["step"] for h in logs} | {max(ends)})
    first = min((s for s in logged if s >= args.warmup), default=min(ends))
    last = max(ends)
    tps, tokens, seconds = steady(ends, plan, first, last)
    # The rows Trainer actually collated, per rank, against the plan (prefetching may add extra batches at the end).
    same = True
    for r, rec in enumerate(ranks):
        want = [[plan.lengths[i] for i in mb] for step in plan.steps for mb in step[r]]
        same &= rec["micro_lengths"][: len(want)] == want
    return {
        "steady_tps": tps,
        "steady_tokens": tokens,
        "steady_seconds": seconds,
        "steady_steps": (first + 1, last),
        "wall": wall,
        "train_seconds": r0["train_runtime"],
        "peak_list": [round(r["peak_memory_mb"], 1) for r in ranks],
        "peak": round(max(r["peak_memory_mb"] for r in ranks), 1),
        "first_loss": logs[0]["loss"] if logs else None,
        "first_loss_steps": logs[0]["step"] if logs else None,
        "last_loss": logs[-1]["loss"] if logs else None,
        "data_check": same,
        "threads": r0["threads"],
        "optimizer": f"{r0['optimizer']} ({r0['optim_arg']})",
        "steps": len(r0["step_ends"]),
        "startup": ends[min(args.log_steps, last)] - launched,
        "teardown": exited - ends[last],
        "cpu_steady": cpu_between(label, ends[first], ends[last]),
        "grad_accum": args.grad_accum,
        "spawn": SPAWNED.get(label, launched) - launched,
        "after_ranks": exited - LAST_SEEN.get(label, exited),
        "liger": r0.get("liger"),
        "attn": r0.get("attn"),
    }


def cpu_per_step(res: dict) -> Optional[float]:
    a, b = res["steady_steps"]
    return res["cpu_steady"] / (b - a + 1) if res.get("cpu_steady") else None


def tokens_per_cpu(res: dict) -> Optional[float]:
    return res["steady_tokens"] / res["cpu_steady"] if res.get("cpu_steady") else None


def report(
    args,
    px,
    hf,
    unpacked,
    plan,
    nproc,
    batch,
    max_length,
    order,
    loads,
    flops_note,
    n_params,
    gpu,
    cuda,
    torch,
    trl=None,
) -> list[str]:
    """Print one order's table; return its part of the RESULTS.md entry."""
    all_tokens = sum(plan.step_tokens(s) for s in range(args.steps))
    mem_label = "peak CUDA memory / rank, max (MB)" if gpu else "peak RSS / rank, max (MB)"
    s0, s1 = px["steady_steps"]
    rows = [
        (
            "seconds / row, steady (ms)",
            fmt(seconds_per_row(px, nproc, batch) * 1e3, 2),
            fmt(seconds_per_row(hf, nproc, batch) * 1e3, 2),
            ratio(seconds_per_row(px, nproc, batch), seconds_per_row(hf, nproc, batch)),
        ),
        (
            f"tokens/s, steady (steps {s0}-{s1})",
            fmt(px["steady_tps"], 0),
            fmt(hf["steady_tps"], 0),
            ratio(px["steady_tps"], hf["steady_tps"]),
        ),
        (
            "  seconds / step, steady",
            fmt(px["steady_seconds"] / (s1 - s0 + 1), 3),
            fmt(hf["steady_seconds"] / (hf["steady_steps"][1] - hf["steady_steps"][0] + 1), 3),
            ratio(
                px["steady_seconds"] / (s1 - s0 + 1),
                hf["steady_seconds"] / (hf["steady_steps"][1] - hf["steady_steps"][0] + 1),
            ),
        ),
        (
            "  CPU seconds / step, all ranks, steady",
            fmt(cpu_per_step(px), 3),
            fmt(cpu_per_step(hf), 3),
            ratio(cpu_per_step(px), cpu_per_step(hf)),
        ),
        (
            "  tokens / CPU second, steady",
            fmt(tokens_per_cpu(px), 0),
            fmt(tokens_per_cpu(hf), 0),
            ratio(tokens_per_cpu(px), tokens_per_cpu(hf)),
        ),
        (
            "tokens/s, whole run (launch to exit)",
            fmt(all_tokens / px["wall"], 0),
            fmt(all_tokens / hf["wall"], 0),
            ratio(hf["wall"], px["wall"]),
        ),
        ("  wall clock, whole run (s)", fmt(px["wall"]), fmt(hf["wall"]), ratio(px["wall"], hf["wall"])),
        (
            "  launch -> end of first logged step (s)",
            fmt(px["startup"]),
            fmt(hf["startup"]),
            ratio(px["startup"], hf["startup"]),
        ),
        (
            "    of which launch -> rank processes created (s)",
            fmt(px["spawn"]),
            fmt(hf["spawn"]),
            ratio(px["spawn"], hf["spawn"]),
        ),
        (
            "  end of last step -> exit (s)",
            fmt(px["teardown"]),
            fmt(hf["teardown"]),
            ratio(px["teardown"], hf["teardown"]),
        ),
        ("    of which last sight of a rank -> exit (s, +-0.5)", fmt(px["after_ranks"]), fmt(hf["after_ranks"]), ""),
        (
            "  train loop (s; phalanx train_seconds, HF train_runtime)",
            fmt(px["train_seconds"]),
            fmt(hf["train_seconds"]),
            ratio(px["train_seconds"], hf["train_seconds"]),
        ),
        (mem_label, fmt(px["peak"]), fmt(hf["peak"]), ratio(px["peak"], hf["peak"])),
        (
            "  per rank",
            " / ".join(fmt(float(x)) for x in px["peak_list"]),
            " / ".join(fmt(float(x)) for x in hf["peak_list"]),
            "",
        ),
        (
            f"loss, first log (step {px['first_loss_steps']})",
            f"{px['first_loss']:.5f}",
            f"{hf['first_loss']:.5f}" if hf["first_loss"] is not None else "n/a",
            ratio(px["first_loss"], hf["first_loss"], 4),
        ),
        (
            f"loss, last log (step {args.steps})",
            f"{px['last_loss']:.5f}",
            f"{hf['last_loss']:.5f}" if hf["last_loss"] is not None else "n/a",
            "",
        ),
        (
            "busy OS threads / rank (measured)",
            "/".join(map(str, THREADS.get("phalanx", []))) or "n/a",
            "/".join(map(str, THREADS.get("HF Trainer", []))) or "n/a",
            "",
        ),
        ("rows = plan (checked)", "yes" if px["data_check"] else "NO", "yes" if hf["data_check"] else "NO", ""),
    ]
    mfu_lines = []
    if gpu:
        peak_t = args.peak_tflops or (peak_tflops_for(torch.cuda.get_device_name(0)) if cuda else None)
        values = dict(
            GPU_SHAPES[args.gpu_shape],
            **({"num_hidden_layers": args.gpu_shape_layers} if args.gpu_shape_layers else {}),
        )
        for res in (px, hf, trl, unpacked):
            if res is None:
                continue
            a, b = res["steady_steps"]
            toks = sum(plan.step_tokens(s - 1) for s in range(a, b + 1))
            sq = sum(plan.step_sq_lengths(s - 1) for s in range(a, b + 1))
            flops = lora_flops(n_params, values["num_hidden_layers"], values["hidden_size"], toks, sq)
            res["tflops_per_gpu"] = flops / res["steady_seconds"] / nproc / 1e12
            res["mfu"] = res["tflops_per_gpu"] / peak_t if peak_t else None
        rows.insert(
            2,
            (
                "model TFLOP/s per GPU, steady",
                fmt(px["tflops_per_gpu"]),
                fmt(hf["tflops_per_gpu"]),
                ratio(px["tflops_per_gpu"], hf["tflops_per_gpu"]),
            ),
        )
        rows.insert(
            3,
            (
                "MFU, steady",
                f"{px['mfu']:.1%}" if px["mfu"] is not None else "n/a",
                f"{hf['mfu']:.1%}" if hf["mfu"] is not None else "n/a",
                ratio(px["mfu"], hf["mfu"]),
            ),
        )
        mfu_lines.append(flops_note)
    text = table(rows)
    loss_gap = (
        abs(px["first_loss"] - hf["first_loss"]) / max(abs(hf["first_loss"]), 1e-12)
        if hf["first_loss"] is not None
        else None
    )
    sanity = (
        f"first-step losses: phalanx {px['first_loss']:.6f}, Trainer {hf['first_loss']:.6f} "
        f"(relative gap {loss_gap:.2e}: {'agree' if loss_gap < 1e-3 else 'DISAGREE - the runs do not train the same thing'})"
        if loss_gap is not None
        else "first-step loss: Trainer logged none"
    )
    print("\n" + text)
    print(f"\nratios are phalanx / HF (for whole-run tokens/s, HF wall / phalanx wall); {sanity}")
    print(f"Trainer optimizer: {hf['optimizer']}; phalanx: torch.optim.AdamW (default, non-fused on CPU)")
    print(f"load average (1/5/15 min): before {loads[0]}, between runs {loads[1]}, after {loads[2]}")
    print(f"other processes' CPU use during the runs: {others_text()}")
    for line in mfu_lines:
        print(line)
    first = {"phalanx-first": "phalanx ran first", "hf-first": "Trainer ran first"}[order]
    entry = [
        f"\n#### {first}\n",
        f"- load average (1/5/15 min): before {loads[0]}, between runs {loads[1]}, after {loads[2]}; "
        f"other processes' CPU use during the runs: {others_text()}",
        f"- {sanity}",
    ]
    if unpacked:
        u, p_ = seconds_per_row(unpacked, nproc, batch), seconds_per_row(px, nproc, batch)
        entry.append(
            f"- {UNPACKED}: {u * 1e3:.2f} ms per row ({unpacked['steady_tps']:,.0f} tokens/s steady, first loss "
            f"{unpacked['first_loss']:.6f}); packed / unpacked time per row {p_ / u:.2f}"
        )
    if trl:
        t, p_, h = (seconds_per_row(r, nproc, batch) for r in (trl, px, hf))
        mfu = f", MFU {trl['mfu']:.1%}" if trl.get("mfu") is not None else ""
        entry.append(
            f"- {TRL} ({trl_arm(trl)}): {t * 1e3:.2f} ms per row ({trl['steady_tps']:,.0f} tokens/s steady{mfu}, "
            f"peak {trl['peak']} MB/rank, first loss {trl['first_loss']}, rows = plan: "
            f"{'yes' if trl['data_check'] else 'NO'}); TRL / Trainer time per row {t / h:.2f}, phalanx / TRL "
            f"{p_ / t:.2f}"
        )
    return [*entry, *(f"- {line}" for line in mfu_lines), "", text, ""]


def model_description(args, gpu: bool) -> str:
    if gpu:
        return f"{args.gpu_shape} shape (random weights)"
    if args.host_proxy:
        return (
            f"host proxy of {args.host_proxy} (its layers and adapters at widths {HOST_PROXY_WIDTHS}, random weights) "
            f"on short generated chats"
        )
    return args.model


def write_entry(args, entries, summary, nproc, batch, max_length, command, commit, dirty, gpu, cuda, torch) -> None:
    device = torch.cuda.get_device_name(0) if cuda else "no GPU"
    head = [
        f"\n### {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} - {nproc} rank(s), {'CUDA bf16' if gpu else 'CPU fp32'}, "
        f"{args.steps} steps, batch {batch}/rank, accumulation {args.grad_accum}, max_length {max_length}\n",
        f"- machine: nproc {os.cpu_count()}, CPU {cpu_model()}, {device}; torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}, peft {__import__('peft').__version__}",
        f"- commit: {commit}{' (with uncommitted changes under src/)' if dirty else ''}",
        f"- command: `{command}`",
        f"- model: {model_description(args, gpu)}; LoRA r {args.lora_r}, alpha {args.lora_alpha}, "
        f"dropout {args.lora_dropout}, all-linear; lr {args.learning_rate}; phalanx launched "
        f"{'natively (--world_size)' if args.phalanx_launcher == 'native' and not args.profile else 'under torchrun'} with its "
        f"defaults (packed micro-batches, target-only head), Trainer under torchrun (padded)",
        *([f"- note: {args.note}"] if args.note else []),
        *summary,
    ]
    with RESULTS.open("a") as f:
        if f.tell() == 0:
            f.write(
                "# Benchmark results\n\nEach script in `benchmarks/` appends dated entries here, newest last. "
                "Timings are reported, never asserted.\n"
            )
        f.write("\n".join(head + [line for entry in entries for line in entry]))
    print(f"appended to {RESULTS}")


def others_text() -> str:
    if not OTHERS:
        return "n/a"
    cores = os.cpu_count() or 1
    return ", ".join(
        f"{label} run {sec:.1f} core-s ({sec / (wall * cores):.0%} of the machine)"
        for label, (sec, wall) in OTHERS.items()
    )


def summarize_profiles(folder: Path, top: int = 25) -> None:
    import pstats

    for name in ("phalanx-rank0.prof", "hf-rank0.prof"):
        path = folder / name
        if path.is_file():
            print(f"\n== {name}: top {top} by cumulative time")
            pstats.Stats(str(path)).sort_stats("cumulative").print_stats(top)


if __name__ == "__main__":
    main()
