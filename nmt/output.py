"""Where a command's results go: a file named by -o, written atomically, or standard output.

An -o file appears only complete (nmt.atomic), so Ctrl-C or a full disk mid-way leaves the previous
file as it was; an output that is one of the command's inputs (the same file, also through a link) is
refused before anything is opened for writing. A device (/dev/full, /dev/stdout) or a FIFO is written
directly, never renamed over. Write failures are one line (OutputError, exit 1), and a reader that went
away (`| head -n 1`) ends the command quietly, as Unix tools do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from nmt.atomic import atomic_write
from nmt.errors import NmtError, OutputError

STDIN = "<stdin>"


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def refuse_input_as_output(output: Path | None, inputs: list[Path | None], option: str = "-o") -> None:
    """NmtError when `output` is one of `inputs` (None: standard input), compared by device and inode,
    so a symlink or a hard link to the input is caught as well as the same name."""
    if output is None:
        return
    try:
        out = os.stat(output)
    except OSError:  # not there yet (or unreadable, which the write will report): not an input
        return
    for path in inputs:
        try:
            st = os.fstat(sys.stdin.fileno()) if path is None else os.stat(path)
        except (OSError, AttributeError, ValueError):  # no stdin at all, an input the reader will report
            continue
        if same_file(st, out):
            name = STDIN if path is None else str(path)
            raise NmtError(f"{option} {output}: is the input {name}; write the output to another file")


def stdout() -> BinaryIO:
    """Standard output as bytes; OutputError when the command was started with it closed (`>&-`)."""
    if sys.stdout is None:
        raise OutputError("cannot write the output: standard output is closed")
    return sys.stdout.buffer


@contextlib.contextmanager
def output_stream(path: Path | None) -> Iterator[BinaryIO]:
    """A binary stream for the results: `path` written atomically (kept as it was if the block raises),
    or standard output when None."""
    if path is None:
        yield stdout()
        return
    path = Path(path)
    if path.is_dir():
        raise NmtError(f"{path}: is a directory; -o names the file to write")
    # /dev/stdout, /dev/full, /proc/self/fd/N, a FIFO: written in place. Renaming a file over them would
    # replace the device or the link itself (/dev/stdout is a link to wherever fd 1 points).
    if path.absolute().parts[1:2] in (("dev",), ("proc",)) or (path.exists() and not path.is_file()):
        try:
            f = open(path, "wb")
        except OSError as e:
            raise OutputError(f"{path}: cannot write the output: {e.strerror}") from None
        with f:
            yield f
        return
    path = Path(os.path.realpath(path))  # through a link to its file, so the link stays a link
    try:
        writer = atomic_write(path)
        f = writer.__enter__()
    except OSError as e:
        raise OutputError(f"{path}: cannot write the output: {e.strerror}") from None
    try:
        yield f
    except BaseException:
        writer.__exit__(*sys.exc_info())
        raise
    try:
        writer.__exit__(None, None, None)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the output: {e.strerror}") from None


def write_failed(e: OSError, name: str = "standard output") -> NmtError | None:
    """What a failed write of results means to the user, or None for a reader that went away.

    Standard output is pointed at /dev/null either way, so the interpreter's own flush at exit cannot
    fail again with a traceback.
    """
    with contextlib.suppress(OSError, AttributeError, ValueError):
        if sys.stdout is not None:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if e.errno == errno.EPIPE:
        return None
    return OutputError(f"{name}: cannot write the output: {e.strerror or e}")
