"""Helpers the tests share: run the CLI as a user would, read metrics back."""

import contextlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]


def phalanx_env(env: dict | None = None) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def start_phalanx(
    *args: str, output: bool = True, new_session: bool = False, stderr_to: Path | None = None
) -> subprocess.Popen:
    """Start `python -m phalanx ARGS` in the background (to signal or kill it mid-run); text stdout/stderr pipes,
    or none (`output=False`); `new_session`: its own process group, so the test can signal the whole tree;
    `stderr_to`: stderr written to that file (read while it runs) and stdout dropped."""
    pipe = subprocess.PIPE if output else subprocess.DEVNULL
    if stderr_to is not None:
        with open(stderr_to, "w") as sink:
            return subprocess.Popen(
                [sys.executable, "-m", "phalanx", *args],
                cwd=ROOT,
                env=phalanx_env(),
                stdout=subprocess.DEVNULL,
                stderr=sink,
                start_new_session=new_session,
            )
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx", *args],
        cwd=ROOT,
        env=phalanx_env(),
        stdout=pipe,
        stderr=pipe,
        text=True,
        start_new_session=new_session,
    )


def run_phalanx(
    *args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m phalanx ARGS` as a user would; returns the completed process (never raises on failure)."""
    full_env = phalanx_env(env)
    return subprocess.run(
        [sys.executable, "-m", "phalanx", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """A folder `build(folder)` fills once per test session, whichever xdist worker asks first; the others wait for
    it and reuse it (a 2-rank reference run costs each worker ~15 s of the suite's two cores). Read-only to its
    users: a test that changes it copies it first. A build that fails leaves no folder, so the next asker retries
    (and fails with its own message)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-xdist: each worker's basetemp is a folder of the session's
    folder, done = root / "built-once" / name, root / "built-once" / f"{name}.done"
    folder.parent.mkdir(exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder


# A short training run on the embedded model: few steps, small rows, nothing logged but metrics.jsonl, no eval or save
# unless a test asks. Tests state only what they change (tiny_run), so what a test is about stays visible.
TINY_RUN: dict[str, object] = {
    "max_steps": 5,
    "log_steps": 1,
    "eval_steps": 100,
    "save_steps": 100,
    "test_size": 0,
    "lora_dropout": 0,
    "learning_rate": 1e-2,
    "max_length": 768,
    "lora_r": 4,
    "logging.progress_bar": False,
    "logging.tensorboard": False,
    "logging.loss_curve": False,  # matplotlib's import and a plot: ~1 s of every run (tests/test_cli.py draws one)
}


def preempted_at(text: str, signal_name: str = "SIGTERM") -> int:
    """The step a preempted run's output says it stopped at, committing checkpoint-{step} there. A signal that comes
    just after checkpoint-N is committed may find the ranks before step N+1 starts: they stop at N."""
    found = re.search(rf"preempted \({signal_name}\) at step (\d+); checkpoint-\1 saved", text)
    assert found, text[-3000:]
    return int(found[1])


def tiny_run(changes: dict[str, object] | None = None) -> list[str]:
    """`phalanx train` flags of a tiny run: TINY_RUN with `changes` applied (a value of None leaves that flag out)."""
    fields = {**TINY_RUN, **(changes or {})}
    flags = []
    for name, value in fields.items():
        if value is not None:
            flags += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def trained_runs(tok, example: dict) -> list[str]:
    """Each contiguous run of trained tokens of a tokenized row, decoded (labels are the ids, or -100)."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        assert label in (-100, token)
        if label != -100:
            current.append(label)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(run) for run in runs]


def shared_template(name: str) -> Path:
    """A real model's chat template (test data, not ours to ship) from the shared folder beside the repository
    (tests/data/templates finds it). Missing is a failure, never a skip."""
    from data.templates import SHARED_ENV, shared_templates_dir

    path = shared_templates_dir() / f"{name}.jinja"
    assert path.is_file(), (
        f"{path} is missing: the real chat templates live in shared/templates beside the "
        f"repository (set {SHARED_ENV} to their folder)"
    )
    return path


def stopped_after(run: Path, step: int, dest: Path) -> Path:
    """A copy of a finished run's folder as a run stopped (killed, preempted) after committing checkpoint-{step}
    leaves it: no later checkpoint-N, no final model; the records it logged after `step` stay, as a killed run's
    do (the resume cuts them). The runs are deterministic, so checkpoint-{step} is byte for byte what a run killed
    in step {step}+1 would hold: resuming the copy tests the resume without paying for a second run up to there."""
    import shutil

    from phalanx.checkpoint.commit import committed_step_checkpoints
    from phalanx.checkpoint.resume import FINAL_OUTPUTS

    shutil.copytree(run, dest)
    for later, folder in committed_step_checkpoints(dest):
        if later > step:
            shutil.rmtree(folder)
    for name in FINAL_OUTPUTS:
        (dest / name).unlink(missing_ok=True)
    assert [s for s, _ in committed_step_checkpoints(dest)][-1:] == [step], f"{run} committed no checkpoint-{step}"
    return dest


def read_metrics(output_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def chat_row(i: int) -> dict:
    """A small tool-calling conversation whose numbers vary with i (so rows differ in length)."""
    weight, height = 50 + i % 40, 150 + i % 35
    bmi = round(weight / (height / 100) ** 2, 1)
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "get_bmi", "arguments": json.dumps({"weight_kg": weight, "height_cm": height})},
    }
    return {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_bmi",
                    "description": "Body-mass index",
                    "parameters": {
                        "type": "object",
                        "properties": {"weight_kg": {"type": "number"}, "height_cm": {"type": "number"}},
                        "required": ["weight_kg", "height_cm"],
                    },
                },
            }
        ],
        "messages": [
            {"role": "system", "content": "You are a careful health assistant."},
            {
                "role": "user",
                "content": f"I weigh {weight} kg and I am {height} cm tall. What is my BMI?" + " Thanks!" * (i % 3),
            },
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"bmi": bmi})},
            {
                "role": "assistant",
                "content": f"Your BMI is {bmi}." + (" That is in the healthy range." if 18.5 <= bmi < 25 else ""),
            },
        ],
    }


def write_chat_jsonl(path: Path, rows: int, start: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(start, start + rows):
            f.write(json.dumps(chat_row(i)) + "\n")
    return path


def gone_pid() -> int:
    """The id of a process that has ended: what a writer killed with SIGKILL leaves in its file names."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torch starts its ranks in sessions of their own, so killpg misses them)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Payload:
    """Unpickling this runs `touch marker`, as a malicious checkpoint would run anything."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_payload(path: Path, marker: Path) -> None:
    """Replace a checkpoint file with a pickle whose loading would create `marker` (DCP's .metadata is a plain
    pickle, the rest torch.save files)."""
    import torch

    if path.name == ".metadata":
        path.write_bytes(pickle.dumps(Payload(marker), protocol=4))
    else:
        torch.save({"state": Payload(marker)}, path)


@contextlib.contextmanager
def lock_held_elsewhere(lock_file: Path) -> Iterator[int]:
    """Another process holds `lock_file` (runtime.output_lock) while the block runs; yields its pid. It is SIGKILLed
    after, so no clean-up of its own runs: the kernel alone lets go of the lock."""
    code = "import sys, time; from phalanx.runtime.output_lock import hold_lock; hold_lock(sys.argv[1], 'x'); print(1, flush=True); time.sleep(600)"
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(lock_file)], stdout=subprocess.PIPE, text=True, env=phalanx_env()
    )
    try:
        assert holder.stdout.readline().strip() == "1", "the holder did not take the lock"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def catches_stop_signals(pid: int) -> bool:
    """True once `pid` (a phalanx process) has installed its stop-signal handler: Python catches SIGINT from its
    first moment, SIGUSR1 only once runtime.signals.PreemptionFlag is installed (with SIGINT's handler)."""
    from phalanx.launch.local import catches_stop_signals as catches

    return catches(pid)


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until the file `path` (a process's captured output) holds `text`; fail if `proc` ends first."""
    import time

    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, (
            f"ended with {proc.returncode} before printing {text!r}:\n{path.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"{text!r} not printed within {timeout} s:\n{path.read_text()[-3000:]}"
        time.sleep(0.05)


def ctrl_c_twice_while_starting(proc: subprocess.Popen, stderr: Path, ranks: Callable[[], list[int]]) -> float:
    """Press Ctrl-C twice as a terminal does (SIGINT to the foreground process group, `proc`'s) while the ranks
    start: once they catch stop signals, then again once rank 0 has answered the first. Starting takes seconds,
    so the second press comes long before a save could. Returns the time of the second press."""
    import signal
    import time

    deadline = time.monotonic() + 120
    while not ((pids := ranks()) and all(catches_stop_signals(pid) for pid in pids)):
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    wait_for_text(stderr, "press Ctrl-C again", proc, 30)
    time.sleep(0.5)  # every rank has answered it too (rank 0 alone prints)
    os.killpg(proc.pid, signal.SIGINT)
    return time.monotonic()


# DeepSeek-R1-Distill-Qwen-1.5B's shape, as benchmarks/train_vs_hf.py's GPU_SHAPES builds it for the GPU runs: a
# config.json is all `phalanx plan`'s memory model reads (tests/plan, tests/train/test_merge.py).
R1_DISTILL_SHAPE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "torch_dtype": "bfloat16",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}


def chatml_bpe_tokenizer(corpus: list[str], vocab_size: int = 500):
    """A real fast (Rust) byte-level BPE tokenizer with ChatML's special tokens, trained on `corpus` in milliseconds;
    <|im_end|> ends a sequence, <|endoftext|> pads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
