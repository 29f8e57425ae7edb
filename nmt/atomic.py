"""Atomic file writes: a file either has its old content or its complete new content, never a part.

Every writer in nmt goes through `atomic_write` (or `atomic_replace` for a file some library writes
by name): the bytes go to a temporary file in the same folder, are fsynced, the file is renamed over
the target and the folder is fsynced, so a kill, a power cut or a full disk at any moment leaves the
previous file intact and no temporary file behind. A folder (a model export) is filled under a temporary
name and renamed whole by `atomic_folder`; `check_replaceable` says whether an existing one may go.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from nmt.errors import NmtError


@contextlib.contextmanager
def atomic_write(path: Path | str, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """Open a temporary file to write `path`'s new content; it replaces `path` when the block ends
    without an exception and is removed when it raises."""
    with atomic_replace(path) as tmp, open(tmp, mode, encoding=encoding) as f:
        yield f


@contextlib.contextmanager
def atomic_replace(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` for a library to write to by name; renamed over `path` (after an
    fsync) when the block succeeds, removed when it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_folder(output: Path) -> Iterator[Path]:
    """A folder (not yet created) to fill under a temporary name beside `output`, renamed to `output`,
    replacing it, when the block ends without error: a failed write leaves nothing behind."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        folder = staging / "folder"
        yield folder
        if output.exists():
            shutil.rmtree(output)
        os.replace(folder, output)
        fsync_dir(output.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
