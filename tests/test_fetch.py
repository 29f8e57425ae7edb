"""Downloads against a real HTTP server on 127.0.0.1: cache, checksums, resume, mirrors, archives.

The server (`Served`, also used by test_wmt_data.py) serves bytes registered by a test and, under /multi30k/,
the files of $NMT_DATA_MIRROR; it honours Range requests and can cut a transfer short once.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nmt.data import fetch as fetch_module
from nmt.data.fetch import fetch, unpack
from nmt.errors import DataError

NEEDS_MIRROR = "set NMT_DATA_MIRROR=/path/to/multi30k to run"


class Served:
    """What the test server holds, and what it saw."""

    def __init__(self, mirror: Path | None):
        self.files: dict[str, bytes] = {}
        self.mirror = mirror
        self.cut_after: dict[str, int] = {}  # path -> bytes sent before dropping the connection, once
        self.range_support = True
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.url = ""

    def add(self, path: str, data: bytes) -> str:
        self.files[path] = data
        return self.url + path

    def body(self, path: str) -> bytes | None:
        if path in self.files:
            return self.files[path]
        if self.mirror is not None and path.startswith("/multi30k/"):
            file = self.mirror / path.removeprefix("/multi30k/")
            return file.read_bytes() if file.is_file() else None
        return None


def _handler(served: Served):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            served.requests.append((self.path, self.headers.get("Range")))
            data = served.body(self.path)
            if data is None:
                self.send_error(404)
                return
            start = 0
            wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
            if wanted and served.range_support:
                start = int(wanted.group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            cut = served.cut_after.pop(self.path, None)
            self.wfile.write(body if cut is None else body[:cut])
            if cut is not None:
                self.close_connection = True

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture
def served():
    mirror = os.environ.get("NMT_DATA_MIRROR")
    state = Served(Path(mirror) if mirror else None)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("NMT_CACHE", str(path))
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cached_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


def payload(n: int) -> bytes:
    return bytes((i * 7919 + i // 251) % 256 for i in range(n))


def test_multi30k_download_goes_to_the_cache_once(served, cache):
    if served.mirror is None:
        pytest.skip(NEEDS_MIRROR)
    sums = dict(line.split()[::-1] for line in (served.mirror / "SHA256SUMS").read_text().splitlines())
    url = served.url + "/multi30k/val.de.gz"
    path = fetch(url, sums["val.de.gz"])
    assert path.is_relative_to(cache) and path.name == "val.de.gz"
    assert path.read_bytes() == (served.mirror / "val.de.gz").read_bytes()
    assert [p for p in cached_files(cache) if p.name.endswith(".part")] == []
    assert fetch(url, sums["val.de.gz"]) == path
    assert len(served.requests) == 1  # the second call was answered from the cache


def test_checksum_mismatch_names_file_and_both_hashes_and_keeps_nothing(served, cache):
    data = b"not what the recipe expects\n"
    url = served.add("/corpus/train.en", data)
    wrong = "0" * 64
    with pytest.raises(DataError) as e:
        fetch(url, wrong)
    message = str(e.value)
    assert "train.en" in message and wrong in message and sha256(data) in message
    assert "\n" not in message
    assert cached_files(cache) == []


def test_interrupted_download_leaves_a_part_that_the_next_run_resumes_with_range(served, cache):
    data = payload(300_000)
    url = served.add("/big.bin", data)
    served.cut_after["/big.bin"] = 100_000
    with pytest.raises(DataError, match="interrupted"):
        fetch(url, sha256(data), attempts=1)
    [part] = cached_files(cache)
    assert part.name == "big.bin.part" and part.stat().st_size == 100_000  # nothing looks complete

    path = fetch(url, sha256(data))
    assert path.read_bytes() == data
    assert served.requests[-1] == ("/big.bin", "bytes=100000-")
    assert cached_files(cache) == [path]


def test_an_interrupted_download_is_retried_and_resumed_within_one_call(served, monkeypatch):
    monkeypatch.setattr(fetch_module.time, "sleep", lambda s: None)
    data = payload(50_000)
    url = served.add("/retry.bin", data)
    served.cut_after["/retry.bin"] = 20_000
    assert fetch(url, sha256(data), attempts=2).read_bytes() == data
    assert [r for _, r in served.requests] == [None, "bytes=20000-"]


def test_a_server_without_range_support_restarts_the_download(served, cache):
    data = payload(40_000)
    url = served.add("/norange.bin", data)
    served.range_support = False
    served.cut_after["/norange.bin"] = 10_000
    with pytest.raises(DataError):
        fetch(url, sha256(data), attempts=1)
    assert fetch(url, sha256(data)).read_bytes() == data


def test_mirror_folder_is_verified_and_read_in_place(tmp_path, cache):
    folder = tmp_path / "mirror"
    folder.mkdir()
    data = b"ein Satz\n"
    (folder / "news.de").write_bytes(data)
    url = "https://upstream.invalid/some/path/news.de"
    assert fetch(url, sha256(data), mirror=str(folder)) == folder / "news.de"
    with pytest.raises(DataError, match="news.de.*expected 0+, actual"):
        fetch(url, "0" * 64, mirror=str(folder))
    assert (folder / "news.de").exists()  # a mirror's file is never deleted
    with pytest.raises(DataError, match=r"other\.de: not found in mirror folder"):
        fetch("https://upstream.invalid/other.de", sha256(data), mirror=str(folder))
    assert cached_files(cache) == []


def test_mirror_url_keeps_the_file_name(served):
    data = b"a sentence\n"
    served.add("/mirror/news.en", data)
    path = fetch("https://upstream.invalid/deep/path/news.en", sha256(data), mirror=served.url + "/mirror/")
    assert path.read_bytes() == data
    assert served.requests == [("/mirror/news.en", None)]


def tar_bytes(members: dict[str, bytes], mode: str = "w:gz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_archive_members_are_unpacked_and_gz_members_decompressed(tmp_path):
    tgz = tmp_path / "training-parallel.tgz"
    tgz.write_bytes(tar_bytes({"training/c.de-en.en": b"hello\n", "training/c.de-en.de": b"hallo\n"}))
    tar = tmp_path / "training-giga.tar"
    tar.write_bytes(tar_bytes({"giga.en.gz": gzip.compress(b"big\n"), "other": b"x"}, mode="w"))
    out = tmp_path / "out"
    unpack(tgz, {"training/c.de-en.en": out / "a.en", "training/c.de-en.de": out / "a.de"})
    unpack(tar, {"giga.en.gz": out / "giga.en"})
    gz = tmp_path / "plain.gz"
    gz.write_bytes(gzip.compress(b"plain\n"))
    unpack(gz, {"": out / "plain"})
    assert [(out / n).read_bytes() for n in ("a.en", "a.de", "giga.en", "plain")] == [
        b"hello\n",
        b"hallo\n",
        b"big\n",
        b"plain\n",
    ]
    assert not list(out.glob("*.part"))
    with pytest.raises(DataError, match="no member training/missing"):
        unpack(tgz, {"training/missing": out / "m"})
