"""runtime.collector: full collections wait while the program imports its libraries, then the collector runs as
usual over what the run makes (a fresh interpreter per case: the tests' own process never defers)."""

import subprocess
import sys

from helpers import phalanx_env

PROGRAM = """
import gc
from phalanx.runtime.collector import defer_full_collections, startup_done
default = gc.get_threshold()
defer_full_collections()
full_before = gc.get_stats()[2]["collections"]
import torch, transformers  # noqa: E401, F401  (hundreds of thousands of objects: full collections came due)
print("full collections while importing:", gc.get_stats()[2]["collections"] - full_before)
startup_done()
print("thresholds restored:", gc.get_threshold() == default, "frozen:", gc.get_freeze_count() > 100_000)

class Node:  # a cycle made after start-up: the next full collection frees it
    pass

cycle = Node()
cycle.me = cycle
del cycle
print("collected after start-up:", gc.collect() >= 1)
startup_done()  # twice, or without a deferral first: nothing changes
print("second call keeps thresholds:", gc.get_threshold() == default)
"""


def test_full_collections_wait_for_startup_then_run_over_what_the_run_makes():
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=phalanx_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "full collections while importing: 0",
        "thresholds restored: True frozen: True",
        "collected after start-up: True",
        "second call keeps thresholds: True",
    ], proc.stdout


def test_a_library_caller_keeps_its_collector_as_it_was():
    """TrainingEngine users and `cli.main(argv)` callers never defer: startup_done freezes nothing of theirs."""
    code = (
        "import gc; from phalanx.runtime.collector import startup_done; before = gc.get_threshold(); "
        "startup_done(); print(gc.get_threshold() == before, gc.get_freeze_count())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=phalanx_env())
    assert proc.stdout.split() == ["True", "0"], proc.stdout + proc.stderr[-2000:]
