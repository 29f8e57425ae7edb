"""The request path bounded: inputs that froze `nmt serve` (pysbd's backtracking on numbered references,
26,000 nested or stray tags, a glossary matched 300 times in a line, long text to detect) are answered or
refused within --timeout, /health answers meanwhile, SIGTERM stops the server in time without a
traceback, and glossaries read text and terms alike (the dotless i) and refuse what cannot be written."""

from __future__ import annotations

import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow  # a real server driven to its deadlines and signals


pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
pytest.importorskip("hypothesis", reason="property tests: pip install hypothesis (the dev extra)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nmt.sentences import sentence_spans  # noqa: E402
from nmt.serve.detect import Detector  # noqa: E402
from nmt.serve.markup import Document  # noqa: E402

from .servers import Server, libre  # noqa: E402

TIMEOUT = 20  # the server's --timeout: every answer comes within it (and a margin for a busy machine)
REFERENCES = "..[111 111 111 111 111 111 111 111 111 111 111]"  # pysbd issue #79: hours before
NESTED = "<b>" * 26000 + "a" + "</b>" * 26000
STRAY = "<b>" * 26000 + "</i>" * 26000


@pytest.fixture(scope="module")
def server(synthetic_run):
    s = Server(synthetic_run / "checkpoints" / "best.pt", "--timeout", str(TIMEOUT), "--batch-wait-ms", "5")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def timed(s: Server, body: dict) -> tuple[int, dict, float]:
    start = time.monotonic()
    status, answer = s.request("/translate", body)
    return status, answer, time.monotonic() - start


def health_answers_while(s: Server, body: dict) -> tuple[int, dict, float]:
    """`body` sent, and /health asked throughout: each answer within 2 s."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(timed, s, body)
        while not pending.done():
            with urllib.request.urlopen(s.url + "/health", timeout=2) as r:
                assert r.status == 200
            time.sleep(0.05)
        return pending.result()


def test_the_sentence_splitter_is_linear_in_numbered_references():
    for text in (REFERENCES, "..[" + "111 " * 3000 + "111]", "x. " * 3000, "a" * 20000):
        start = time.monotonic()
        spans = sentence_spans(text, "en")
        assert time.monotonic() - start < 5 and spans
        assert all(0 <= a < b <= len(text) for a, b in spans)


@pytest.mark.parametrize(
    "body",
    [
        {"q": REFERENCES},
        {"q": NESTED, "format": "html"},
        {"q": STRAY, "format": "html"},
        {"q": "Ein Hund läuft im Park " * 800, "source": "auto"},
    ],
    ids=["references", "nested", "stray", "long-auto"],
)
def test_pathological_requests_are_answered_in_time_and_health_throughout(server, body):
    status, answer, seconds = health_answers_while(server, {"target": "yy", **body})
    assert status < 500, answer
    assert seconds < TIMEOUT + 5


def test_26000_nested_tags_keep_their_text_and_tags():
    doc = Document(NESTED)
    assert doc.lines() == ["a"]
    assert doc.join(["z"]) == "<b>" * 26000 + "z" + "</b>" * 26000
    assert Document(STRAY).join([]) == STRAY


def test_long_german_is_detected_as_german_with_high_confidence():
    detector = Detector("en")
    for n in (3, 100, 5000):
        d = detector.detect("Ein Hund läuft im Park " * n)
        assert (d.detected, d.sure) == ("de", True) and d.confidence >= 90, (n, d)


def test_glossary_text_and_terms_are_read_alike_and_unwritable_targets_are_refused(server):
    ok = libre("a bıke c. a bike c.", glossary=[{"source": "bike", "target": "b"}])
    status, answer = server.request("/translate", ok)
    assert status == 200, answer
    for target in ("🚲", "\x01", "\u200b"):
        bad = libre(
            "a bike c", glossary=[{"source": "x", "target": "c"}, {"source": "bike", "target": target}]
        )
        status, answer = server.request("/translate", bad)
        assert status == 422 and answer["error"].startswith('"glossary"[1]: the target'), answer
    status, answer, seconds = timed(
        server, libre("bike " * 300, glossary=[{"source": "bike", "target": "b"}])
    )
    assert status == 422 and "glossary terms; at most" in answer["error"] and seconds < 10, answer


FAMILIES = st.one_of(
    st.builds(
        lambda n, sep: "..[" + sep.join(["111"] * n) + "]",
        st.integers(1, 400),
        st.sampled_from([" ", ", ", "-"]),
    ),
    st.builds(
        lambda n, tag: f"<{tag}>" * n + "a" + f"</{tag}>" * n,
        st.integers(0, 20000),
        st.sampled_from(["b", "i", "span"]),
    ),
    st.builds(lambda n: "<b>" * n + "</i>" * n, st.integers(0, 20000)),
    st.builds(
        lambda n, piece: piece * n,
        st.integers(1, 3000),
        st.sampled_from(["x. ", "<img>a ", "<b>a ", "Dr. ", "1. "]),
    ),
    st.text(alphabet="ab .[]1<>/i\"'=", max_size=200),
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=FAMILIES, fmt=st.sampled_from(["text", "html"]), source=st.sampled_from(["xx", "auto"]))
def test_any_body_is_answered_or_refused_within_the_timeout(server, text, fmt, source):
    body = {"q": text, "source": source, "target": "yy", "format": fmt}
    status, answer, seconds = timed(server, body)
    assert status < 500 or status == 504, answer
    assert seconds < TIMEOUT + 5


def test_sigterm_during_a_pathological_request_exits_in_time_without_a_traceback(synthetic_run):
    """It was answered 500 with a CancelledError traceback 185 s later: now the request being prepared is
    answered 503 within --shutdown-timeout, and the process exits 0 (the margin is the interpreter's own
    exit, seconds on a loaded machine whatever the requests)."""
    s = Server(synthetic_run / "checkpoints" / "best.pt", "--shutdown-timeout", "3")
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(timed, s, {"q": STRAY, "format": "html", "target": "yy"})
            time.sleep(0.3)
            start = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            status, answer, _ = pending.result(timeout=30)
            answered = time.monotonic() - start
            assert s.proc.wait(timeout=30) == 0
        assert status in (200, 503) and answered < 3, (status, answer, answered)
        assert time.monotonic() - start < 3 + 10
        s.reader.join(timeout=10)
        assert "Traceback" not in "".join(s.log) and "CancelledError" not in "".join(s.log)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
