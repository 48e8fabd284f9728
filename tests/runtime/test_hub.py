"""runtime.hub: a machine whose DNS cannot resolve the Hub reads models and datasets from the local cache, at once."""

import os
import socket
import time

import huggingface_hub.constants as hub
import pytest
import torch

import phalanx.runtime.hub as hub_state
from phalanx.errors import HubUnreachable


@pytest.fixture
def hub_lookup(monkeypatch):
    """A process that has not yet looked the Hub up, online as far as huggingface_hub knows, without a proxy, whose
    name lookups fail; what the code switches is put back after the test. Returns the hosts looked up."""
    import datasets.config

    monkeypatch.setattr(hub_state, "_checked", False)
    monkeypatch.setattr(hub_state, "_unresolved", None)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored (unset) after the test, whatever the code sets
    for name in hub_state.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    looked_up: list[str] = []

    def fails(host, *args, **kwargs):
        looked_up.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fails)
    return looked_up


def test_a_hub_that_does_not_resolve_is_read_from_the_cache_and_fails_at_once(
    hub_lookup, tmp_path, monkeypatch, capsys
):
    """huggingface_hub would retry each file for tens of seconds (51.7 s for a model, 27.9 s for a dataset here). The
    name is looked up once; the process goes offline, and what the cache does not hold is a HubUnreachable (status 1:
    the same command works once the network is back), for a model and for a dataset alike."""
    import datasets.config

    from phalanx.data.sources import load_named_dataset
    from phalanx.errors import DataError
    from phalanx.models.load import load_model, load_tokenizer

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-datasets-cache")
    started = time.perf_counter()
    with pytest.raises(HubUnreachable) as raised:
        load_tokenizer("acme/not-cached-anywhere")
    assert raised.value.exit_code == 1 and "could not load its tokenizer" in str(raised.value)
    assert (
        "The Hub's host huggingface.co does not resolve (Name or service not known), and the local cache does not"
        in (str(raised.value))
    )
    with pytest.raises(HubUnreachable, match="could not load the model"):
        load_model("acme/not-cached-anywhere", torch.float32)
    # phalanx plan reads the config only: it said the same as bad input (status 2, "a requeue would only repeat it")
    from phalanx.config.loader import load_config
    from phalanx.plan.model import build_meta_model

    with pytest.raises(HubUnreachable, match="cannot build it from its config"):
        build_meta_model(load_config(None, {"model.model_name": "acme/not-cached-anywhere"}))
    with pytest.raises(HubUnreachable, match="dataset 'acme/no-such-chats'") as raised:
        load_named_dataset("acme/no-such-chats")
    assert isinstance(raised.value, HubUnreachable) and not isinstance(raised.value, DataError)
    assert time.perf_counter() - started < 20
    assert hub_lookup == ["huggingface.co"]  # once per process
    assert hub.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # and the ranks it starts inherit it
    said = capsys.readouterr().out
    assert said.count("models and datasets are read from the local cache only (HF_HUB_OFFLINE=1)") == 1


def test_with_a_proxy_or_a_local_folder_the_hub_is_not_looked_up(hub_lookup, tmp_path, monkeypatch):
    """Behind a proxy the proxy resolves names; a local folder needs no Hub."""
    from phalanx.models.load import resolve_model_path

    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert hub_lookup == []
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert resolve_model_path("acme/tiny") == "acme/tiny"
    assert hub_lookup == [] and not hub.HF_HUB_OFFLINE
