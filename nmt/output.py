"""Where a command's results go: a file named by -o, written atomically, or standard output.

An -o file appears only complete (nmt.atomic), so Ctrl-C or a full disk mid-way leaves the previous
file as it was; an output that is one of the command's inputs (the same file, also through a link) is
refused before anything is opened for writing (nmt.atomic.refuse_inputs). A device (/dev/full,
/dev/stdout) or a FIFO is written directly, never renamed over. Write failures are one line
(OutputError, exit 1), and a reader that went away (`| head -n 1`) ends the command quietly, as Unix tools do.
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
    # A file atomically through a link to it; /dev/stdout, /dev/full, a FIFO in place (nmt.atomic). A
    # failed write is one OutputError naming the file.
    with atomic_write(path) as f:
        yield f


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
