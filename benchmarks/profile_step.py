"""Where a `phalanx train` step spends its time: torch.profiler over a short one-process run, as tables.

The run is `phalanx train FLAGS` in this process (one rank). Model loading, tokenization and the first `--skip`
steps are left out: the profiler starts when step `--skip` ends and stops after the last. Printed: the GPU kernels
(or CPU ops) by their own time, the operators by their own CPU time (host work, launches, syncs), how many kernels
the host launched per step, and the share of the profiled wall time the device was busy. Timings under the
profiler are perturbed; the tables say where time goes, not how fast a step is (benchmarks/phalanx_arms.py does).

  python benchmarks/profile_step.py -- --model_name /tmp/phalanx-bench/r1-distill-qwen-1.5b-random --max_steps 6 \\
      --batch_size 4 --max_length 2048 --mixed_precision bf16 --output_dir /tmp/prof-run --overwrite_output_dir true
  .venv/bin/python benchmarks/profile_step.py --skip 1 -- --model_name embedded:tiny-qwen3 --max_steps 3 \\
      --output_dir /tmp/prof-run --overwrite_output_dir true        # CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


class SyncCallers:
    """Counts the Python callers of every call that makes the host wait for the device, while started: torch's sync
    debug mode warns at each one (`.item()`, `.tolist()`, nonzero, a copy to the host or from pageable memory), and
    the warning hook records the innermost frames outside torch. The operator tables say how many syncs a step has,
    not where they come from."""

    FRAMES = 4

    def __init__(self) -> None:
        self.counts: dict[tuple[str, ...], int] = {}
        self._hook = None

    def start(self) -> None:
        import warnings

        import torch

        self._hook = warnings.showwarning
        warnings.showwarning = self._record
        warnings.simplefilter("always")  # each occurrence, not once per call site
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        import warnings

        import torch

        if self._hook is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._hook
        self._hook = None

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        import traceback

        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if "/torch/" not in f.filename and not f.filename.endswith("warnings.py") and f.filename != __file__
        ]
        key = tuple(f"{f.filename}:{f.lineno} {f.name}" for f in frames[-self.FRAMES :][::-1]) or (str(message),)
        self.counts[key] = self.counts.get(key, 0) + 1

    def report(self, steps: int, rows: int) -> None:
        total = sum(self.counts.values())
        print(
            f"\n== host waits for the device: {total / max(steps, 1):,.1f} per step, by Python caller (innermost first)"
        )
        for key, count in sorted(self.counts.items(), key=lambda kv: -kv[1])[:rows]:
            print(f"   {count / max(steps, 1):8.1f}  {key[0]}")
            for frame in key[1:]:
                print(f"             {frame}")


def max_steps(flags: list[str]) -> int | None:
    """The run's --max_steps, where the flags give it."""
    for i, flag in enumerate(flags):
        if flag == "--max_steps" and i + 1 < len(flags):
            return int(flags[i + 1])
        if flag.startswith("--max_steps="):
            return int(flag.split("=", 1)[1])
    return None


WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def wait_operators(prof, steps: int, rows: int, calls: tuple[str, ...] = WAIT_CALLS) -> None:
    """The runtime calls that wait for the device or copy across it, by the operators that made them (innermost
    first) and the nearest Python frame outside torch: the sync debug mode sees only forward-pass callers (a
    backward's warnings are replayed at its end), the profiler's event tree sees the backward's operators too."""
    try:
        counts: dict[tuple[str, ...], int] = {}
        for event in prof.events():
            if event.name not in calls:
                continue
            ops, frames, parent = [], [], event.cpu_parent
            while parent is not None and len(frames) < 2:
                name = parent.name
                if ".py(" in name:  # a Python frame (with_stack): the nearest two outside torch are kept
                    if not name.startswith("torch/") and "/torch/" not in name:
                        frames.append(name)
                elif not name.startswith(("<built-in", "cuda", "cu")) and len(ops) < 3:
                    ops.append(name)
                parent = parent.cpu_parent
            key = (event.name, " <- ".join(ops) or "(no operator)", " <- ".join(frames) or "(no Python frame)")
            counts[key] = counts.get(key, 0) + 1
        print("\n== runtime waits and copies by operator (innermost first), per step")
        for (name, ops, frame), count in sorted(counts.items(), key=lambda kv: -kv[1])[:rows]:
            print(f"   {count / max(steps, 1):8.1f}  {name}  {ops}\n             {frame}")
    except Exception as exc:  # noqa: BLE001 - a report only: the tables above stand without it
        print(f"\n== runtime waits by operator: not available ({type(exc).__name__}: {exc})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip", type=int, default=2, help="steps left out before profiling (warm-up; default 2)")
    p.add_argument("--rows", type=int, default=25, help="rows per table (default 25)")
    p.add_argument("--trace", default=None, help="also write a Chrome trace (JSON) here")
    p.add_argument(
        "--waits",
        action="store_true",
        help="CUDA: also print where the profiled steps made the host wait for the device (each synchronizing call's "
        "Python caller, from torch.cuda.set_sync_debug_mode), by count per step",
    )
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the `phalanx train` flags")
    args = p.parse_args(argv)
    flags = [f for f in args.flags if f != "--"]

    import torch
    from torch.profiler import ProfilerActivity, profile

    import phalanx.train.loop as loop
    from phalanx.cli import main as phalanx_main

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # --waits: Python stacks too, so each host wait can be traced to the operator and the code that made it.
    prof = profile(activities=activities, with_stack=args.waits)
    state = {"steps": 0, "started": None, "wall": None}
    original = loop.train_step
    last = max_steps(flags)

    def stop() -> None:
        if state["started"] is not None and state["wall"] is None:
            if cuda:
                torch.cuda.synchronize()
            state["wall"] = time.perf_counter() - state["started"]
            prof.stop()
            waits.stop()

    def counted_step(*a, **k):  # the profiler runs from the end of step `skip` to the end of the last step
        out = original(*a, **k)
        state["steps"] += 1
        if state["steps"] == args.skip:
            if cuda:
                torch.cuda.synchronize()
                if args.waits:
                    waits.start()
            prof.start()
            state["started"] = time.perf_counter()
        elif state["steps"] == last:
            # Here, not after the run: the final model save (a host copy per adapter tensor) is no part of a step.
            stop()
        return out

    waits = SyncCallers()
    loop.train_step = counted_step
    code = phalanx_main(["train", *flags])
    if state["started"] is None:
        sys.exit(f"the run ended after {state['steps']} step(s), before profiling began (--skip {args.skip})")
    stop()  # a run that ended before --max_steps (or without one): at its end
    wall = state["wall"]
    steps = state["steps"] - args.skip
    events = prof.key_averages()
    device_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"\n== {steps} step(s) profiled, {wall:.2f} s wall ({wall / max(steps, 1):.3f} s/step under the profiler)")
    if cuda:
        busy = sum(e.self_device_time_total for e in events) / 1e6
        # Launches as the host made them (runtime and driver API calls), not device-side events, which the
        # averages list twice (the aten op and its kernel).
        launches = sum(e.count for e in events if e.key.startswith(("cudaLaunch", "cuLaunch")))
        print(
            f"   device busy {busy:.2f} s of {wall:.2f} s ({busy / wall:.0%}); {launches / max(steps, 1):,.0f} kernel "
            "launches per step"
        )
    print(f"\n== by own {'device' if cuda else 'CPU'} time")
    print(events.table(sort_by=device_key, row_limit=args.rows, max_name_column_width=70))
    if cuda:
        print("\n== by own CPU time (host work, launches, waits)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.waits:
        if cuda:
            waits.report(steps, args.rows)
            wait_operators(prof, steps, args.rows)
        else:
            print("\n== --waits: no CUDA device, nothing synchronizes")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    sys.exit(code)


if __name__ == "__main__":
    main()
