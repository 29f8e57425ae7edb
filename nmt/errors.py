"""The few exception types the CLI turns into one red line and exit status 2.

Library code raises these for anything a user can fix (a bad recipe key, a missing file, a corrupt
checkpoint); anything else is a bug and keeps its traceback.
"""


class NmtError(Exception):
    """A problem with the user's input: reported in one line, exit status 2."""

    exit_code = 2


class ConfigError(NmtError):
    """A recipe or --set override that does not validate; the message names the file and dotted key."""


class DataError(NmtError):
    """A corpus that cannot be fetched, verified or read; the message names the file."""


class CheckpointError(NmtError):
    """A model file that is missing, truncated or not an nmt checkpoint."""


class Interrupted(NmtError):
    """Work stopped by a signal after saving what it had; the exit status is 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class OutputError(NmtError):
    """Results that cannot be written (a full disk, a closed standard output): one line, exit status 1,
    as Unix tools report a write error."""

    exit_code = 1

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno  # the failed write's, where one failed (ENOSPC: a full disk)


class Signalled(BaseException):  # noqa: N818 (a signal, like KeyboardInterrupt, not an error)
    """SIGTERM or SIGHUP outside training, raised where the program is at that moment so that every
    `finally` and `except BaseException` on the way out runs (temporary files removed, nothing half
    written). A BaseException, as KeyboardInterrupt, so that no `except Exception` swallows it; the exit
    status is 128 + the signal's number, as a shell reports a process the signal killed."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal_name(signum)}")
        self.signum = int(signum)
        self.exit_code = 128 + int(signum)


def signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
