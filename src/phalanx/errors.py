"""The one exception type users see: a message that says where the problem is and what is accepted."""

import re
from typing import Iterator

# What the Hub accepts as a repository id (a model's or a dataset's): "name" or "org/name", nothing path-like. A name
# that does not match and is no existing path is a missing folder, said as such instead of the Hub client's complaint.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class PhalanxError(Exception):
    """Bad input or an impossible request. The CLI prints the message (no traceback), after `label`, and exits
    `exit_code`."""

    exit_code = 2
    label = "error"


class ConfigError(PhalanxError):
    """A config file, flag or field is wrong."""


class DataError(PhalanxError):
    """A dataset file, row or field is wrong."""


class NothingToDo(PhalanxError):
    """The command has nothing left to do: a finished run started again with its own config. Said, and exit 0, so a
    requeue that reruns a job whose run had finished (killed before it could exit) ends cleanly, not as bad input."""

    exit_code = 0
    label = "note"


class RanksFailed(PhalanxError):
    """A launcher's rank crashed, was killed or stopped taking part (named in the message): exit 1, as a single
    process that crashes, so that a requeue wrapper can tell it from bad input (2), which a rerun repeats."""

    exit_code = 1


class HubUnreachable(PhalanxError):
    """A model or dataset on the Hugging Face Hub could not be fetched because the network failed (no route, no name
    lookup, a timeout) and it is not in the local cache: exit 1, not 2, since the same command succeeds once the Hub
    is reachable again (a requeue wrapper may retry it)."""

    exit_code = 1


def network_failed(exc: BaseException) -> bool:
    """True when `exc`, or an exception it was raised from, is a failure to reach a host: a refused or reset
    connection, a timeout, or a name that did not resolve. (A missing repository or file is the user's to fix.)"""
    import socket

    return any(isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)) for e in exception_chain(exc))


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then the exception it was raised from (its cause, else its context), and so on, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def hub_failure(exc: BaseException, message: str, bad_input: type[PhalanxError]) -> PhalanxError:
    """The error to raise for `exc`, a failed load from the Hub: HubUnreachable when the network failed (saying how to
    go on), else `bad_input` with `message`."""
    if network_failed(exc):
        return HubUnreachable(
            f"{message.rstrip().rstrip('.')}. The Hugging Face Hub could not be reached and it is not in the local cache: rerun once the "
            "network is back (status 1: a requeue may retry), or download it on a machine that has the network "
            "and give its folder."
        )
    return bad_input(message)
