"""Shared test set-up: a per-session phalanx cache so tests never touch ~/.cache, and the one-process
references of the equivalence tier (tests/train, tests/parallel), trained once per session."""

import os
from collections import Counter
from pathlib import Path

import pytest

from equivalence import train
from helpers import built_once, read_metrics, write_chat_jsonl


def pytest_collection_modifyitems(items):
    """Files that launch ranks or run scripts first, the most such tests first; each file's own order kept. Under
    `make test`'s two workers (a whole file per worker at a time) the short one-process files then fill the end,
    instead of one long file running alone while the other worker has nothing left."""
    launches = Counter(
        item.path for item in items if item.get_closest_marker("distributed") or item.get_closest_marker("system")
    )
    first = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)
    items.sort(key=lambda item: (-launches[item.path], first[item.path]))


@pytest.fixture(scope="session", autouse=True)
def phalanx_cache(tmp_path_factory):
    """One PHALANX_CACHE for the session, shared by the xdist workers like the reference runs (helpers.built_once):
    the runs they compare were built from the same embedded model folder (adapter_config.json names it), and the
    cache is safe to fill from several processes at once (tests/models/test_presets.py, tests/data/test_prepare.py)."""
    cache = built_once(tmp_path_factory, "phalanx-cache", lambda folder: None)
    old = os.environ.get("PHALANX_CACHE")
    os.environ["PHALANX_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("PHALANX_CACHE", None)
    else:
        os.environ["PHALANX_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_process():
    """One intra-op thread in this process and in every process it starts (they inherit OMP_NUM_THREADS). The suite
    runs two test files at once on two cores (`make test`), so a second thread mostly waits for a busy core: a
    one-process run of the embedded model trained 5-10x slower with two. Launched ranks already take one each
    (runtime.dist shares the cores out when OMP_NUM_THREADS is unset: tests/runtime/test_dist.py checks that)."""
    import torch

    old_env, old_threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old_threads)
    if old_env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old_env


@pytest.fixture(scope="session", autouse=True)
def hub_not_looked_up():
    """The test process never looks the Hub's name up (phalanx.runtime.hub): on a machine without DNS the lookup would
    switch this process, and every run it starts, to offline mode for the rest of the session. tests/runtime/test_hub.py
    resets it where that is the subject."""
    import phalanx.runtime.hub as hub

    hub._checked = True
    yield
    hub._checked = False


@pytest.fixture(scope="session")
def equivalence_data(tmp_path_factory) -> Path:
    """48 tool-call chats: 5 steps of a global batch of 4 with rows to spare (one file for every worker)."""
    folder = built_once(tmp_path_factory, "equivalence", lambda out: write_chat_jsonl(out / "train.jsonl", 48))
    return folder / "train.jsonl"


@pytest.fixture(scope="session")
def single(equivalence_data, tmp_path_factory):
    """get(finetune) -> (output folder, per-step losses) of one process with batch 4, trained once per session
    (helpers.built_once: by the first worker that asks).

    It pads its micro-batches (--packing false) while the runs compared with it pack theirs (the default): every
    equivalence check under DDP, FSDP2 and ZeRO is also a check that packed training equals padded training."""

    def get(finetune: str) -> tuple[Path, list[float]]:
        out = built_once(
            tmp_path_factory,
            f"single-{finetune}",
            lambda out: train(equivalence_data, out, 1, 4, finetune, "--packing", "false"),
        )
        return out, [r["loss"] for r in read_metrics(out)]

    return get
