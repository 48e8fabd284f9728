"""The one exception type users see: a message that says where the problem is and what is accepted."""


class PhalanxError(Exception):
    """Bad input or an impossible request. The CLI prints the message (no traceback) and exits 2."""


class ConfigError(PhalanxError):
    """A config file, flag or field is wrong."""


class DataError(PhalanxError):
    """A dataset file, row or field is wrong."""
