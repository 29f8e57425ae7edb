"""A real `nmt serve` process on 127.0.0.1 for the tests of every file that starts one, and the
LibreTranslate request body they send the reversal model (xx -> yy)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


class Server:
    def __init__(self, model: Path, *options: str):
        cmd = [sys.executable, "-m", "nmt", "serve", "-m", str(model), "--port", "0", *options]
        self.proc = subprocess.Popen(cmd, env=ENV, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + 60
        while True:
            line = self.proc.stderr.readline()
            assert line and time.monotonic() < deadline, "".join(self.log) or "the server did not start"
            self.log.append(line)
            if m := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
                self.port = int(m.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
                break
        self.reader = threading.Thread(target=self.drain, daemon=True)
        self.reader.start()

    def drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def request(self, path: str, body=None, raw: bytes | None = None, method=None, ctype="application/json"):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": ctype}, method=method
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def raw(self, data: bytes, timeout: float = 10) -> tuple[int, dict, bytes]:
        """Bytes sent as they are; the answer's status, headers and body (read until the server closes)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(data)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        return int(lines[0].split()[1]), headers, body

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def libre(q, **fields) -> dict:
    return {"q": q, "source": "xx", "target": "yy", **fields}
