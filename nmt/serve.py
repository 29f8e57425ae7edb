"""`nmt serve`: an HTTP translation server with the LibreTranslate and OpenNMT-py request formats.

Routes: `POST /translate` (LibreTranslate: {"q": text or [texts], "source", "target", "format",
"alternatives"} -> {"translatedText": ...}), `POST /detect`, `GET /languages`, `GET /frontend/settings`,
`GET /health`, `GET /metrics` (Prometheus text), `GET /` (a page to try the model) and OpenNMT-py's
`POST /translator/translate` ([{"src", "id"}] -> [[{"src", "tgt", "n_best", "pred_score"}]]).

The HTTP layer is uvicorn (timeouts, connection limit, graceful shutdown) under Starlette (routing). A
request is validated completely and encoded into subwords in its handler, so nothing malformed reaches the
model. One worker thread owns the model (models are not thread-safe): requests are cut into pieces of at
most `max_batch_tokens` (subwords x beam, as `nmt translate` budgets), and each batch takes the next piece
of every waiting request in turn, so a one-line request waits about one batch however large the others
are. A batch that fails is retried piece by piece, so only the faulty request fails; the worker never dies.
On the CPU in fp32 a sentence's translation does not depend on what else shares its batch
(tests/test_invariance.py), so batching changes speed, never answers. The line contract is nmt
translate's: a text's lines are translated one by one and joined again, blank lines stay blank.

Every error, of every route and method, is {"error": "..."} with its status. SIGTERM or SIGINT: stop
accepting, close idle connections, answer the requests in flight, exit 0 within `shutdown_timeout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import json
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import parse_qs

from rich.console import Console

from nmt.config import DecodeConfig, DecodeOverrides
from nmt.errors import NmtError

LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian"}
JSON_TYPES = ("application/json", "text/json", "")  # LibreTranslate's clients often send no type at all
FORM_TYPE = "application/x-www-form-urlencoded"  # what LibreTranslate's Python client sends


@dataclass(frozen=True)
class ServeSettings:
    """The server's limits; the CLI's options, validated here so each message names its option."""

    max_batch_tokens: int = 8192  # subwords x beam in one batch, as nmt translate --max-tokens
    batch_wait_ms: float = 10.0  # how long the first request of a batch waits for others
    max_chars: int = 20000  # characters of text in one request
    max_queue: int = 100000  # source lines waiting for the model; more: 503
    timeout: float = 60.0  # seconds a request may wait for its translation; then 504
    read_timeout: float = 10.0  # seconds to receive a request's headers, and again its body
    keep_alive: float = 5.0  # seconds an idle connection stays open
    max_connections: int = 1000  # open connections (and requests) at once; more are refused
    shutdown_timeout: float = 30.0  # after SIGTERM, seconds to answer what is in flight

    def check(self) -> ServeSettings:
        for option, ok in (
            ("--max-batch-tokens", self.max_batch_tokens >= 1),
            ("--batch-wait-ms", self.batch_wait_ms >= 0),
            ("--max-chars", self.max_chars >= 1),
            ("--max-queue", self.max_queue >= 1),
            ("--timeout", self.timeout > 0),
            ("--read-timeout", self.read_timeout > 0),
            ("--keep-alive", self.keep_alive > 0),
            ("--max-connections", self.max_connections >= 1),
            ("--shutdown-timeout", self.shutdown_timeout > 0),
        ):
            if not ok:
                name = option.removeprefix("--").replace("-", "_")
                raise NmtError(f"{option} {getattr(self, name)}: out of range (see nmt serve --help)")
        return self

    @property
    def max_body(self) -> int:
        """Bytes of body: JSON escapes a character in at most 6 bytes (\\uXXXX), plus room for the fields."""
        return 6 * self.max_chars + 65536


class HTTPError(Exception):
    """A request the server answers with this status and {"error": message}."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


# ---- the model worker ----------------------------------------------------------------------------


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One request's lines (subword ids by line index; blank lines absent), cut into pieces."""

    sources: dict[int, list[int]]
    count: int
    nbest: int
    deadline: float
    pieces: deque  # of lists of line indices, in line order
    queued: int  # lines still waiting
    served: int = 0  # pieces taken into batches so far
    results: list = field(default_factory=list)
    future: Future = field(default_factory=Future)

    def done(self) -> bool:
        return self.future.done()


def settle(job: Job) -> None:
    """Answer a job, unless its handler gave up on it (deadline) a moment before."""
    try:
        job.future.set_result(job.results)
    except InvalidStateError:
        pass


class Batcher:
    """The one thread that runs the model: fair batches from the waiting requests, failures isolated."""

    def __init__(self, translator, settings: ServeSettings, metrics: Metrics, console: Console):
        self.translator, self.settings, self.metrics, self.console = translator, settings, metrics, console
        self.decode: DecodeConfig = translator.decode
        self.max_source = translator.max_source
        self.wait = settings.batch_wait_ms / 1000
        self.cond = threading.Condition()
        self.jobs: deque[Job] = deque()  # jobs with pieces left, in arrival order
        self.queued = 0  # lines waiting, over all jobs
        self.closing = False
        self.thread = threading.Thread(target=self.run, name="nmt-batcher", daemon=True)
        self.thread.start()

    def cost(self, ids: list[int], nbest: int) -> int:
        """Decoder rows x source positions one line takes, as the front end's token_batches counts it."""
        rows = nbest if self.decode.sampling else self.decode.beam
        return rows * (len(ids) + 1)

    def submit(self, sources: dict[int, list[int]], count: int, nbest: int, deadline: float) -> Job:
        """Queue a request's encoded lines; its future gets the n-best of every line (blank: [("", 0.0)])."""
        pieces: deque[list[int]] = deque()
        piece, spent = [], 0
        for i, ids in sources.items():  # line order: a piece is a run of neighbouring lines
            c = self.cost(ids, nbest)
            if piece and spent + c > self.settings.max_batch_tokens:
                pieces.append(piece)
                piece, spent = [], 0
            piece.append(i)
            spent += c
        if piece:
            pieces.append(piece)
        job = Job(sources, count, nbest, deadline, pieces, len(sources))
        job.results = [[("", 0.0)] for _ in range(count)]
        if not pieces:
            job.future.set_result(job.results)
            return job
        with self.cond:
            if self.closing:
                raise QueueFull("the server is shutting down")
            if self.queued + job.queued > self.settings.max_queue and self.queued > 0:
                raise QueueFull(f"{self.queued} lines are waiting for the model")
            self.jobs.append(job)
            self.queued += job.queued
            self.metrics.queue_depth = self.queued
            self.cond.notify()
        return job

    def run(self) -> None:
        while True:
            try:
                batch = self.take()
                if batch is None:
                    return
                if batch:  # empty when every waiting request had passed its deadline
                    self.serve(batch)
            except Exception as e:  # the worker serves every other request: it must not die
                self.console.print(f"[red]batcher error:[/] {type(e).__name__}: {e}", highlight=False)

    def take(self) -> list[tuple[Job, list[int]]] | None:
        """The next batch: one piece from each waiting job in turn, same n-best, within the token budget.

        Jobs served least so far go first (arrival order among equals): a request that just came is in
        the next batch, however many pieces of a large one are still waiting.
        """
        with self.cond:
            while not self.jobs and not self.closing:
                self.cond.wait()
            if not self.jobs:
                return None
            # The window: a lone small request waits a little for others to share its batch.
            end = time.monotonic() + self.wait
            while (
                self.queued_cost() < self.settings.max_batch_tokens and (left := end - time.monotonic()) > 0
            ):
                if self.closing:
                    break
                self.cond.wait(left)
            now, budget, batch = time.monotonic(), self.settings.max_batch_tokens, []
            nbest = None
            for job in sorted(self.jobs, key=lambda j: j.served):
                if job.done() or job.deadline < now:  # answered (timed out or failed) or too late to help
                    self.drop(job, TimeoutError("the deadline passed before the model reached this request"))
                    continue
                if nbest is not None and job.nbest != nbest:
                    continue
                piece = job.pieces[0]
                c = sum(self.cost(job.sources[i], job.nbest) for i in piece)
                if batch and c > budget:
                    continue
                nbest = job.nbest
                job.pieces.popleft()
                job.served += 1
                if not job.pieces:
                    self.jobs.remove(job)
                batch.append((job, piece))
                budget -= c
                if budget <= 0:
                    break
            return batch

    def queued_cost(self) -> int:
        """The cost of what waits, counted only as far as one batch's budget."""
        total = 0
        for job in self.jobs:
            for piece in job.pieces:
                total += sum(self.cost(job.sources[i], job.nbest) for i in piece)
                if total >= self.settings.max_batch_tokens:
                    return total
        return total

    def drop(self, job: Job, error: Exception) -> None:
        """Take a job off the queue (lock held) and fail it unless it is answered already."""
        if job in self.jobs:
            self.jobs.remove(job)
        left = sum(len(p) for p in job.pieces)
        job.pieces.clear()
        self.queued -= left
        self.metrics.queue_depth = self.queued
        try:
            job.future.set_exception(error)
        except InvalidStateError:  # answered or given up on already
            pass

    def serve(self, batch: list[tuple[Job, list[int]]]) -> None:
        lines = sum(len(piece) for _, piece in batch)
        self.metrics.observe_batch(lines)
        try:
            self.translate(batch)
        except Exception:  # one bad request must not fail its batch-mates: retry each alone
            for job, piece in batch:
                try:
                    self.translate([(job, piece)])
                except Exception as e:
                    self.console.print(f"[red]a request failed:[/] {type(e).__name__}: {e}", highlight=False)
                    with self.cond:
                        self.drop(job, e)
        with self.cond:
            self.queued -= lines
            self.metrics.queue_depth = self.queued

    def translate(self, batch: list[tuple[Job, list[int]]]) -> None:
        pairs = [(job, i) for job, piece in batch for i in piece if not job.done()]
        if not pairs:
            return
        t = self.translator
        nbest = batch[0][0].nbest
        if nbest != self.decode.nbest:  # alternatives: the same search, keeping more of the beam
            t.decode = t.engine.decode = dataclasses.replace(self.decode, nbest=nbest)
        try:
            results = t.search_sources(len(pairs), {k: job.sources[i] for k, (job, i) in enumerate(pairs)})
        finally:
            t.decode = t.engine.decode = self.decode
        for (job, i), hyps in zip(pairs, results, strict=True):
            job.results[i] = hyps
        for job, _ in batch:
            if not job.pieces:  # its last piece: the earlier ones were done before
                settle(job)

    def close(self, timeout: float) -> None:
        with self.cond:
            self.closing = True
            for job in list(self.jobs):
                self.drop(job, QueueFull("the server is shutting down"))
            self.cond.notify_all()
        self.thread.join(timeout)


# ---- metrics -------------------------------------------------------------------------------------

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for k, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[k] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        pairs = zip(self.buckets, self.counts, strict=True)
        out = [f'{name}_bucket{{{labels}{sep}le="{b:g}"}} {c}' for b, c in pairs]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        tail = f"{{{labels}}}" if labels else ""
        return [*out, f"{name}_sum{tail} {self.sum:g}", f"{name}_count{tail} {self.count}"]


class Metrics:
    """Prometheus text format, kept by hand: a handful of series needs no client library."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = {}
        self.latency: dict[str, Histogram] = {}
        self.batches = Histogram(BATCH_BUCKETS)
        self.queue_depth = 0

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        with self.lock:
            key = (method, route, status)
            self.requests[key] = self.requests.get(key, 0) + 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def observe_batch(self, lines: int) -> None:
        with self.lock:
            self.batches.observe(lines)

    def render(self) -> str:
        with self.lock:
            out = [
                "# HELP nmt_requests_total HTTP requests answered, by method, route and status.",
                "# TYPE nmt_requests_total counter",
                *(
                    f'nmt_requests_total{{method="{m}",route="{r}",status="{s}"}} {n}'
                    for (m, r, s), n in sorted(self.requests.items())
                ),
                "# HELP nmt_request_seconds Time from a request's arrival to its answer, by route.",
                "# TYPE nmt_request_seconds histogram",
            ]
            for route, h in sorted(self.latency.items()):
                out += h.lines("nmt_request_seconds", f'route="{route}"')
            out += [
                "# HELP nmt_batch_lines Source lines in each batch the model translated.",
                "# TYPE nmt_batch_lines histogram",
                *self.batches.lines("nmt_batch_lines"),
                "# HELP nmt_queue_lines Source lines waiting for the model.",
                "# TYPE nmt_queue_lines gauge",
                f"nmt_queue_lines {self.queue_depth}",
            ]
        return "\n".join(out) + "\n"


# ---- requests: validation, lines, markup -----------------------------------------------------------


def check_text(value, where: str) -> str:
    """A string that can be written as UTF-8 (JSON's \\ud800 escapes give lone surrogates, which are not)."""
    if not isinstance(value, str):
        raise HTTPError(422, f"{where} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HTTPError(400, f"{where}: character {e.start} is a lone surrogate, not text") from None
    return value


def split_lines(text: str) -> list[str]:
    """nmt translate's contract: lines split on \\n only, a trailing \\r dropped."""
    return [line.removesuffix("\r") for line in text.split("\n")]


class Markup(HTMLParser):
    """An HTML fragment as a list of parts: markup kept verbatim, text to translate (str in a list)."""

    RAW = {"script", "style", "code", "pre", "textarea"}  # content that is not prose: kept as it is

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str | list[str]] = []
        self.raw_depth = 0

    def handle_starttag(self, tag, attrs):
        self.parts.append(self.get_starttag_text() or "")
        if tag in self.RAW:
            self.raw_depth += 1

    def handle_startendtag(self, tag, attrs):
        self.parts.append(self.get_starttag_text() or "")

    def handle_endtag(self, tag):
        self.parts.append(f"</{tag}>")
        if tag in self.RAW and self.raw_depth:
            self.raw_depth -= 1

    def handle_data(self, data):
        if self.cdata_elem:  # script and style: the parser hands their text over undecoded
            self.parts.append(data)
        elif self.raw_depth or not data.strip():
            self.parts.append(html.escape(data, quote=False))  # decoded by the parser: encode it again
        else:
            self.parts.append([data])

    def handle_comment(self, data):
        self.parts.append(f"<!--{data}-->")

    def handle_decl(self, decl):
        self.parts.append(f"<!{decl}>")

    def handle_pi(self, data):
        self.parts.append(f"<?{data}>")

    def unknown_decl(self, data):
        self.parts.append(f"<![{data}]>")


def markup_parts(text: str) -> list[str | list[str]]:
    parser = Markup()
    parser.feed(text)
    parser.close()
    return parser.parts


def markup_lines(parts: list[str | list[str]]) -> list[str]:
    """The text nodes to translate, whitespace (newlines included) collapsed: one line each."""
    return [" ".join(p[0].split()) for p in parts if isinstance(p, list)]


def markup_join(parts: list[str | list[str]], translations: list[str]) -> str:
    """The fragment again, each text node replaced by its translation, its outer whitespace kept."""
    it = iter(translations)
    out = []
    for p in parts:
        if isinstance(p, list):
            data = p[0]
            lead, trail = data[: len(data) - len(data.lstrip())], data[len(data.rstrip()) :]
            out.append(lead + html.escape(next(it), quote=False) + trail)
        else:
            out.append(p)
    return "".join(out)


def nth(lines: list[list[tuple[str, float]]], k: int) -> list[str]:
    """The k-th best translation of each line (a blank line's only one where it has fewer)."""
    return [hyps[min(k, len(hyps) - 1)][0] for hyps in lines]


@dataclass
class Text:
    """One text of a request: its lines to translate, and how to put the translations together."""

    lines: list[str]
    parts: list | None = None  # html: the fragment's parts

    def join(self, translations: list[str]) -> str:
        return markup_join(self.parts, translations) if self.parts is not None else "\n".join(translations)


class Service:
    """What the routes do, apart from HTTP: validate, encode, queue, assemble."""

    def __init__(self, batcher: Batcher, subword, src: str, tgt: str, settings: ServeSettings, model: str):
        self.batcher, self.subword, self.src, self.tgt = batcher, subword, src, tgt
        self.settings, self.model_name = settings, model
        self.decode = batcher.decode

    @property
    def max_alternatives(self) -> int:
        d = self.decode
        return 0 if d.sampling else d.beam - 1

    def encode(self, texts: list[Text]) -> tuple[dict[int, list[int]], int, list[list[int]]]:
        """Subword ids of every non-blank line, the line count, and each text's truncated line numbers."""
        lines = [line for t in texts for line in t.lines]
        todo = [i for i, line in enumerate(lines) if line.strip()]
        sources, truncated_at = {}, set()
        limit = self.batcher.max_source
        for i, ids in zip(todo, self.subword.encode([lines[i] for i in todo]), strict=True):
            if len(ids) > limit:
                truncated_at.add(i)
                ids = ids[:limit]
            if ids:  # a line of characters the subword model drops entirely translates to nothing
                sources[i] = ids
        truncated, start = [], 0
        for t in texts:
            truncated.append([i - start + 1 for i in range(start, start + len(t.lines)) if i in truncated_at])
            start += len(t.lines)
        return sources, len(lines), truncated

    async def translate(self, texts: list[Text], nbest: int) -> tuple[list[list], list[list[int]]]:
        """For each text, its lines' n-best lists of (translation, score); and its truncated line numbers."""
        size = sum(len(line) for t in texts for line in t.lines)
        if size > self.settings.max_chars:
            raise HTTPError(
                413, f"{size} characters of text; this server takes at most {self.settings.max_chars}"
            )
        if size > 2000:  # milliseconds of subword encoding: off the event loop, which serves everyone
            sources, count, truncated = await asyncio.to_thread(self.encode, texts)
        else:  # microseconds: a hand-off to a thread would cost more than it saves
            sources, count, truncated = self.encode(texts)
        deadline = time.monotonic() + self.settings.timeout
        try:
            job = self.batcher.submit(sources, count, nbest, deadline)
        except QueueFull as e:
            raise HTTPError(503, f"busy: {e}; try again shortly", {"Retry-After": "1"}) from None
        try:
            results = await asyncio.wait_for(asyncio.wrap_future(job.future), deadline - time.monotonic())
        except (TimeoutError, asyncio.TimeoutError):
            raise HTTPError(
                504, f"no translation within {self.settings.timeout:g} s; try a smaller request"
            ) from None
        except QueueFull as e:
            raise HTTPError(503, str(e), {"Retry-After": "1"}) from None
        except Exception as e:  # the model failed on this request alone (retried by itself)
            raise HTTPError(500, f"translation failed: {type(e).__name__}: {e}") from None
        finally:
            if not job.future.done():  # abandoned (deadline): the worker skips what is left of it
                job.future.cancel()
        out, start = [], 0
        for t in texts:
            out.append(results[start : start + len(t.lines)])
            start += len(t.lines)
        return out, truncated

    def fields(self, body) -> tuple[list[str], bool, str]:
        """LibreTranslate's q, source and target, validated."""
        if not isinstance(body, dict):
            raise HTTPError(400, 'expected a JSON object: {"q": "text", "source": "en", "target": "de"}')
        q = body.get("q")
        single = isinstance(q, str)
        if q is None:
            raise HTTPError(422, 'missing "q": the text to translate')
        if single:
            texts = [check_text(q, '"q"')]
        elif isinstance(q, list):
            texts = [check_text(t, f'"q"[{i}]') for i, t in enumerate(q)]
        else:
            raise HTTPError(422, f'"q" must be a string or a list of strings, got {type(q).__name__}')
        if not any(t.strip() for t in texts):
            raise HTTPError(422, '"q" is empty: nothing to translate')
        source = body.get("source", "auto")
        target = body.get("target", self.tgt)
        for name, value in (("source", source), ("target", target)):
            check_text(value, f'"{name}"')
        if source not in (self.src, "auto") or target != self.tgt:
            raise HTTPError(
                422,
                f"this server translates {self.src} to {self.tgt}, not {source} to {target} (see /languages)",
            )
        return texts, single, source

    async def libretranslate(self, body) -> dict:
        texts, single, source = self.fields(body)
        fmt = body.get("format", "text")
        if fmt not in ("text", "html"):
            raise HTTPError(422, f'"format" must be "text" or "html", not {fmt!r}')
        alternatives = body.get("alternatives", 0)
        if isinstance(alternatives, str) and alternatives.strip().isdigit():  # form fields are strings
            alternatives = int(alternatives)
        if not isinstance(alternatives, int) or isinstance(alternatives, bool) or alternatives < 0:
            raise HTTPError(422, f'"alternatives" must be a whole number 0 or more, got {alternatives!r}')
        # "api_key" and any other field LibreTranslate's clients send are accepted and ignored.
        alternatives = min(alternatives, self.max_alternatives)
        if fmt == "html":
            items = []
            for t in texts:
                parts = markup_parts(t)
                items.append(Text(markup_lines(parts), parts))
        else:
            items = [Text(split_lines(t)) for t in texts]
        nbest = 1 + alternatives
        results, truncated = await self.translate(items, nbest)
        translated = [t.join(nth(r, 0)) for t, r in zip(items, results, strict=True)]
        answer: dict = {"translatedText": translated[0] if single else translated}
        if source == "auto":  # the model has one source language: that is what is "detected"
            detected = {"confidence": 100.0, "language": self.src}
            answer["detectedLanguage"] = detected if single else [detected] * len(texts)
        if alternatives:
            alts = [[t.join(nth(r, k)) for k in range(1, nbest)] for t, r in zip(items, results, strict=True)]
            answer["alternatives"] = alts[0] if single else alts
        if any(truncated):
            answer["truncated"] = truncated[0] if single else truncated
        return answer

    def detect(self, body) -> list:
        self.fields({**body, "source": "auto"} if isinstance(body, dict) else body)  # validated all the same
        return [{"confidence": 100.0, "language": self.src}]

    async def opennmt(self, body) -> list:
        if not (isinstance(body, list) and body and all(isinstance(x, dict) for x in body)):
            raise HTTPError(400, 'expected a non-empty JSON list of {"src": "text", "id": N}')
        texts = [Text(split_lines(check_text(x.get("src"), f'[{i}]["src"]'))) for i, x in enumerate(body)]
        results, _ = await self.translate(texts, 1)
        return [
            [
                {
                    "src": x["src"],
                    "tgt": "\n".join(nth(r, 0)),
                    "n_best": 1,
                    "pred_score": sum(h[0][1] for h in r),
                }
                for x, r in zip(body, results, strict=True)
            ]
        ]

    def languages(self) -> list:
        def name(code: str) -> str:
            return LANGUAGE_NAMES.get(code, code)

        return [
            {"code": self.src, "name": name(self.src), "targets": [self.tgt]},
            {"code": self.tgt, "name": name(self.tgt), "targets": []},
        ]

    def frontend_settings(self) -> dict:
        """What LibreTranslate's web UI reads before it starts."""
        return {
            "charLimit": self.settings.max_chars,
            "frontendTimeout": 500,
            "apiKeys": False,
            "keyRequired": False,
            "suggestions": False,
            "filesTranslation": False,
            "supportedFilesFormat": [],
            "language": {
                "source": {"code": self.src, "name": LANGUAGE_NAMES.get(self.src, self.src)},
                "target": {"code": self.tgt, "name": LANGUAGE_NAMES.get(self.tgt, self.tgt)},
            },
        }

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "source": self.src, "target": self.tgt}

    def settings_shown(self) -> dict:
        d = self.decode
        return {
            "model": self.model_name,
            "source": self.src,
            "target": self.tgt,
            "beam": d.beam,
            "lenpen": d.lenpen,
            "max_chars": self.settings.max_chars,
            "max_alternatives": self.max_alternatives,
        }


# ---- HTTP -------------------------------------------------------------------------------------------

ROUTES = ("/", "/translate", "/detect", "/languages", "/frontend/settings", "/health", "/metrics")
ROUTES += ("/translator/translate",)


def json_bytes(payload) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode("utf-8")


def raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for errors met before a request exists."""
    body = json_bytes({"error": message})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def protocol_class(settings: ServeSettings):
    """uvicorn's h11 protocol with what it lacks for the open internet: a deadline for a request's
    headers (it only times idle keep-alive connections), a connection limit answered in JSON, and JSON
    for malformed HTTP."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > settings.max_connections:
                transport.write(raw_response(503, "Service Unavailable", "too many connections; try again"))
                transport.close()
                return
            self.arm()

        def arm(self) -> None:
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(settings.read_timeout, self.headers_too_slow)

        def disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.between_requests() and not self.transport.is_closing():
                self.arm()  # bytes of a next request: its headers must come within the deadline too
            else:
                self.disarm()

        def on_response_complete(self) -> None:
            self.disarm()  # the keep-alive timer takes over until the next request's first bytes
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self.disarm()
            super().connection_lost(exc)

        def headers_too_slow(self) -> None:
            self.header_timer = None
            if self.between_requests() and not self.transport.is_closing():
                message = f"no complete request headers within {settings.read_timeout:g} s"
                self.transport.write(raw_response(408, "Request Timeout", message))
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            self.transport.write(raw_response(400, "Bad Request", f"malformed HTTP request: {msg}"))
            self.transport.close()

    return Protocol


CLOSE = {"Connection": "close"}  # the rest of an unread body must not be taken for the next request


async def read_body(request, settings: ServeSettings) -> bytes:
    """The body, refused before it is read when it announces too much, and read within read_timeout."""
    from starlette.requests import ClientDisconnect

    length = request.headers.get("content-length")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    if length is None and not chunked:
        raise HTTPError(411, "a POST needs a body with a Content-Length header (or chunked encoding)", CLOSE)
    if length is not None and int(length) > settings.max_body:  # h11 has checked it is a number
        raise HTTPError(
            413, f"a body of {length} bytes; this server takes at most {settings.max_body}", CLOSE
        )
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > settings.max_body:
                raise HTTPError(
                    413, f"a body over {settings.max_body} bytes; this server takes no more", CLOSE
                )

    try:
        await asyncio.wait_for(read(), settings.read_timeout)
    except (TimeoutError, asyncio.TimeoutError):
        raise HTTPError(408, f"the body did not arrive within {settings.read_timeout:g} s", CLOSE) from None
    except ClientDisconnect:
        raise HTTPError(400, "the client left before sending its body") from None
    return bytes(body)


async def parse_body(request, settings: ServeSettings):
    """JSON (or LibreTranslate's form encoding) of valid UTF-8, as Python values."""
    raw = await read_body(request, settings)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the body is not valid UTF-8 (byte {e.start})") from None
    # `curl -d '{...}'` labels JSON as a form: a body that starts like JSON is read as JSON.
    if ctype == FORM_TYPE and not text.lstrip().startswith(("{", "[")):
        try:
            fields = parse_qs(text, keep_blank_values=True, errors="strict")
        except (UnicodeDecodeError, ValueError) as e:
            raise HTTPError(400, f"the form body is not valid: {e}") from None
        return {k: v[0] if len(v) == 1 else v for k, v in fields.items()}
    if ctype not in JSON_TYPES and ctype != FORM_TYPE:
        raise HTTPError(415, f"Content-Type {ctype}: send application/json (or {FORM_TYPE})")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"the body is not valid JSON: {e}") from None


def build_app(service: Service, settings: ServeSettings, metrics: Metrics, console: Console):
    """The Starlette application: routes, JSON errors, metrics and one log line per request."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import HTMLResponse, PlainTextResponse, Response
    from starlette.routing import Route

    def answer(payload, status: int = 200, headers: dict | None = None) -> Response:
        return Response(json_bytes(payload), status, headers, media_type="application/json")

    def post(handler, is_async: bool = True):
        async def endpoint(request):
            body = await parse_body(request, settings)
            return answer(await handler(body) if is_async else handler(body))

        return endpoint

    def get(handler):
        async def endpoint(request):
            return answer(handler())

        return endpoint

    async def page(request):
        return HTMLResponse(page_html(service.settings_shown()))

    async def prometheus(request):
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_error(request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed here"}
        return answer({"error": message.get(exc.status_code, str(exc.detail))}, exc.status_code, exc.headers)

    async def our_error(request, exc: HTTPError) -> Response:
        return answer({"error": str(exc)}, exc.status, exc.headers)

    async def server_error(request, exc: Exception) -> Response:
        return answer({"error": f"internal error: {type(exc).__name__}: {exc}"}, 500)

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/translate", post(service.libretranslate), methods=["POST"]),
        Route("/detect", post(service.detect, is_async=False), methods=["POST"]),
        Route("/translator/translate", post(service.opennmt), methods=["POST"]),
        Route("/languages", get(service.languages), methods=["GET"]),
        Route("/frontend/settings", get(service.frontend_settings), methods=["GET"]),
        Route("/health", get(service.health), methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, HTTPError: our_error, Exception: server_error},
    )

    async def observed(scope, receive, send):
        """Metrics and the log line around every request, whatever answered it."""
        if scope["type"] != "http":
            return await app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, sending)
        finally:
            seconds = time.perf_counter() - start
            route = scope["path"] if scope["path"] in ROUTES else "other"
            metrics.observe_request(scope["method"], route, status[0], seconds)
            if route not in ("/metrics", "/health"):
                console.print(
                    f"{scope['method']} {scope['path'][:100]} {status[0]} {seconds * 1000:.0f} ms",
                    highlight=False,
                    soft_wrap=True,
                )

    return observed


def server_class():
    """uvicorn's Server, told to stop by SIGTERM/SIGINT and then to return (exit 0), not to re-raise it."""
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config, console: Console):
            super().__init__(config)
            self.console = console

        @contextlib.contextmanager
        def capture_signals(self):
            def stop(signum, frame):
                name = signal.Signals(signum).name
                self.console.print(
                    f"{name}: answering the requests in flight, then stopping", highlight=False
                )
                self.handle_exit(signum, frame)

            previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise NmtError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(
    model_path: Path,
    host: str,
    port: int,
    settings: ServeSettings,
    overrides: DecodeOverrides,
    device: str,
    dtype: str,
    console: Console,
) -> None:
    """Load the model, serve until SIGTERM/SIGINT, then answer the requests in flight and return."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise NmtError(f"nmt serve needs its extra ({e}): pip install 'nmt[serve]'") from None
    from nmt.checkpoint import load_model
    from nmt.device import inference_dtype, resolve_device
    from nmt.translate import Translator

    settings.check()
    torch_device = resolve_device(device)
    model, subword, cfg = load_model(Path(model_path), torch_device)  # the checkpoint is read once
    overrides = DecodeOverrides(  # the batch budget is a decode setting too, under the server's name
        {**overrides.values, "batch_tokens": settings.max_batch_tokens},
        {**overrides.flags, "batch_tokens": "--max-batch-tokens"},
    )
    decode = overrides.apply(cfg.decode, "nmt serve")
    translator = Translator(model.to(inference_dtype(dtype, torch_device)), subword, decode, torch_device)
    sock = listen(host, port)
    metrics = Metrics()
    batcher = Batcher(translator, settings, metrics, console)
    service = Service(batcher, subword, cfg.data.src_lang, cfg.data.tgt_lang, settings, str(model_path))
    app = build_app(service, settings, metrics, console)
    config = uvicorn.Config(
        app,
        http=protocol_class(settings),
        lifespan="off",
        ws="none",  # no websocket routes: an upgrade request is answered as plain HTTP
        log_level="warning",
        access_log=False,
        timeout_keep_alive=int(max(1, settings.keep_alive)),
        # What is in flight gets the shutdown time less 2 s, which stopping the worker may take.
        timeout_graceful_shutdown=int(max(1, settings.shutdown_timeout - 2)),
        server_header=False,
    )
    server = server_class()(config, console)
    param = next(model.parameters(), None)
    console.print(
        f"serving {model_path} ({service.src} -> {service.tgt}) on http://{host}:{sock.getsockname()[1]} "
        f"device {torch_device}, {str(param.dtype).removeprefix('torch.') if param is not None else dtype}, "
        f"beam {decode.beam}, batches of up to {settings.max_batch_tokens} subwords x beam within "
        f"{settings.batch_wait_ms:g} ms",
        highlight=False,
        soft_wrap=True,
    )
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        batcher.close(timeout=2)  # a batch still running is not waited for beyond this
        sock.close()
    console.print("stopped", highlight=False)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>nmt: __PAIR__</title>
<style>
body { font: 16px/1.4 system-ui, sans-serif; max-width: 60em; margin: 2em auto; padding: 0 1em; color: #222; }
.panes { display: flex; gap: 1em; flex-wrap: wrap; }
.pane { flex: 1 1 20em; display: flex; flex-direction: column; }
textarea, output { font: inherit; min-height: 10em; padding: .5em; border: 1px solid #999; }
output { white-space: pre-wrap; background: #f6f6f6; display: block; }
button { font: inherit; margin: .5em 0; padding: .3em 1.2em; }
#status { color: #666; min-height: 1.4em; }
#status.error { color: #b00; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; color: #555; font-size: 90%; }
dd { margin: 0; }
</style></head>
<body>
<h1>Translate __PAIR__</h1>
<div class="panes">
<label class="pane"><span>__SRC__</span>
<textarea id="source" maxlength="__MAX__" autofocus placeholder="Type text to translate"></textarea></label>
<div class="pane"><span>__TGT__</span><output id="result" for="source" aria-live="polite"></output></div>
</div>
<button id="go" type="button">Translate</button> <span id="status"></span>
<dl>__SETTINGS__</dl>
<script>
const source = document.getElementById("source"), result = document.getElementById("result");
const status = document.getElementById("status");
let timer = null, sent = 0;
async function translate() {
  const q = source.value, mine = ++sent;
  if (!q.trim()) { result.textContent = ""; status.textContent = ""; return; }
  status.className = ""; status.textContent = "translating...";
  try {
    const r = await fetch("translate", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({q: q, source: "__SRCCODE__", target: "__TGTCODE__", format: "text"})});
    const body = await r.json();
    if (mine !== sent) return;  // a newer request is on its way
    if (!r.ok) throw new Error(body.error || r.status);
    result.textContent = body.translatedText;
    status.textContent = body.truncated ? "lines too long were cut: " + body.truncated.join(", ") : "";
  } catch (e) {
    if (mine !== sent) return;
    status.className = "error"; status.textContent = "error: " + e.message;
  }
}
source.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(translate, 300); });
source.addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) translate(); });
document.getElementById("go").addEventListener("click", translate);
const given = new URLSearchParams(location.search).get("q");
if (given) { source.value = given; translate(); }
</script>
</body></html>
"""


def page_html(shown: dict) -> str:
    """The page at /: everything inline, so it works with no network beyond this server."""
    esc = html.escape

    def lang(code: str) -> str:
        return f"{LANGUAGE_NAMES.get(code, code)} ({code})"

    settings = "".join(f"<dt>{esc(k.replace('_', ' '))}</dt><dd>{esc(str(v))}</dd>" for k, v in shown.items())
    return (
        PAGE.replace("__PAIR__", esc(f"{shown['source']} to {shown['target']}"))
        .replace("__SRCCODE__", esc(shown["source"]))
        .replace("__TGTCODE__", esc(shown["target"]))
        .replace("__SRC__", esc(lang(shown["source"])))
        .replace("__TGT__", esc(lang(shown["target"])))
        .replace("__MAX__", str(shown["max_chars"]))
        .replace("__SETTINGS__", settings)
    )
