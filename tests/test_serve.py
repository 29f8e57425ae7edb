"""`nmt serve` as a real process on 127.0.0.1, with the trained reversal model: both request formats,
concurrent clients, hostile input, fairness, LibreTranslate's fields, metrics and a clean stop on SIGTERM.
The worker's scheduling and failure isolation are also tested directly, with a stand-in translator."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
pytest.importorskip("starlette", reason="nmt serve needs its extra: pip install 'nmt[serve]'")

from nmt.config import DecodeConfig  # noqa: E402
from nmt.errors import NmtError  # noqa: E402
from nmt.serve import Batcher, Metrics, ServeSettings  # noqa: E402
from nmt.translate import token_batches  # noqa: E402

from .conftest import cli, one_error_line  # noqa: E402
from .servers import ENV, Server, libre  # noqa: E402, F401


@pytest.fixture(scope="module")
def served(synthetic_run) -> list[str]:
    """What `nmt serve` is given to serve the reversal model: tests/test_serve_ctranslate2.py gives its
    CTranslate2 export instead, and runs the tests that take this fixture again on that engine."""
    return [str(synthetic_run / "checkpoints" / "best.pt")]


@pytest.fixture(scope="module")
def server(served):
    s = Server(*served, "--batch-wait-ms", "20", "--max-chars", "2000")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def reverse(line: str) -> str:
    return " ".join(reversed(line.split()))


def test_libretranslate_requests(server):
    assert server.request("/translate", libre("a b c")) == (200, {"translatedText": "c b a"})
    status, body = server.request("/translate", libre(["a b", "p o n\n\nc d e"]))
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


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
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
        answers = list(pool.map(lambda q: server.request("/translate", libre(q)), lines))
    assert all(status == 200 for status, _ in answers)
    assert [body["translatedText"] for _, body in answers] == expected
    learned = [body["translatedText"] == reverse(q) for (_, body), q in zip(answers, lines, strict=True)]
    assert sum(learned) > 40  # the answers are translations, so being equal means something


@pytest.mark.parametrize(
    "path, body, raw, status",
    [
        ("/translate", None, b"{not json", 400),
        ("/translate", None, b'{"q": "a \xff b"}', 400),  # not UTF-8
        ("/translate", None, b'{"q": "a \\ud800 b"}', 400),  # a lone surrogate
        ("/translate", [1, 2], None, 400),
        ("/translate", {"q": "a b", "source": "en", "target": "fr"}, None, 422),
        ("/translate", {"q": "a " * 1500, "source": "xx", "target": "yy"}, None, 413),
        ("/translate", {"q": "", "source": "xx", "target": "yy"}, None, 422),
        ("/translate", {"q": 5}, None, 422),
        ("/translate", {"q": ["a", 5]}, None, 422),
        ("/translate", {"q": "a", "format": "pdf"}, None, 422),
        ("/translate", {"q": "a", "alternatives": -1}, None, 422),
        ("/translator/translate", {"src": "a"}, None, 400),
        ("/translator/translate", [{"src": 7}], None, 422),
        ("/nowhere", {}, None, 404),
    ],
)
def test_bad_requests_get_a_json_error_and_the_server_keeps_serving(server, path, body, raw, status):
    got, answer = server.request(path, body, raw)
    assert got == status and isinstance(answer["error"], str) and answer["error"]
    assert server.request("/translate", libre("a b")) == (200, {"translatedText": "b a"})


def multipart(fields: dict[str, bytes], boundary: bytes = b"XyZ", head: bytes = b"") -> bytes:
    """A multipart/form-data body; `head`: more header lines for every part."""
    parts = [
        b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n%s\r\n%s\r\n' % (boundary, k.encode(), head, v)
        for k, v in fields.items()
    ]
    return b"".join(parts) + b"--%s--\r\n" % boundary


MULTIPART = "multipart/form-data; boundary=XyZ"
NESTED = b"--In\r\nContent-Type: text/plain\r\n\r\na b\r\n--In--\r\n"


@pytest.mark.parametrize(
    "raw, ctype, message",
    [
        (b"[" * 30000 + b"]" * 30000, "application/json", "nested too deeply"),  # was RecursionError
        (b'{"q": "a b", "alternatives": 1' + b"0" * 5000 + b"}", "application/json", "4300 digits"),
        (  # a part that is itself multipart: was AttributeError
            multipart({"q": NESTED}, head=b"Content-Type: multipart/mixed; boundary=In\r\n"),
            MULTIPART,
            "itself multipart",
        ),
        (  # a charset whose codec raises UnicodeError, not UnicodeDecodeError
            multipart({"q": b"a." * 40 + b".."}, head=b"Content-Type: text/plain; charset=punycode\r\n"),
            MULTIPART,
            "not valid text",
        ),
        (multipart({"q": b"a"}, head=b"Content-Type: text/plain; charset=rot13\r\n"), MULTIPART, "text"),
    ],
)
def test_what_the_parsers_raise_is_the_clients_error_in_json(server, raw, ctype, message):
    """Every exception met while a request is read, parsed or validated is a JSON 400, with no traceback
    in the log: issue 29's probes, each a 500 with a traceback before."""
    status, answer = server.request("/translate", raw=raw, ctype=ctype)
    assert status == 400 and message in answer["error"], answer
    assert server.request("/translate", libre("a b")) == (200, {"translatedText": "b a"})
    assert "Traceback" not in "".join(server.log)


def test_a_malformed_request_among_good_ones_fails_alone(server):
    good = [f"{a} {b} {c}" for a, b, c in zip("abcdefgh", "ijklmnop", "hgfedcba", strict=True)]
    bad = [b'{"q": "x \\ud800 y", "source": "xx", "target": "yy"}', b'{"q": ["x", 5]}']
    for _ in range(3):
        with ThreadPoolExecutor(max_workers=10) as pool:
            goods = [pool.submit(server.request, "/translate", libre(q)) for q in good[:4]]
            bads = [pool.submit(server.request, "/translate", None, raw) for raw in bad]
            goods += [pool.submit(server.request, "/translate", libre(q)) for q in good[4:]]
            assert [f.result() for f in goods] == [(200, {"translatedText": reverse(q)}) for q in good]
            assert [f.result()[0] for f in bads] == [400, 422]


def test_http_edges_answer_in_json_with_the_right_status(server):
    body = json.dumps(libre("a b c")).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = b"POST /translate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    status, headers, answer = server.raw(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert status == 200 and json.loads(answer) == {"translatedText": "c b a"}
    cases = [
        (head + b"\r\n" + body, 411),  # no Content-Length
        (head + b"Content-Length: -1\r\n\r\n" + body, 400),
        (head + b"Content-Length: 100000000\r\n\r\n", 413),  # refused before a byte of body is read
        (b"PUT /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", 405),
        (b"GET /translate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
        (b"DELETE /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
        (b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
        (b"NONSENSE\r\n\r\n", 400),
    ]
    for request, want in cases:
        start = time.monotonic()
        status, headers, answer = server.raw(request)
        assert (status, headers["content-type"].split(";")[0]) == (want, "application/json"), request
        assert json.loads(answer)["error"] and time.monotonic() - start < 5
    status, headers, _ = server.raw(b"PUT /translate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 405 and headers["allow"] == "POST"


def test_doubled_and_trailing_slashes_reach_the_route(server):
    assert server.request("/languages") == server.request("//languages") == server.request("/languages/")
    assert server.request("/languages")[0] == 200
    for path in ("//translate", "/translate/", "//translate//"):
        assert server.request(path, libre("a b c")) == (200, {"translatedText": "c b a"}), path
    assert server.request("//nowhere/")[0] == 404


def test_libretranslate_fields_auto_alternatives_html_form_and_truncation(server):
    status, body = server.request("/translate", {"q": "a b c", "source": "auto", "target": "yy"})
    assert status == 200
    # "a b c" is too short to detect: taken as the model's source, with the detector's own confidence.
    assert body["translatedText"] == "c b a" and body["detectedLanguage"]["language"] == "xx"
    assert body["detectedLanguage"]["confidence"] < 90 and "too short" in body["detectedLanguage"]["note"]
    status, body = server.request("/translate", libre(["a b", "c d"], source="auto"))
    assert [d["language"] for d in body["detectedLanguage"]] == ["xx", "xx"]
    german = "Ein Mann mit einem orangefarbenen Hut starrt auf etwas."
    status, body = server.request("/translate", {"q": german, "source": "auto", "target": "yy"})
    assert status == 400 and "in de" in body["error"] and "xx to yy" in body["error"]
    status, body = server.request("/detect", {"q": german})
    assert status == 200 and body[0]["language"] == "de" and body[0]["confidence"] > 90
    status, body = server.request("/translate", libre("a b c d", alternatives=2))
    assert status == 200 and body["translatedText"] == "d c b a"
    alternatives = body["alternatives"]
    assert len(alternatives) == 2 and len({body["translatedText"], *alternatives}) == 3
    # A block is translated whole, its inline tags on the words the model's attention aligns them to.
    html = '<p class="x">a b <b>c d</b> e</p>\n<ul><li>f g</li></ul><script>var a = "b c";</script>'
    status, body = server.request("/translate", libre(html, format="html"))
    assert status == 200
    if "CTranslate2" in "".join(server.log):  # no attention to read: tags placed by relative position
        alone = body["translatedText"]
        assert re.sub(r"<[^>]*>", "", alone) == 'e d c b a\ng fvar a = "b c";'
        assert re.search(r"<b>\w \w</b>", alone) and alone.endswith('<script>var a = "b c";</script>')
    else:
        alone = '<p class="x">e <b>d c</b> b a</p>\n<ul><li>g f</li></ul><script>var a = "b c";</script>'
        assert body["translatedText"] == alone
    status, body = server.request("/translate", libre(["x", html, "<i>p</i> o"], format="html"))
    assert body["translatedText"][1] == alone  # the same alone or among others
    # LibreTranslate's Python client: form-encoded, with an api_key (accepted and ignored).
    form = b"q=a+b+c&source=xx&target=yy&format=text&api_key=secret&alternatives=1"
    status, body = server.request("/translate", raw=form, ctype="application/x-www-form-urlencoded")
    assert status == 200 and body["translatedText"] == "c b a" and len(body["alternatives"]) == 1
    # LibreTranslate's own web page: a FormData, sent as multipart/form-data.
    fields = {"q": "a b c", "source": "xx", "target": "yy", "format": "text", "api_key": ""}
    ctype = MULTIPART
    form = multipart({k: v.encode() for k, v in fields.items()})
    status, body = server.request("/translate", raw=form, ctype=ctype)
    assert (status, body) == (200, {"translatedText": "c b a"})
    status, body = server.request("/translate", raw=b"no parts here", ctype=ctype)
    assert status == 400 and "boundary" in body["error"]
    long_line = " ".join("abcdefghijklmnop"[i % 16] for i in range(100))  # 100 subwords, the model has 63
    status, body = server.request("/translate", libre(f"a b\n{long_line}"))
    assert status == 200 and body["truncated"] == [2]
    status, body = server.request("/translate", libre(["a", long_line]))
    assert body["truncated"] == [[], [1]]
    status, body = server.request("/detect", {"q": "a b"})
    assert status == 200 and body[0]["confidence"] < 90  # the detector's real answer, unsure


def test_a_paragraph_comes_back_as_its_sentences_translated_alone(server):
    sentences = ["a b c.", "D e!", "F g h?", "I j k l."]  # capitals: pysbd splits before them
    paragraph = "  ".join(sentences[:2]) + " " + "\t".join(sentences[2:])
    alone = [server.request("/translate", libre(s))[1]["translatedText"] for s in sentences]
    status, body = server.request("/translate", libre(paragraph))
    assert status == 200
    assert body["translatedText"] == "  ".join(alone[:2]) + " " + "\t".join(alone[2:])
    status, body = server.request("/translate", libre(paragraph, split_sentences=False))
    assert status == 200 and body["translatedText"] != "  ".join(alone[:2]) + " " + "\t".join(alone[2:])


def test_metrics_in_prometheus_text(server):
    server.request("/translate", libre("a b"))
    server.request("/nowhere")
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    counts = {k: float(v) for k, v in re.findall(r"^nmt_requests_total\{(.*)\} (\S+)$", text, re.M)}
    assert counts['method="POST",route="/translate",status="200"'] >= 1
    assert counts['method="GET",route="other",status="404"'] >= 1
    assert re.search(r'^nmt_request_seconds_bucket\{le="\+Inf",route="/translate"\} [1-9]', text, re.M)
    for series in ("nmt_batch_lines_count", "nmt_decode_seconds_count", "nmt_queue_seconds_count"):
        assert re.search(rf"^{series} [1-9]", text, re.M), series
    assert re.search(r"^nmt_source_tokens_total [1-9]", text, re.M)
    assert re.search(r"^nmt_translated_characters_total [1-9]", text, re.M)
    assert re.search(r"^nmt_queue_lines 0(\.0)?$", text, re.M)
    assert re.search(r"^nmt_requests_in_flight 1(\.0)?$", text, re.M)  # this request
    assert re.search(r"^process_open_fds [1-9]", text, re.M)  # the process collector


def test_metrics_labels_are_a_fixed_set_whatever_the_requests(server):
    """Made-up methods and paths count as "other": they added a series each, for good."""
    for i in range(40):
        server.raw(b"M%dX /made-up-%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % (i, i))
        server.raw(b"M%dX /translate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % i)
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    labels = re.findall(r"^nmt_requests_total\{(.*)\} ", text, re.M)
    assert not [x for x in labels if "M1X" in x or "made-up" in x]
    assert 'method="other",route="/translate",status="405"' in labels
    methods = {re.search(r'method="([^"]*)"', x).group(1) for x in labels}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "other"}


def test_a_page_on_another_origin_may_call_the_server(server):
    """CORS as LibreTranslate offers it (any origin by default): the preflight was a 405."""
    preflight = (
        b"OPTIONS /translate HTTP/1.1\r\nHost: x\r\nOrigin: http://elsewhere.example\r\n"
        b"Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n"
        b"Connection: close\r\n\r\n"
    )
    status, headers, _ = server.raw(preflight)
    assert status in (200, 204) and headers["access-control-allow-origin"] == "*"
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"].lower() == "content-type"
    body = json.dumps(libre("a b")).encode()
    status, headers, answer = server.raw(
        b"POST /translate HTTP/1.1\r\nHost: x\r\nOrigin: http://elsewhere.example\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (len(body), body)
    )
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert json.loads(answer)["translatedText"] == "b a"


def test_cors_origins_are_checked_once():
    assert ServeSettings(cors_origins="https://a.example, http://b.example:8080").check().origins == [
        "https://a.example",
        "http://b.example:8080",
    ]
    for bad in ("a.example", "https://a.example/path"):
        with pytest.raises(NmtError, match="--cors-origins"):
            ServeSettings(cors_origins=bad).check()


def test_a_port_out_of_range_is_one_line_before_any_model_loads(tmp_path):
    assert ServeSettings(port=0).check().port == 0  # 0: a free one, picked when the server listens
    for port in ("-1", "65536", "70000"):
        # the model does not exist: naming --port shows the port was checked first
        result = cli("serve", "-m", tmp_path / "missing.pt", "--port", port)
        assert result.returncode == 2, result
        line = one_error_line(result.stderr, "--port", port)
        with pytest.raises(NmtError, match=f"^--port {port}: ") as refused:  # the library says the same
            ServeSettings(port=int(port)).check()
        assert line.endswith(str(refused.value)), (line, refused.value)


def test_the_page_shows_the_pair_and_settings(server):
    with urllib.request.urlopen(server.url + "/", timeout=10) as r:
        page = r.read().decode()
    assert "xx to yy" in page and "<dt>beam</dt><dd>4</dd>" in page
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing from elsewhere: works offline
    # The model by its file (or folder) name: no server path on the page or in /health.
    name = server.request("/health")[1]["model"]
    assert name in ("best.pt", "reversal-ct2") and f"<dt>model</dt><dd>{name}</dd>" in page
    assert "checkpoints" not in page and "/tmp" not in page


@pytest.mark.slow  # a 10,000-line request beside it
def test_a_one_line_request_beside_a_10000_line_one_is_answered_within_a_few_seconds(served):
    s = Server(*served, "--max-chars", "40000")  # the default budget
    try:
        big = "\n".join("abcdefghijklmnop"[i % 16] + " a" * (i % 2) for i in range(10000))
        with ThreadPoolExecutor(max_workers=2) as pool:
            start = time.monotonic()
            pending = pool.submit(s.request, "/translate", libre(big))
            time.sleep(1)  # the big request is being translated
            small_start = time.monotonic()
            assert s.request("/translate", libre("a b c")) == (200, {"translatedText": "c b a"})
            small = time.monotonic() - small_start
            status, body = pending.result(timeout=300)
            whole = time.monotonic() - start
        assert status == 200 and body["translatedText"].split("\n")[:3] == ["a", "a b", "c"]
        assert small < 3 and small < whole / 3, (small, whole)
    finally:
        assert s.stop() == 0


@pytest.mark.slow  # 9 s of deadlines
def test_a_full_queue_answers_503_and_a_late_request_504(served):
    s = Server(*served, "--max-chars", "80000", "--max-queue", "100")
    big = "\n".join(["a b c d"] * 8000)  # seconds of work, on either engine
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(s.request, "/translate", libre(big))
            wait_for_the_model(s, pending)
            req = urllib.request.Request(
                s.url + "/translate", data=json.dumps(libre("a b")).encode(), method="POST"
            )
            with pytest.raises(urllib.error.HTTPError) as busy:
                urllib.request.urlopen(req, timeout=30)
            assert busy.value.code == 503 and busy.value.headers["Retry-After"] == "1"
            assert json.loads(busy.value.read())["error"].startswith("busy")
            assert pending.result(timeout=300)[0] == 200
    finally:
        assert s.stop() == 0
    # Five times the lines: CTranslate2 on an AMX CPU translated the 8,000 within the 1 s deadline
    s = Server(*served, "--max-chars", "400000", "--timeout", "1")
    try:
        status, body = s.request("/translate", libre("\n".join(["a b c d"] * 40000)))
        assert status == 504 and "1 s" in body["error"]
        assert s.request("/translate", libre("a b")) == (200, {"translatedText": "b a"})
    finally:
        assert s.stop() == 0


@pytest.mark.slow  # 8 s: a server stopped under load
def test_sigterm_answers_in_flight_and_exits_0_whatever_the_clients_do(synthetic_run):
    # The stalled body gets its 408 at the read deadline, after which the server can exit: 4 s rather
    # than the default 10 keep the test short, and still far past the clients' setup.
    s = Server(synthetic_run / "checkpoints" / "best.pt", "--batch-wait-ms", "1500", "--read-timeout", "4")
    try:
        body = json.dumps(libre("a b")).encode()
        request = b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        idle = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        idle.sendall(request)
        answer = b""
        while b'"b a"}' not in answer:  # answered, and the connection stays open
            answer += idle.recv(65536)
        stalled = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        stalled.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"q": ')
        slow = []
        for i in range(200):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
            c.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /heal")
            slow.append(c)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(s.request, "/translate", libre("a b c"))
            time.sleep(0.5)  # the request waits in the batching window
            start = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(timeout=40) == 0
            seconds = time.monotonic() - start
            assert pending.result(timeout=30) == (200, {"translatedText": "c b a"})
        assert seconds < 30
        assert idle.recv(65536) == b""  # the idle keep-alive connection was closed, not served on
        for c in [idle, stalled, *slow]:
            c.close()
        s.reader.join(timeout=10)
        log = "".join(s.log)
        assert "SIGTERM" in log and "POST /translate 200" in log and "Traceback" not in log
    finally:
        if s.proc.poll() is None:  # a failed assertion must not leave the server running
            s.proc.kill()


@pytest.mark.slow  # a long request, then the signal's grace period
def test_sigterm_during_a_long_request_answers_503_in_json_and_exits_0_in_time(served):
    """A request the model cannot finish within --shutdown-timeout gets a JSON 503 in time, and the process
    exits 0: it got a plain-text 500 and the process died by SIGABRT (the worker thread was inside a torch
    operation while the interpreter tore down)."""
    s = Server(*served, "--max-chars", "200000", "--shutdown-timeout", "1")
    try:
        big = "\n".join(["a b c d e f g h i j k l m n o p"] * 5000)  # seconds of work, on either engine
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(s.request, "/translate", libre(big))
            wait_for_the_model(s, pending)
            start = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(timeout=30) == 0
            seconds = time.monotonic() - start
            status, body = pending.result(timeout=30)
        assert status == 503 and "shutting down" in body["error"]
        assert seconds < 1 + 2  # the shutdown timeout, and the interpreter's exit on a busy machine
        s.reader.join(timeout=10)
        assert "Traceback" not in "".join(s.log) and "terminate called" not in "".join(s.log)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def wait_for_the_model(s: Server, pending) -> None:
    """Until the request being sent is queued for the model."""
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(s.url + "/metrics", timeout=10) as r:
            if not re.search(r"^nmt_queue_lines 0(\.0)?$", r.read().decode(), re.M):
                return
        assert time.monotonic() < deadline and not pending.done()
        time.sleep(0.02)


@pytest.mark.slow  # 5 s of read deadlines
def test_slow_clients_are_cut_off_and_leave_no_traceback(synthetic_run):
    s = Server(synthetic_run / "checkpoints" / "best.pt", "--read-timeout", "1")
    try:
        half = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(50)]
        for c in half:
            c.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        heads = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(50)]
        for c in heads:
            c.sendall(b"POST /translate HTTP/1.1\r\n")
        assert s.request("/translate", libre("a b")) == (200, {"translatedText": "b a"})
        time.sleep(2.5)
        for c in half + heads:  # each got a 408 in JSON, then the server closed the connection
            answer = c.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408") and b'"error"' in answer, answer
            assert c.recv(65536) == b""
            c.close()
        assert s.request("/translate", libre("a b")) == (200, {"translatedText": "b a"})
    finally:
        assert s.stop() == 0
    assert "Traceback" not in "".join(s.log)


# ---- the worker, with a stand-in translator ---------------------------------------------------------


class FakeTranslator:
    """Reverses id lists; fails a whole batch whenever it holds the poisoned id 99."""

    def __init__(self, beam: int = 1, **decode):
        # max_len_b 0: a line's cost is its length, unless a test says otherwise
        self.decode = DecodeConfig(**{"beam": beam, "batch_tokens": 8192, "max_len_b": 0, **decode})
        self.max_source = 63
        self.batches: list[list[list[int]]] = []

    def search_sources(self, count, sources, forced=None, nbest=None):
        self.batches.append(list(sources.values()))
        if any(99 in ids for ids in sources.values()):
            raise RuntimeError("poisoned")
        out = [[("", 0.0)] for _ in range(count)]
        for i, ids in sources.items():
            out[i] = [(" ".join(map(str, reversed(ids))), -1.0)]
        return out


def batcher(translator, max_batch_tokens: int | None = None, **settings) -> Batcher:
    import dataclasses

    from rich.console import Console

    if max_batch_tokens is not None:  # the batch budget is the translator's decode.batch_tokens
        translator.decode = dataclasses.replace(translator.decode, batch_tokens=max_batch_tokens)
    return Batcher(translator, ServeSettings(**settings), Metrics(), Console(quiet=True))


def test_a_failing_batch_is_retried_one_by_one_so_only_the_faulty_request_fails():
    t = FakeTranslator()
    b = batcher(t, batch_wait_ms=200)
    try:
        far = time.monotonic() + 30
        with b.cond:  # all queued before the worker looks
            jobs = [b.submit({0: [1, 2], 1: [3]}, 2, 1, far), b.submit({0: [99]}, 1, 1, far)]
            jobs.append(b.submit({0: [4, 5]}, 1, 1, far))
        assert jobs[0].future.result(10) == [[("2 1", -1.0)], [("3", -1.0)]]
        assert jobs[2].future.result(10) == [[("5 4", -1.0)]]
        with pytest.raises(RuntimeError, match="poisoned"):
            jobs[1].future.result(10)
        assert len(t.batches[0]) == 4  # they were batched together first, then retried alone
        assert b.submit({0: [6]}, 1, 1, far).future.result(10) == [[("6", -1.0)]]  # the worker lives
    finally:
        b.close(5)


class SlowTranslator(FakeTranslator):
    """A FakeTranslator whose every batch takes `seconds`."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def search_sources(self, count, sources, forced=None, nbest=None):
        time.sleep(self.seconds)
        return super().search_sources(count, sources, forced, nbest)


def test_the_worker_gives_kept_memory_back_once_nothing_waits(monkeypatch):
    """A CPU search keeps its freed buffers for the next step (nmt.device.keep_freed_buffers); the worker
    gives them back when its queue is empty, not between batches while requests wait."""
    import nmt.serve.batcher

    waiting = []
    monkeypatch.setattr(nmt.serve.batcher, "release_freed_memory", lambda: waiting.append(len(b.jobs)))
    t = SlowTranslator(0.05)
    b = batcher(t, max_batch_tokens=2, batch_wait_ms=0)  # each request a batch of its own
    try:
        far = time.monotonic() + 30
        with b.cond:
            jobs = [b.submit({0: [1, 2]}, 1, 2, far), b.submit({0: [3, 4]}, 1, 2, far)]
        assert [job.future.result(10) for job in jobs] == [[[("2 1", -1.0)]], [[("4 3", -1.0)]]]
        deadline = time.monotonic() + 5
        while not waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(t.batches) == 2 and waiting == [0]  # once, after the second batch: none waited then
    finally:
        b.close(5)


def test_a_request_alone_starts_at_once_and_requests_that_come_together_wait_the_window_for_company():
    """The batch window is for requests that come together: one alone (the model idle, or a client's
    next line after a batch of its own) is not held for company that does not come; after a batch of
    several requests, the next one waits the window for others."""
    t = SlowTranslator(0.1)
    b = batcher(t, batch_wait_ms=1000)
    try:
        far = time.monotonic() + 30
        for ids in ([1, 2], [3]):  # a client's lines one after the other, each sent on the last's answer
            start = time.monotonic()
            assert b.submit({0: ids}, 1, 1, far).future.result(10) == [
                [(" ".join(map(str, ids[::-1])), -1.0)]
            ]
            assert time.monotonic() - start < 0.7  # its 0.1 s, not the window's 1 s more
        with b.cond:  # two requests at once: one batch
            pair = [b.submit({0: [4]}, 1, 1, far), b.submit({0: [5]}, 1, 1, far)]
        assert [job.future.result(10) for job in pair] == [[[("4", -1.0)]], [[("5", -1.0)]]]
        first = b.submit({0: [6]}, 1, 1, far)  # requests come together now: the window holds it
        time.sleep(0.3)
        second = b.submit({0: [7, 8]}, 1, 1, far)
        assert first.future.result(10) == [[("6", -1.0)]] and second.future.result(10) == [[("8 7", -1.0)]]
        assert t.batches == [[[1, 2]], [[3]], [[4], [5]], [[6], [7, 8]]]
    finally:
        b.close(5)


def test_an_answer_leaves_with_its_lines_already_out_of_the_queue_gauge():
    """A client that reads /metrics as soon as it has its answer must find the queue without its lines and
    the answer and its batch counted: the worker took them off after answering, and a busy machine showed
    them waiting."""
    t = FakeTranslator()
    b = batcher(t, batch_wait_ms=50)
    seen = []
    try:
        far = time.monotonic() + 30
        with b.cond:
            job = b.submit({0: [1, 2], 1: [3]}, 2, 1, far)
            # Runs in the worker, at the instant the answer is given.
            job.future.add_done_callback(
                lambda _: seen.append(
                    (
                        b.metrics.queue._value.get(),
                        b.metrics.characters._value.get(),
                        b.metrics.batches._sum.get(),  # lines in the batches observed
                    )
                )
            )
            assert b.metrics.queue._value.get() == 2
        assert job.future.result(10) == [[("2 1", -1.0)], [("3", -1.0)]]
        assert seen == [(0, len("2 1") + len("3"), 2)]
    finally:
        b.close(5)


def test_a_large_request_is_served_in_pieces_in_turn_with_others():
    t = FakeTranslator(beam=4)
    # Lines of 4 subwords cost beam x (4 + EOS) = 20: two fit a budget of 40, as nmt translate counts.
    b = batcher(t, max_batch_tokens=40, batch_wait_ms=100)
    try:
        far = time.monotonic() + 30
        with b.cond:  # both queued before the worker looks
            big = b.submit({i: [1, 2, 3, 4] for i in range(10)}, 10, 1, far)
            small = b.submit({0: [7, 7, 7, 7]}, 1, 1, far)
        small.future.result(10)
        big.future.result(10)
        # The big request's first piece fills a batch; the small one goes next, before the big one's rest.
        assert [len(batch) for batch in t.batches] == [2, 1, 2, 2, 2, 2]
        assert t.batches[1] == [[7, 7, 7, 7]]
    finally:
        b.close(5)


def test_batches_of_tiny_lines_are_costed_by_the_steps_their_search_may_take():
    """10,000 one-word lines at the default settings: each batch costs what nmt translate's would, counting
    the max_len_b steps a one-word line may decode; costed by the sources alone, batches held 1,024 of
    them and a one-line request beside them waited seconds."""
    t = FakeTranslator(beam=4, max_len_a=1.0, max_len_b=50)
    b = batcher(t)
    try:
        far = time.monotonic() + 60
        with b.cond:  # both queued before the worker looks
            big = b.submit({i: [5] for i in range(10000)}, 10000, 1, far)
            small = b.submit({0: [6, 7]}, 1, 1, far)
        small.future.result(30)
        big.future.result(30)
        per_line = 4 * (1 + 50 + 1)  # beam x (the word's output limit and its EOS)
        assert max(len(batch) for batch in t.batches) == 8192 // per_line
        assert [6, 7] in t.batches[1]  # the small request rode in the second batch
        lengths = [2] * 10000  # the front end of nmt translate cuts the same batches
        assert len(token_batches(lengths, 8192, 4, t.decode, t.max_source)[0]) == 8192 // per_line
    finally:
        b.close(5)


def serve_once(run: Path, port: int = 0, settings: ServeSettings | None = None, options: dict | None = None):
    from nmt import serve as serve_module
    from nmt.config import DecodeOverrides

    checkpoint, given = run / "checkpoints" / "best.pt", DecodeOverrides.given(**(options or {}))
    settings = dataclasses.replace(settings or ServeSettings(), port=port)
    serve_module.serve(checkpoint, settings, given, "cpu", "fp32", None)


def test_serve_without_its_extra_names_it(monkeypatch, synthetic_run):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(NmtError, match=r"pip install 'nmt\[serve\]'"):
        serve_once(synthetic_run)


def test_the_checkpoint_is_read_once_and_options_are_checked_by_the_config(monkeypatch, synthetic_run):
    import nmt.checkpoint

    reads = []
    real = nmt.checkpoint.load_checkpoint
    monkeypatch.setattr(nmt.checkpoint, "load_checkpoint", lambda p: reads.append(p) or real(p))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(NmtError, match="cannot listen"):  # fails after loading: the model is there
            serve_once(synthetic_run, port=taken.getsockname()[1])
    finally:
        taken.close()
    assert len(reads) == 1
    with pytest.raises(NmtError, match="--beam: must be at least 1"):
        serve_once(synthetic_run, options={"beam": 0})
    with pytest.raises(NmtError, match="--max-queue 0"):
        serve_once(synthetic_run, settings=ServeSettings(max_queue=0))


# ---- the page, in a real headless browser ----------------------------------------------------------


def chromium_binary() -> str | None:
    import shutil

    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


class Browser:
    """Headless Chromium driven over the DevTools protocol (a websocket), in a fresh profile."""

    def __init__(self, binary: str, profile: Path):
        flags = "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
        flags += "--disable-background-networking --disable-component-update --disable-sync"
        cmd = [
            binary,
            *flags.split(),
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline and self.proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        while True:  # the page target appears a moment after the port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.loads(r.read()) if t["type"] == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        from contextlib import ExitStack

        from websockets.sync.client import connect

        self.stack = ExitStack()
        self.ws = self.stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"], max_size=None))
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # events come in between; the answer carries our id
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)
        return value

    def close(self) -> None:
        self.stack.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_the_page_translates_what_is_typed_in_a_real_browser(server, tmp_path):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary: apt-get install chromium (.ci/run installs it)")
    pytest.importorskip("websockets", reason="drives the browser: pip install websockets (the dev extra)")
    browser = Browser(binary, tmp_path / "profile")
    try:
        browser.call("Page.navigate", url=server.url + "/")
        browser.wait_for("document.readyState === 'complete' && !!document.getElementById('source')")
        assert "xx to yy" in browser.evaluate("document.querySelector('h1').textContent")
        browser.evaluate("document.getElementById('source').focus()")
        for char in "a b c d":  # typed key by key, as a person would
            browser.call("Input.dispatchKeyEvent", type="keyDown", text=char, key=char)
            browser.call("Input.dispatchKeyEvent", type="keyUp", key=char)
        assert browser.evaluate("document.getElementById('source').value") == "a b c d"
        shown = browser.wait_for("document.getElementById('result').textContent")
        assert shown == "d c b a"
        assert browser.evaluate("document.getElementById('status').textContent") == ""
        assert browser.evaluate("document.getElementById('count').textContent") == "7 / 2000"
        # The alternatives are shown; a click on one puts it in place of the translation.
        alternatives = "[...document.querySelectorAll('#alternatives li')].map((li) => li.textContent)"
        shown_alternatives = browser.wait_for(alternatives)
        assert len(shown_alternatives) == 2 and "d c b a" not in shown_alternatives
        browser.evaluate("document.querySelector('#alternatives li').click()")
        assert browser.evaluate("document.getElementById('result').textContent") == shown_alternatives[0]
        assert browser.evaluate(alternatives) == ["d c b a", shown_alternatives[1]]
        screenshot(browser, tmp_path / "typed.png")
        # Copy (the clipboard or, without permission, the text selected), then clear.
        browser.evaluate("document.getElementById('copy').click()")
        assert browser.wait_for("document.getElementById('status').textContent") in ("copied", "selected")
        browser.evaluate("document.getElementById('clear').click()")
        assert browser.evaluate("document.getElementById('source').value") == ""
        assert browser.evaluate("document.getElementById('result').textContent") == ""
        assert browser.evaluate("document.getElementById('count').textContent") == "0 / 2000"
        # A .txt file translated, offered for download.
        upload = tmp_path / "in.txt"
        upload.write_text("a b c\np o n\n")
        node = browser.call("Runtime.evaluate", expression="document.getElementById('file')")["result"]
        browser.call("DOM.getDocument")
        browser.call("DOM.setFileInputFiles", files=[str(upload)], objectId=node["objectId"])
        browser.evaluate("document.getElementById('file').dispatchEvent(new Event('change'))")
        href = browser.wait_for(
            "!document.getElementById('download').hidden && document.getElementById('download').href"
        )
        assert browser.evaluate("document.getElementById('download').download") == "in.yy.txt"
        assert href
        # Setting the files may fire `change` itself, beside the event sent above: a second translation
        # of the same file may then replace the link (revoking the first) just after it was read, so the
        # link is read again until one answers.
        fetch_link = """(async () => {
            for (let i = 0; i < 100; i++) {
                try { return await (await fetch(document.getElementById('download').href)).text(); }
                catch (e) { await new Promise((done) => setTimeout(done, 100)); }
            }
            return null;
        })()"""
        text = browser.call("Runtime.evaluate", expression=fetch_link, awaitPromise=True)["result"]["value"]
        assert text == "c b a\nn o p\n"
        # The API box: a curl line that works as it is shown.
        curl = browser.evaluate("document.getElementById('curl').textContent")
        assert curl.startswith(f"curl -s {server.url}/translate ")
        if shutil.which("curl"):
            out = subprocess.run(["sh", "-c", curl], capture_output=True, text=True, timeout=30)
            assert json.loads(out.stdout)["translatedText"]
        browser.evaluate("document.getElementById('api').open = true")
        screenshot(browser, tmp_path / "file-and-api.png")
    finally:
        browser.close()


def screenshot(browser: Browser, path: Path) -> None:
    """A PNG of the page, kept with the test's files (NMT_SCREENSHOTS: a folder to copy it to)."""
    import base64

    data = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    path.write_bytes(data)
    if folder := os.environ.get("NMT_SCREENSHOTS"):
        Path(folder, path.name).write_bytes(data)
