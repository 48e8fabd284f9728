"""Reaching the Hugging Face Hub from a machine whose DNS cannot resolve it: read models and datasets from the local
cache only, at once, instead of retrying every file for tens of seconds.

huggingface_hub retries a failed request with back-off: on a machine without network (a laptop offline, a compute node
without DNS) `phalanx train --model_name org/name` took 51.7 s and `--dataset_name org/data` 27.9 s to say the Hub could
not be reached, even for what the local cache holds. Before the first Hub id is loaded, the Hub's host name is looked
up once; when it does not resolve, the process switches huggingface_hub and datasets to offline mode
(HF_HUB_OFFLINE=1, which the ranks it starts inherit): what the cache holds loads, and what it does not fails at once
as HubUnreachable (status 1: the same command works once the network is back).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Optional
from urllib.parse import urlparse

from phalanx.errors import HubUnreachable, PhalanxError, exception_chain, hub_failure

# With a proxy, the proxy resolves names: a name this machine cannot resolve says nothing about the Hub.
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")

_checked = False
_unresolved: Optional[str] = None  # why this process reads the Hub from the local cache only (None: it does not)


def read_hub_from_cache_if_unresolvable(wait: float = 5.0) -> None:
    """Once per process: when the Hub's host name does not resolve, switch to offline mode (see the module doc). Left
    alone: offline mode already set, a proxy configured, or no answer within `wait` seconds (the Hub client decides)."""
    global _checked, _unresolved
    if _checked:
        return
    _checked = True
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE or any(os.environ.get(name) for name in PROXY_VARIABLES):
        return
    host = urlparse(hub.ENDPOINT).hostname or "huggingface.co"
    answer: dict = {}

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, 443)
        except socket.gaierror as exc:
            answer["error"] = exc.strerror or str(exc)
        except OSError:
            pass  # not a name-lookup failure: the Hub client decides

    lookup = threading.Thread(target=resolve, daemon=True)
    lookup.start()
    lookup.join(wait)
    if "error" not in answer:
        return
    _unresolved = f"The Hub's host {host} does not resolve ({answer['error']})"
    os.environ["HF_HUB_OFFLINE"] = "1"  # for the ranks this process starts
    hub.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:  # datasets read the variable when it was imported
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
    if os.environ.get("RANK", "0") == "0":  # every rank switches; one says so
        print(
            f"🌐 {_unresolved}: models and datasets are read from the local cache only (HF_HUB_OFFLINE=1).", flush=True
        )


def hub_load_failure(exc: BaseException, message: str, bad_input: type[PhalanxError]) -> PhalanxError:
    """What a failed load of a Hub id raises: HubUnreachable when the network failed or the Hub's name did not resolve
    (a rerun with the network succeeds), else `bad_input` with `message`. Offline, what the cache does not hold
    fails as a missing local entry or a refused connection; any other failure (a cached dataset that does not parse)
    is still the user's to fix."""
    if _unresolved is not None and _not_in_cache(exc):
        return HubUnreachable(
            f"{message.rstrip().rstrip('.')}. {_unresolved}, and the local cache does not hold it: rerun once the "
            "network is back (status 1: a requeue may retry), or download it on a machine that has the network and "
            "give its folder."
        )
    return hub_failure(exc, message, bad_input)


def _not_in_cache(exc: BaseException) -> bool:
    """True when `exc`, or an exception it was raised from, says an offline load found nothing in the cache."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    missing = (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError)
    return any(isinstance(e, missing) for e in exception_chain(exc))
