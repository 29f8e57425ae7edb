"""`nmt serve`: an HTTP translation server with the LibreTranslate and OpenNMT-py request formats.

Routes: `POST /translate` (LibreTranslate: {"q": text or [texts], "source", "target"} ->
{"translatedText": text or [texts]}), `GET /languages`, `GET /health`, and OpenNMT-py's
`POST /translator/translate` ([{"src", "id"}] -> [[{"src", "tgt", "n_best", "pred_score"}]]).

Requests are served by threads, but one worker thread owns the model (models are not thread-safe): it
takes the sentences of every request that arrives within `batch_wait_ms` of the first, up to
`max_batch_tokens`, translates them together (the front end sorts them by length and batches them),
and answers each request as soon as the batch holding its sentences is done. On the CPU in fp32 a
sentence's translation does not depend on what else shares its batch (tests/test_invariance.py), so
batching changes speed, never answers. The line contract is nmt translate's: a text's lines are
translated one by one and joined again, blank lines stay blank. Bad input gets a 4xx with
{"error": "..."} and the server carries on. SIGTERM or SIGINT: stop accepting, finish the requests in
flight, exit 0.
"""

from __future__ import annotations

import json
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rich.console import Console

from nmt.config import DecodeOverrides
from nmt.errors import NmtError

LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian"}


class BadRequest(Exception):
    """A request the server answers with a 4xx and this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Job:
    lines: list[str]
    tokens: int
    future: Future = field(default_factory=Future)


class Batcher:
    """The one thread that runs the model: gathers requests for a short window, translates them together."""

    def __init__(self, translator, max_batch_tokens: int, batch_wait_ms: float):
        self.translator, self.max_batch_tokens = translator, max_batch_tokens
        self.wait = batch_wait_ms / 1000
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self.run, name="nmt-batcher", daemon=True)
        self.thread.start()

    def translate(self, lines: list[str]) -> list[list[tuple[str, float]]]:
        """The n-best of each line, from whichever batch the worker puts them in (blocks until done)."""
        tokens = sum(len(line.split()) + 1 for line in lines)  # a cheap stand-in for subwords
        job = Job(lines, tokens)
        self.jobs.put(job)
        return job.future.result()

    def run(self) -> None:
        while (first := self.jobs.get()) is not None:
            batch, tokens, deadline = [first], first.tokens, time.monotonic() + self.wait
            stop = False
            while tokens < self.max_batch_tokens and (left := deadline - time.monotonic()) > 0:
                try:
                    job = self.jobs.get(timeout=left)
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                batch.append(job)
                tokens += job.tokens
            self.serve(batch)
            if stop:
                return

    def serve(self, batch: list[Job]) -> None:
        lines = [line for job in batch for line in job.lines]
        try:
            results = self.translator.translate_nbest(lines)
        except Exception as e:  # a bug must fail these requests, not the worker that serves all others
            for job in batch:
                job.future.set_exception(e)
            return
        start = 0
        for job in batch:
            job.future.set_result(results[start : start + len(job.lines)])
            start += len(job.lines)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class Service:
    """What the routes do, apart from HTTP: validate, split into lines, translate, assemble."""

    def __init__(self, batcher: Batcher, src_lang: str, tgt_lang: str, max_chars: int, model_name: str):
        self.batcher, self.src, self.tgt, self.max_chars = batcher, src_lang, tgt_lang, max_chars
        self.model_name = model_name

    def check_size(self, texts: list[str]) -> None:
        size = sum(len(t) for t in texts)
        if size > self.max_chars:
            raise BadRequest(f"request of {size} characters; this server takes at most {self.max_chars}", 413)

    def texts(self, texts: list[str]) -> list[tuple[list[str], list[float]]]:
        """Each text's lines translated and their scores: blank lines stay blank, line count kept."""
        self.check_size(texts)
        lines = [line for text in texts for line in text.split("\n")]
        results = self.batcher.translate(lines)
        out, start = [], 0
        for text in texts:
            n = text.count("\n") + 1
            chunk = results[start : start + n]
            out.append(([hyps[0][0] for hyps in chunk], [hyps[0][1] for hyps in chunk]))
            start += n
        return out

    def libretranslate(self, body) -> dict:
        if not isinstance(body, dict):
            raise BadRequest('expected a JSON object: {"q": "text", "source": "en", "target": "de"}')
        q = body.get("q")
        single = isinstance(q, str)
        if not single and not (isinstance(q, list) and all(isinstance(t, str) for t in q)):
            raise BadRequest('"q" must be a string or a list of strings')
        if (single and not q.strip()) or (not single and not q):
            raise BadRequest('"q" is empty: nothing to translate')
        source, target = body.get("source", self.src), body.get("target", self.tgt)
        if source not in (self.src, "auto") or target != self.tgt:
            raise BadRequest(
                f"this server translates {self.src} to {self.tgt}, not {source} to {target} (see /languages)"
            )
        translated = ["\n".join(lines) for lines, _ in self.texts([q] if single else q)]
        return {"translatedText": translated[0] if single else translated}

    def opennmt(self, body) -> list:
        if not (
            isinstance(body, list)
            and body
            and all(isinstance(x, dict) and isinstance(x.get("src"), str) for x in body)
        ):
            raise BadRequest('expected a non-empty JSON list of {"src": "text", "id": N}')
        results = self.texts([x["src"] for x in body])
        return [
            [
                {"src": x["src"], "tgt": "\n".join(lines), "n_best": 1, "pred_score": sum(scores)}
                for x, (lines, scores) in zip(body, results, strict=True)
            ]
        ]

    def languages(self) -> list:
        def name(code: str) -> str:
            return LANGUAGE_NAMES.get(code, code)

        return [
            {"code": self.src, "name": name(self.src), "targets": [self.tgt]},
            {"code": self.tgt, "name": name(self.tgt), "targets": []},
        ]

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "source": self.src, "target": self.tgt}


class HTTPServer(ThreadingHTTPServer):
    request_queue_size = 256  # the default 5 resets connections when a few dozen clients connect at once
    daemon_threads = False  # server_close() waits for the requests in flight


def make_handler(service: Service, console: Console):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "nmt-serve"

        def do_GET(self):
            self.route({"/languages": service.languages, "/health": service.health}, with_body=False)

        def do_POST(self):
            self.route({"/translate": service.libretranslate, "/translator/translate": service.opennmt}, True)

        def route(self, routes: dict, with_body: bool) -> None:
            start = time.perf_counter()
            status, sentences = 200, 0
            try:
                path = self.path.split("?", 1)[0]
                if path not in routes:
                    raise BadRequest(f"no route {self.command} {path}", 404)
                if with_body:
                    body = self.read_json()
                    sentences = count_sentences(body)
                    payload = routes[path](body)
                else:
                    payload = routes[path]()
            except BadRequest as e:
                status, payload = e.status, {"error": str(e)}
            except Exception as e:  # never a dead connection: the client learns, the server carries on
                status, payload = 500, {"error": f"internal error: {type(e).__name__}: {e}"}
            self.send_json(status, payload)
            ms = (time.perf_counter() - start) * 1000
            console.print(
                f"{self.command} {self.path} {status} {sentences} sentences {ms:.0f} ms", highlight=False
            )

        def read_json(self):
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                raise BadRequest("bad Content-Length") from None
            if length > 4 * service.max_chars + 65536:  # JSON escapes at most ~6 bytes a character
                self.close_connection = True
                raise BadRequest(f"request body of {length} bytes is too large", 413)
            raw = self.rfile.read(length)
            try:
                return json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise BadRequest(f"body is not valid JSON: {e}") from None

        def send_json(self, status: int, payload) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # one line per request is printed by route()
            pass

    return Handler


def count_sentences(body) -> int:
    if isinstance(body, dict) and isinstance(body.get("q"), str):
        return body["q"].count("\n") + 1
    if isinstance(body, dict) and isinstance(body.get("q"), list):
        return sum(t.count("\n") + 1 for t in body["q"] if isinstance(t, str))
    if isinstance(body, list):
        return sum(
            x["src"].count("\n") + 1 for x in body if isinstance(x, dict) and isinstance(x.get("src"), str)
        )
    return 0


def serve(
    model_path: Path,
    host: str,
    port: int,
    max_batch_tokens: int,
    batch_wait_ms: float,
    max_chars: int,
    overrides: DecodeOverrides,
    device: str,
    dtype: str,
    console: Console,
) -> None:
    """Load the model, serve until SIGTERM/SIGINT, then finish the requests in flight and return."""
    from nmt.checkpoint import load_checkpoint
    from nmt.translate import load_translator

    if batch_wait_ms < 0 or max_chars < 1:
        raise NmtError("--max-chars must be positive, --batch-wait-ms at least 0")
    config = load_checkpoint(Path(model_path)).config
    overrides = DecodeOverrides(
        {**overrides.values, "batch_tokens": max_batch_tokens},
        {**overrides.flags, "batch_tokens": "--max-batch-tokens"},
    )
    translator, decode = load_translator(
        Path(model_path), overrides, device, dtype, "torch", console, "nmt serve"
    )
    batcher = Batcher(translator, max_batch_tokens, batch_wait_ms)
    service = Service(batcher, config.data.src_lang, config.data.tgt_lang, max_chars, str(model_path))
    try:
        server = HTTPServer((host, port), make_handler(service, console))
    except OSError as e:
        batcher.close()
        raise NmtError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    model = translator.engine.model
    param = next(model.parameters(), None)
    console.print(
        f"serving {model_path} ({service.src} -> {service.tgt}) on http://{host}:{server.server_address[1]} "
        f"device {param.device if param is not None else device}, "
        f"{str(param.dtype).removeprefix('torch.') if param is not None else dtype}, beam {decode.beam}, "
        f"batches of up to {max_batch_tokens} tokens within {batch_wait_ms:g} ms",
        highlight=False,
        soft_wrap=True,
    )

    def stop(signum, _frame):
        console.print(f"{signal.Signals(signum).name}: finishing the requests in flight", highlight=False)
        threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()  # joins the request threads: each gets its answer
        batcher.close()
        for s, h in previous.items():
            signal.signal(s, h)
    console.print("stopped", highlight=False)
