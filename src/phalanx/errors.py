"""The one exception type users see: a message that says where the problem is and what is accepted."""


class PhalanxError(Exception):
    """Bad input or an impossible request. The CLI prints the message (no traceback) and exits `exit_code`."""

    exit_code = 2


class ConfigError(PhalanxError):
    """A config file, flag or field is wrong."""


class DataError(PhalanxError):
    """A dataset file, row or field is wrong."""


class RanksFailed(PhalanxError):
    """A launcher's rank crashed, was killed or stopped taking part (named in the message): exit 1, as a single
    process that crashes, so that a requeue wrapper can tell it from bad input (2), which a rerun repeats."""

    exit_code = 1
