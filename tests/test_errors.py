"""errors: what status a failure to load from the Hub ends with."""

import socket

from phalanx.errors import ConfigError, DataError, HubUnreachable, hub_failure, network_failed


def raised_from(*chain: BaseException) -> BaseException:
    """The first exception, raised from the second, raised from the third ... (as the libraries chain them)."""
    error = None
    for exc in reversed(chain):
        try:
            raise exc from error
        except BaseException as caught:  # noqa: BLE001 - building the chain
            error = caught
    return error


def test_a_network_failure_anywhere_in_the_chain_is_a_hub_that_cannot_be_reached():
    # What transformers raises without a network: OSError from LocalEntryNotFoundError from ConnectError from gaierror.
    no_lookup = raised_from(OSError("We couldn't connect to 'https://huggingface.co'."), socket.gaierror(-2, "unknown"))
    refused = raised_from(ConnectionError("Couldn't reach 'org/data' on the Hub"))  # datasets' own
    for exc in (no_lookup, refused, TimeoutError("read timed out")):
        assert network_failed(exc)
        error = hub_failure(exc, "model.model_name = 'org/m': could not load the model: no route.", ConfigError)
        assert isinstance(error, HubUnreachable) and error.exit_code == 1
        assert "could not load the model: no route. The Hugging Face Hub" in str(
            error
        ) and "Hub could not be reached" in str(error)
        assert "...." not in str(error)


def test_a_missing_repository_or_file_stays_bad_input():
    missing = raised_from(OSError("org/m is not a valid model identifier"), FileNotFoundError("404"))
    assert not network_failed(missing)
    error = hub_failure(missing, "dataset 'org/d': not found", DataError)
    assert type(error) is DataError and error.exit_code == 2 and str(error) == "dataset 'org/d': not found"
