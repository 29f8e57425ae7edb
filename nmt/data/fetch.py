"""Download, cache, mirror, checksum and unpack one corpus file.

A download is written to `<name>.part` and renamed only once complete and verified, so a file without the
suffix in the cache is always whole and correct; an interrupted transfer leaves the `.part`, which the
next attempt resumes with an HTTP Range request when the server honours it. A mirror (folder or base URL)
replaces the upstream location and keeps the file name: mirror + "/" + basename(url).
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import shutil
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from rich.console import Console

from nmt.errors import DataError
from nmt.progress import Progress

CHUNK = 1 << 20
TIMEOUT_S = 60
USER_AGENT = "nmt/0.1 (Python urllib)"


def cache_dir() -> Path:
    """`$NMT_CACHE`, else ~/.cache/nmt."""
    return Path(os.environ.get("NMT_CACHE") or Path.home() / ".cache" / "nmt")


def is_url(location: str) -> bool:
    return urlsplit(location).scheme in ("http", "https", "ftp", "file")


def basename(url: str) -> str:
    return Path(urlsplit(url).path).name


class _Interrupted(DataError):
    """A transfer that may succeed when tried again (connection reset, timeout, short read)."""


def fetch(
    url: str,
    digest: str,
    *,
    algorithm: str = "sha256",
    mirror: str | None = None,
    console: Console | None = None,
    attempts: int = 3,
) -> Path:
    """A local, verified copy of `url`: from the cache, a mirror folder, or a (resumed) download.

    `digest` is the expected hex digest under `algorithm` (sha256 for recipes; md5 where sacrebleu's
    registry only knows that). A mismatch raises DataError naming the file and both digests, and keeps
    nothing. A mirror folder is verified and read in place, not copied.
    """
    name = basename(url)
    if not is_url(url):  # a local file, read in place (a back-translation recipe's synthetic corpus)
        path = Path(url).expanduser()
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        _verify(path, digest, algorithm, delete=False)
        return path
    if mirror and not is_url(mirror):
        path = Path(mirror).expanduser() / name
        if not path.is_file():
            raise DataError(f"{path}: not found in mirror folder {mirror} (needed for {url})")
        _verify(path, digest, algorithm, delete=False)
        return path
    if mirror:
        url = mirror.rstrip("/") + "/" + name
    target = cache_dir() / "downloads" / f"{algorithm}-{digest[:16]}" / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(name + ".part")
    for attempt in range(1, attempts + 1):
        try:
            _download(url, part, console)
            break
        except _Interrupted:
            if attempt == attempts:
                raise
            time.sleep(min(2**attempt, 30))
    _verify(part, digest, algorithm, delete=True, shown_as=name)
    os.replace(part, target)
    return target


def _download(url: str, part: Path, console: Console | None) -> None:
    """Append the rest of `url` to `part` (Range request), or rewrite it when the server ignores Range."""
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:
            return  # nothing left to send: the .part is complete, the checksum will tell
        raise DataError(f"{url}: download failed: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise _Interrupted(f"{url}: download failed: {getattr(e, 'reason', e)}") from None
    with response:
        resumed = have > 0 and response.status == 206
        if not resumed:
            have = 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        progress = Progress(console, f"download {basename(url)}", total, unit="bytes", done=have)
        with progress, open(part, "ab" if resumed else "wb") as out:
            try:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    progress.advance(len(chunk))
            except (http.client.HTTPException, OSError) as e:
                raise _Interrupted(f"{url}: download interrupted ({e!r}); run again to resume") from None
            size = out.tell()
    if total is not None and size < total:
        raise _Interrupted(f"{url}: download interrupted at {size} of {total} bytes; run again to resume")


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, digest: str, algorithm: str, *, delete: bool, shown_as: str | None = None) -> None:
    actual = file_digest(path, algorithm)
    if actual != digest.lower():
        if delete:
            path.unlink(missing_ok=True)
        kept = "; the download was deleted" if delete else ""
        raise DataError(f"{shown_as or path}: {algorithm} mismatch: expected {digest}, actual {actual}{kept}")


# ---------------------------------------------------------------------------------------------------------
# Unpacking


def unpack(archive: Path, members: Mapping[str, Path], strict: bool = True) -> set[str]:
    """Write each wanted member of `archive` to its destination, decompressing members that end in .gz.

    `members` maps member names to destinations; an empty name stands for the file itself (a plain or
    .gz file, not an archive). Tar archives are read as a stream, in one pass for all members, so a
    multi-gigabyte .tgz is decompressed once. Each destination is written to .part and renamed. Returns
    the members found; a member not found is a DataError unless `strict` is False.
    """
    wanted = dict(members)
    if "" in wanted:
        _write(archive.open("rb"), wanted.pop(""), gunzip=archive.name.endswith(".gz"))
    if not wanted:
        return set(members)
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            for info in tar:
                dest = wanted.pop(info.name, None) or wanted.pop(info.name.removeprefix("./"), None)
                if dest is None or not info.isfile():
                    continue
                _write(tar.extractfile(info), dest, gunzip=info.name.endswith(".gz"))
                if not wanted:
                    break
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{archive}: cannot read the archive: {e}") from None
    if wanted and strict:
        raise DataError(f"{archive}: no member {', '.join(sorted(wanted))} in the archive")
    return set(members) - set(wanted)


def _write(source, dest: Path, gunzip: bool) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with source as raw:
        stream = gzip.GzipFile(fileobj=raw) if gunzip else raw
        try:
            with open(part, "wb") as out:
                shutil.copyfileobj(stream, out, CHUNK)
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            part.unlink(missing_ok=True)
            raise DataError(f"{dest.name}: cannot decompress: {e}") from None
    os.replace(part, dest)
