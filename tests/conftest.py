"""Shared test set-up: a per-session phalanx cache so tests never touch ~/.cache."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def phalanx_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("phalanx-cache")
    old = os.environ.get("PHALANX_CACHE")
    os.environ["PHALANX_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("PHALANX_CACHE", None)
    else:
        os.environ["PHALANX_CACHE"] = old


