"""models.load: what a model_name that cannot be loaded is told."""

import os

import pytest
import torch

from phalanx.errors import ConfigError
from phalanx.models.load import resolve_model_path


def test_a_model_name_that_is_a_file_or_a_folder_without_config_is_named_as_such(tmp_path):
    """A file (a .safetensors given for the folder) was called "a folder without config.json"."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"model.safetensors' is a file, not a model folder; expected a folder"):
        resolve_model_path(str(weights))
    with pytest.raises(ConfigError, match="is a folder without config.json; expected a folder written by"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


@pytest.fixture
def hub_lookup(monkeypatch):
    """A process that has not yet checked the Hub's name, online as far as huggingface_hub knows, without a proxy;
    what it switches is put back after the test. Returns the list of hosts looked up."""
    import socket

    import huggingface_hub.constants as hub

    import phalanx.models.load as load

    monkeypatch.setattr(load, "_hub_checked", False)
    monkeypatch.setattr(load, "_hub_unresolved", None)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored (unset) after the test, whatever the code sets
    for name in load.PROXY_VARIABLES:
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
    """No DNS (an offline machine, a compute node): huggingface_hub would retry each file for about 50 s before the
    error. The name is looked up once; the process goes offline (the cache answers at once) and a model the cache
    does not hold is a HubUnreachable (status 1: the same command works once the network is back)."""
    import time

    import huggingface_hub.constants as hub

    from phalanx.errors import HubUnreachable
    from phalanx.models.load import load_model, load_tokenizer

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    started = time.perf_counter()
    with pytest.raises(HubUnreachable) as raised:
        load_tokenizer("acme/not-cached-anywhere")
    assert time.perf_counter() - started < 10
    assert raised.value.exit_code == 1
    assert "could not load its tokenizer" in str(raised.value)
    assert (
        "The Hub's host huggingface.co does not resolve (Name or service not known), and the local cache does not"
        in (str(raised.value))
    )
    with pytest.raises(HubUnreachable, match="could not load the model"):
        load_model("acme/not-cached-anywhere", torch.float32)
    assert hub_lookup == ["huggingface.co"]  # once per process
    assert hub.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"  # and the ranks it starts inherit it
    assert capsys.readouterr().out.count("models are read from the local cache only (HF_HUB_OFFLINE=1)") == 1


def test_with_a_proxy_the_hub_is_not_looked_up_here(hub_lookup, monkeypatch):
    """Behind a proxy the proxy resolves names: a name this machine cannot resolve says nothing about the Hub."""
    import huggingface_hub.constants as hub

    from phalanx.models.load import resolve_model_path

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert resolve_model_path("acme/tiny") == "acme/tiny"
    assert hub_lookup == [] and not hub.HF_HUB_OFFLINE
