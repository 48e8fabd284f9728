"""A rank's start-up with and without runtime.collector: the CPU its imports take, and its last full collection.

Each repetition starts two fresh interpreters, one after the other, in alternating order: both import what a
training rank imports (phalanx.train.run: torch, transformers, peft), one with full collections deferred
(`defer_full_collections`, then `startup_done`: what `python -m phalanx` does), one with the collector as Python
sets it. Each reports its CPU seconds (user + system) at the end of the imports, the full collections that ran in
them, and how long one `gc.collect()` then takes (runtime.dist.shutdown's, before a rank leaves its process group).
Medians over the repetitions; reported, never asserted.

    python benchmarks/startup.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

CHILD = """
import gc, json, resource, sys, time
deferred = sys.argv[1] == "deferred"
if deferred:
    from phalanx.runtime.collector import defer_full_collections, startup_done
    defer_full_collections()
full = gc.get_stats()[2]["collections"]
import phalanx.train.run  # noqa: F401  (torch, transformers, peft: what a rank imports before build_run)
usage = resource.getrusage(resource.RUSAGE_SELF)
full = gc.get_stats()[2]["collections"] - full
if deferred:
    startup_done()
start = time.perf_counter()
gc.collect()
print(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime, "full_collections": full,
                  "collect_s": time.perf_counter() - start}))
"""


def one(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> str:
    import os
    import platform

    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return f"CPU ({model}, nproc {os.cpu_count()}); Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"deferred": [], "python": []}
    for i in range(args.repeats):
        for mode in ("deferred", "python") if i % 2 == 0 else ("python", "deferred"):
            runs[mode].append(one(mode))
    med = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for mode, rs in runs.items()}
    d, p = med["deferred"], med["python"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"### {datetime.now(timezone.utc):%Y-%m-%d %H:%M} - rank start-up (benchmarks/startup.py), {args.repeats} "
        "repetitions",
        "",
        f"- machine: {machine()}",
        f"- commit: {commit}; command: `python benchmarks/startup.py --repeats {args.repeats}`",
        "",
        "|                                         | deferred (phalanx) | Python's collector | deferred/Python |",
        "|-----------------------------------------|--------------------|--------------------|-----------------|",
        f"| CPU seconds of the imports (median)     | {d['cpu_s']:18.2f} | {p['cpu_s']:18.2f} | "
        f"{d['cpu_s'] / p['cpu_s']:15.2f} |",
        f"| full collections during them (median)   | {d['full_collections']:18.0f} | {p['full_collections']:18.0f} |"
        "                 |",
        f"| one gc.collect() afterwards (ms)        | {1000 * d['collect_s']:18.1f} | {1000 * p['collect_s']:18.1f} |"
        "                 |",
        "",
        "- CPU seconds per repetition: deferred "
        + ", ".join(f"{r['cpu_s']:.2f}" for r in runs["deferred"])
        + "; Python's "
        + ", ".join(f"{r['cpu_s']:.2f}" for r in runs["python"]),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    with open(args.results, "a", encoding="utf-8") as out:
        out.write("\n" + text)


if __name__ == "__main__":
    main()
