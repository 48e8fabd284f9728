"""Rank-0 reporting: metrics.jsonl, TensorBoard events, console lines and a progress bar.

Every method is safe to call on every rank; only rank 0 writes or prints, so the loop
does not need `if rank == 0` around each report. The bar is drawn only on a terminal: in a
log file (a SLURM .out, a pipe) its redraws pile up, so there each logged train step gets
one plain line instead.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from phalanx.checkpoint.layout import METRICS_FILE, TENSORBOARD_DIR
from phalanx.runtime.durable import write_bytes_atomic


class Reporter:
    def __init__(
        self,
        output_dir: Path,
        *,
        is_main: bool,
        total_steps: int,
        tensorboard: bool,
        progress_bar: bool,
        resume_step: int = 0,
    ):
        self.is_main = is_main
        self.history: list[dict] = []
        self._jsonl = None
        self._tb = None
        self._bar: Optional[tqdm] = None
        self._bar_args: Optional[dict] = None
        self._plain = False  # progress as one line per logged train step (stdout is no terminal)
        self._total, self._initial, self._started = total_steps, resume_step, time.perf_counter()
        if not is_main:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.history = keep_until(output_dir / METRICS_FILE, resume_step)
        self._jsonl = open(output_dir / METRICS_FILE, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a crashed run logged after the checkpoint it resumes from
            self._tb = SummaryWriter(
                log_dir=str(output_dir / TENSORBOARD_DIR), purge_step=resume_step + 1 if resume_step else None
            )
        self._plain = progress_bar and not sys.stdout.isatty()
        if progress_bar and not self._plain:
            self._bar_args = dict(
                total=total_steps, initial=resume_step, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout
            )

    def say(self, line: str) -> None:
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def log(self, step: int, metrics: dict, kind: str) -> None:
        """Record metrics of `kind` ('train', 'eval', 'epoch') at optimizer step `step`."""
        if not self.is_main:
            return
        record = {"kind": kind, "step": step, "time": time.time(), **metrics}
        self.history.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
        if self._plain and kind == "train":
            print(self._progress_line(step, metrics), flush=True)

    def _progress_line(self, step: int, metrics: dict) -> str:
        """'step 4/8 (50%) | loss 1.2345 | lr 1.00e-02 | grad_norm 0.512 | 812 tok/s | 00:04 elapsed, ~00:04 left'"""
        parts = [f"step {step}/{self._total} ({100 * step // max(self._total, 1)}%)" if self._total else f"step {step}"]
        for key, form in (("loss", "{:.4f}"), ("lr", "{:.2e}"), ("grad_norm", "{:.3f}")):
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{key} {form.format(metrics[key])}")
        if isinstance(metrics.get("tokens_per_s"), (int, float)):
            parts.append(f"{metrics['tokens_per_s']:.0f} tok/s")
        elapsed, done = time.perf_counter() - self._started, step - self._initial
        timing = f"{tqdm.format_interval(elapsed)} elapsed"
        if self._total and done > 0:
            timing += f", ~{tqdm.format_interval(elapsed / done * max(self._total - step, 0))} left"
        return " | ".join(parts + [timing])

    def advance(self, steps: int, postfix: dict) -> None:
        if self._bar is None and self._bar_args is not None:
            self._bar = tqdm(**self._bar_args)  # created at the first step, after the start-up lines
        if self._bar is not None:
            self._bar.update(steps)
            self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        """Flush and close the outputs; safe to call again (the CLI also closes a run that failed)."""
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._bar = self._tb = self._jsonl = None
        self._bar_args = None


def read_records(path: Path) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl and the number of lines that are none: a line cut short (the node died, or the
    disk filled, while it was written) or not ours. A crashed run's file may end in one; it must not stop the rerun."""
    records, torn = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif line.strip():
            torn += 1
    return records, torn


def last_logged_step(output_dir: Path) -> int:
    """The last step output_dir/metrics.jsonl logged (0 when none): what a crashed run got to, said when it starts over."""
    try:
        return max((record["step"] for record in read_records(output_dir / METRICS_FILE)[0]), default=0)
    except OSError:
        return 0


def keep_until(path: Path, step: int) -> list[dict]:
    """Records up to `step` (what a resumed run continues from); later ones, from a crashed run, are dropped, and so
    are lines cut short by a crash mid-write (said on stdout)."""
    if not path.is_file():
        return []
    records, torn = read_records(path)
    kept = [r for r in records if r["step"] <= step]
    if torn:
        print(f"{path}: dropped {torn} line(s) that hold no record (cut short by a crash while being written)")
    # Atomic and fsynced: the records a resumed run continues from must survive a crash right after this rewrite.
    write_bytes_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8"))
    return kept
