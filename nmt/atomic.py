"""Every file nmt writes goes through here: the one guard for outputs.

A write either leaves the old content or the complete new content, never a part: the bytes go to a
temporary file in the same folder, are fsynced, the file is renamed over the target and the folder is
fsynced, so a kill, a power cut or a full disk at any moment leaves the previous file intact and no
temporary file behind (`atomic_write`, or `atomic_replace` for a file some library writes by name). A
folder (a model export) is filled under a temporary name and renamed whole by `atomic_folder`;
`check_replaceable` says whether an existing one may go.

The guard also:
- refuses an output that is one of the command's inputs (`refuse_inputs`), compared by device and inode
  so a symlink or a hard link is caught, before anything is opened for writing;
- gives the new file (or folder) the mode `open()` (or `mkdir`) would under the umask, not mkstemp's
  0600;
- reports a failed write (a full disk, a read-only folder, a missing permission) as one OutputError
  naming the path written (exit status 1);
- removes its temporary file or staging folder on any exception, KeyboardInterrupt and the signals the
  command line turns into nmt.errors.Signalled (SIGTERM, SIGHUP) included.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from nmt.errors import NmtError, OutputError

STDIN = "<stdin>"  # an input that is standard input, counted only where the command really reads it

# Errors of a write in a block that may also read: only these are surely the output's. Our own steps
# (creating the temporary file, the rename, the fsyncs) report any OSError as the output's.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask would set it for a
    moment, under the feet of other threads)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode `open(path, "w")` gives a new file."""
    return 0o666 & ~umask()


def folder_mode() -> int:
    """The mode `mkdir` gives a new folder."""
    return 0o777 & ~umask()


# ---- outputs that are inputs ------------------------------------------------------------------------


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def refuse_inputs(output: Path | str | None, inputs: Iterable[Path | str | None], option: str = "-o") -> None:
    """NmtError when writing `output` would destroy one of `inputs`, before anything is written.

    An input is a file, a folder (each file in it is an input), STDIN when the command reads standard
    input, or None (an option not given: nothing). Compared by device and inode, so a symlink or a hard
    link is caught as well as the same name. Only regular files and folders count: writing a device
    (/dev/null, /dev/stdout on a terminal) or a FIFO destroys nothing, so `-i in.en -o /dev/null <
    /dev/null` is fine. An output folder (an export) is refused when an input lies inside it, as
    replacing it would delete that input.
    """
    if output is None:
        return
    out = _stat(output)
    if out is None:  # not there yet (or unreadable, which the write will report): it holds no input
        return
    for path in inputs:
        if path is None:
            continue
        st = _stat(path)
        if st is None:  # an input the reader will report
            continue
        name = str(path)
        if stat.S_ISREG(st.st_mode):
            if same_file(st, out):
                raise NmtError(f"{option} {output}: is the input {name}; write the output to another file")
            if stat.S_ISDIR(out.st_mode) and path != STDIN and _inside(Path(path), out):
                raise NmtError(
                    f"{option} {output}: holds the input {name}, which writing there would overwrite "
                    "or delete; write the output to another folder"
                )
        elif stat.S_ISDIR(st.st_mode):
            if same_file(st, out) or _inside(Path(output), st) or _file_of(Path(path), out):
                raise NmtError(
                    f"{option} {output}: is the input folder {name} or one of its files; "
                    "write the output elsewhere"
                )


# What a run writes below its work directory (nmt preprocess, train, run, distill): an input that lies
# in any of these would be replaced or deleted by the run.
WORKDIR_OUTPUTS = (
    "data",
    "checkpoints",
    "source",
    "distill",
    "export",
    "translations",
    "tensorboard",
    "results.md",
    "results.json",
    "metrics.jsonl",
    "train.log",
    "bitext",  # a back-translation recipe's (nmt.pipeline): its bitext, reverse model and synthetic corpus
    "reverse",
    "backtranslate",
)


def refuse_overlaps(
    outputs: Iterable[tuple[str, Path | str | None]], inputs: Iterable[Path | str | None]
) -> None:
    """The one declaration each command makes of what it writes and what it reads, before any work:
    every output (`(option, path)`) against every input, as `refuse_inputs` compares them."""
    inputs = list(inputs)
    for option, output in outputs:
        refuse_inputs(output, inputs, option)


def workdir_outputs(workdir: Path | str) -> list[tuple[str, Path]]:
    """A work directory's outputs (WORKDIR_OUTPUTS) for refuse_overlaps, named by --workdir."""
    return [("--workdir", Path(workdir) / name) for name in WORKDIR_OUTPUTS]


def _stat(path: Path | str) -> os.stat_result | None:
    try:
        if path == STDIN:
            return os.fstat(sys.stdin.fileno())
        return os.stat(path)
    except (OSError, AttributeError, ValueError):  # no such file, no stdin at all
        return None


def _inside(path: Path, folder: os.stat_result) -> bool:
    """Whether `folder` is one of the folders above `path` (its links resolved)."""
    for parent in Path(os.path.realpath(path)).parents:
        st = _stat(parent)
        if st is not None and same_file(st, folder):
            return True
    return False


def _file_of(folder: Path, out: os.stat_result, limit: int = 10_000) -> bool:
    """Whether `out` is (a hard link to) one of the files in `folder`, to a bounded depth and count."""
    if not stat.S_ISREG(out.st_mode):
        return False
    seen = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            seen += 1
            st = _stat(Path(root) / name)
            if st is not None and same_file(st, out):
                return True
            if seen >= limit:
                return False
    return False


# ---- writing ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def reported(path: Path | str, errnos: frozenset[int] | None = None) -> Iterator[None]:
    """An OSError in the block (any, or those of `errnos`) as one OutputError naming `path`."""
    try:
        yield
    except OSError as e:
        if errnos is not None and e.errno not in errnos:
            raise
        raise OutputError(f"{path}: cannot write: {e.strerror or e}", errno=e.errno) from None


@contextlib.contextmanager
def atomic_write(path: Path | str, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """Open a temporary file to write `path`'s new content; it replaces `path` when the block ends
    without an exception and is removed when it raises."""
    if in_place(path):  # a device or a FIFO: written where it is, never renamed over
        with reported(path):
            opened = open(path, mode, encoding=encoding)
        with reported(path, WRITE_ERRNOS), opened:
            yield WriteAll(opened) if "b" in mode else opened
        return
    with atomic_replace(path) as tmp, open(tmp, mode, encoding=encoding) as opened:
        f = WriteAll(opened) if "b" in mode else opened
        try:
            yield f
        except Exception as e:
            # A library that writes through `f` (torch.save) may report a failed write as its own
            # error ("unexpected pos"): the OSError the file saw is what the user must read.
            if isinstance(f, WriteAll) and f.error is not None and not isinstance(e, OSError):
                raise OutputError(
                    f"{path}: cannot write: {f.error.strerror or f.error}", errno=f.error.errno
                ) from None
            raise


class WriteAll:
    """A binary file whose write() writes every byte or raises, and remembers the OSError it raised."""

    def __init__(self, f: IO[bytes]):
        self.f, self.error = f, None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                written = self.f.write(view[done:])
                done += len(view) - done if written is None else written
        except OSError as e:
            self.error = e
            raise
        return done

    def __getattr__(self, name: str):
        return getattr(self.f, name)


@contextlib.contextmanager
def atomic_replace(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` for a library to write to by name; renamed over `path` (after an
    fsync) when the block succeeds, removed when it raises. A link is followed to its file, so the link
    stays a link; a device, a FIFO or a path under /dev or /proc is refused, as renaming a file over it
    would replace the device itself."""
    if in_place(path):
        raise OutputError(f"{path}: not a regular file; it cannot be replaced by one")
    path = Path(os.path.realpath(path))
    tmp = None
    try:
        with reported(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            with signals_deferred():  # a signal now would leave a file nobody knows the name of
                fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
                tmp = Path(name)
            try:
                os.fchmod(fd, file_mode())  # mkstemp's 0600 would hide translations and models from the group
            finally:
                os.close(fd)
        with reported(path, WRITE_ERRNOS):
            yield tmp
        with reported(path):
            _fsync(tmp)
            os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    with reported(path):
        fsync_dir(path.parent)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back for the block and handled as it ends: a temporary name is
    created and recorded together, so the cleanup that follows always knows what to remove. Python runs
    handlers in the main thread whichever thread the kernel chose, so they are held at Python's level
    (a signal mask would only cover this thread); elsewhere than the main thread nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, object]] = []
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        handler = signal.getsignal(signum)
        if callable(handler):  # ours, or Python's KeyboardInterrupt: worth holding back
            previous[signum] = signal.signal(signum, lambda n, frame: caught.append((n, frame)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in caught[:1]:  # the first: it ends the command, as it would have
            previous[signum](signum, frame)


@contextlib.contextmanager
def atomic_folder(output: Path) -> Iterator[Path]:
    """A folder (not yet created) to fill under a temporary name beside `output`, renamed to `output`,
    replacing it, when the block ends without error: a failed write leaves nothing behind."""
    output = Path(output)
    if in_place(output) or (output.exists() and not output.is_dir()):
        raise OutputError(f"{output}: not a folder; write the export to a new or an exported folder")
    with reported(output):
        output.parent.mkdir(parents=True, exist_ok=True)
    staging = None
    try:
        # the staging folder's name recorded before a signal may interrupt
        with reported(output), signals_deferred():
            staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        folder = staging / "folder"
        with reported(output, WRITE_ERRNOS):
            try:
                yield folder
            except Exception as e:
                # A library writing the folder (safetensors, CTranslate2's converter) reports a full
                # disk as its own error type: what the user must read is the OS's error.
                code = None if isinstance(e, OSError | NmtError) else os_error_of(e, staging)
                if code is not None:
                    raise OSError(code, os.strerror(code)) from None
                raise
        with reported(output):
            # As mkdir and open() would under the umask, whoever wrote them (safetensors writes 0600)
            folder.chmod(folder_mode())
            for root, dirs, files in os.walk(folder):
                for name in dirs:
                    os.chmod(os.path.join(root, name), folder_mode())
                for name in files:
                    os.chmod(os.path.join(root, name), file_mode())
            if output.exists():
                shutil.rmtree(output)
            os.replace(folder, output)
            fsync_dir(output.parent)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def in_place(path: Path | str) -> bool:
    """Whether `path` is written where it is, never through a temporary file renamed over it: a device,
    a FIFO or a socket (/dev/null, /dev/full, a terminal), or anything under /dev or /proc, whose links
    (/dev/stdout, /proc/self/fd/1) point at whatever the process's descriptor is."""
    if Path(os.path.abspath(path)).parts[1:2] in (("dev",), ("proc",)):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:  # not there yet: a new regular file
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def os_error_of(e: Exception, folder: Path) -> int | None:
    """The errno behind a library's own error for a failed write: named in its message the way Rust's
    std::io::Error prints it ("... (os error 28)", safetensors), or ENOSPC when the filesystem holding
    `folder` has no block left. None when the error is not a write's."""
    found = re.search(r"\(os error (\d+)\)", str(e))
    if found and int(found[1]) in WRITE_ERRNOS | {errno.EACCES, errno.EPERM, errno.EIO}:
        return int(found[1])
    try:
        return errno.ENOSPC if os.statvfs(folder).f_bavail == 0 else None
    except OSError:
        return None


def check_replaceable(output: Path, force: bool, marker: str) -> None:
    """An existing folder that `atomic_folder` would replace is replaced only with `force`, and only when
    it holds `marker`, a file only our writer puts there: never an unrelated folder."""
    if output.exists():
        if not force:
            raise NmtError(f"{output} already exists; add --force to replace it")
        if not (output / marker).is_file():
            raise NmtError(f"{output} exists and is not an nmt export; refusing to replace it")


def write_text(path: Path | str, text: str) -> None:
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_bytes(path: Path | str, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def link_or_copy(src: Path, dst: Path) -> None:
    """Atomically make `dst` hold `src`'s bytes: a hard link where the filesystem allows, else a copy."""
    with atomic_replace(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (the folder's own entry list is what a crash could lose)."""
    _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
