"""`nmt serve` as a real process on 127.0.0.1, with the trained reversal model: both request formats,
concurrent clients, bad input, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

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
            if m := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
                self.url = m.group(1)
                break
        self.reader = threading.Thread(target=self.drain, daemon=True)
        self.reader.start()

    def drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def request(self, path: str, body=None, raw: bytes | None = None) -> tuple[int, object]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(synthetic_run):
    s = Server(synthetic_run / "checkpoints" / "best.pt", "--batch-wait-ms", "20", "--max-chars", "2000")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def reverse(line: str) -> str:
    return " ".join(reversed(line.split()))


def test_libretranslate_requests(server):
    assert server.request("/translate", {"q": "a b c", "source": "xx", "target": "yy"}) == (
        200,
        {"translatedText": "c b a"},
    )
    status, body = server.request(
        "/translate", {"q": ["a b", "p o n\n\nc d e"], "source": "auto", "target": "yy"}
    )
    assert status == 200 and body == {"translatedText": ["b a", "n o p\n\ne d c"]}
    status, langs = server.request("/languages")
    assert status == 200 and langs[0]["code"] == "xx" and langs[0]["targets"] == ["yy"]
    assert server.request("/health")[1]["status"] == "ok"


def test_opennmt_requests(server):
    status, body = server.request(
        "/translator/translate", [{"src": "a b c", "id": 100}, {"src": "d e", "id": 100}]
    )
    assert status == 200
    assert [x["tgt"] for x in body[0]] == ["c b a", "e d"]
    assert all(x["n_best"] == 1 and x["pred_score"] < 0 for x in body[0])


def test_concurrent_requests_get_their_own_answers_equal_to_nmt_translate(server, synthetic_run):
    lines = (synthetic_run / "data" / "valid.xx").read_text().splitlines()[:50]
    expected = subprocess.run(
        [sys.executable, "-m", "nmt", "translate", "-m", str(synthetic_run / "checkpoints" / "best.pt")],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    ).stdout.split("\n")[:-1]
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(
            pool.map(lambda q: server.request("/translate", {"q": q, "source": "xx", "target": "yy"}), lines)
        )
    assert all(status == 200 for status, _ in answers)
    assert [body["translatedText"] for _, body in answers] == expected
    learned = [body["translatedText"] == reverse(q) for (_, body), q in zip(answers, lines, strict=True)]
    assert sum(learned) > 40  # the answers are translations, so being equal means something


@pytest.mark.parametrize(
    "path, body, raw, status",
    [
        ("/translate", None, b"{not json", 400),
        ("/translate", {"q": "a b", "source": "en", "target": "fr"}, None, 400),
        ("/translate", {"q": "a " * 1500, "source": "xx", "target": "yy"}, None, 413),
        ("/translate", {"q": "", "source": "xx", "target": "yy"}, None, 400),
        ("/translate", {"q": 5}, None, 400),
        ("/translator/translate", {"src": "a"}, None, 400),
        ("/nowhere", {}, None, 404),
    ],
)
def test_bad_requests_get_a_json_error_and_the_server_keeps_serving(server, path, body, raw, status):
    got, answer = server.request(path, body, raw)
    assert got == status and isinstance(answer["error"], str) and answer["error"]
    assert server.request("/translate", {"q": "a b", "source": "xx", "target": "yy"}) == (
        200,
        {"translatedText": "b a"},
    )


def test_sigterm_finishes_the_request_in_flight_then_exits_0(synthetic_run):
    s = Server(synthetic_run / "checkpoints" / "best.pt", "--batch-wait-ms", "1500")
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(s.request, "/translate", {"q": "a b c", "source": "xx", "target": "yy"})
        time.sleep(0.5)  # the request waits in the batching window
        assert s.stop() == 0
        assert pending.result(timeout=30) == (200, {"translatedText": "c b a"})
    s.reader.join(timeout=10)
    log = "".join(s.log)
    assert "SIGTERM" in log and "POST /translate 200" in log and "Traceback" not in log
