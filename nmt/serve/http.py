"""The HTTP layer: uvicorn (timeouts, connection limit, graceful shutdown) under Starlette (routing), every
error a JSON {"error": ...} with its status, and `serve`, which puts the parts together."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qs

import torch
from rich.console import Console

from nmt.config import DecodeOverrides, Engine, Precision
from nmt.errors import NmtError
from nmt.serve.api import FORM_TYPE, JSON_TYPES, MULTIPART_TYPE, Service
from nmt.serve.batcher import Batcher
from nmt.serve.documents import aligner
from nmt.serve.metrics import Metrics
from nmt.serve.page import page_html
from nmt.serve.pairs import Model, Pairs
from nmt.serve.settings import ACCEPTED, HTTPError, ServeSettings
from nmt.translate.threads import serving_words

ROUTES = ("/", "/translate", "/detect", "/languages", "/frontend/settings", "/health", "/metrics")
ROUTES += ("/translator/translate",)


def route_path(path: str) -> str:
    """The route a request path means: doubled slashes are one and a trailing one is dropped, so a client
    given a base URL ending in "/" (`http://host/` + `/languages`) reaches /languages, not a 404 or a
    redirect (Starlette's own answer to /languages/, which some clients do not follow for a POST)."""
    return "/" + "/".join(part for part in path.split("/") if part)


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
    """JSON (or LibreTranslate's form encodings) of valid UTF-8, as Python values."""
    raw = await read_body(request, settings)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == MULTIPART_TYPE:
        return multipart_fields(raw, request.headers["content-type"])
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
        raise HTTPError(
            415, f"Content-Type {ctype}: send application/json (or {FORM_TYPE}, {MULTIPART_TYPE})"
        )
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
        raise HTTPError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise HTTPError(400, "the body is not valid JSON: nested too deeply") from None


def multipart_fields(raw: bytes, content_type: str) -> dict:
    """The text fields of a multipart/form-data body (already read within the size limit), parsed by the
    standard library's MIME parser; values are strings, as in the URL-encoded form."""
    from email import policy
    from email.parser import BytesParser
    from email.utils import collapse_rfc2231_value

    head = b"Content-Type: " + content_type.encode("latin-1", errors="replace") + b"\r\n\r\n"
    message = BytesParser(policy=policy.HTTP).parsebytes(head + raw)
    if not message.is_multipart():
        raise HTTPError(400, "the multipart body has no parts: is its boundary the Content-Type's?")
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name is None or part.get_filename() is not None:
            continue  # files are not translated here (LibreTranslate has /translate_file for them)
        name = collapse_rfc2231_value(name)  # name*=utf-8''... arrives as a (charset, language, value)
        if part.is_multipart():
            raise HTTPError(400, f"the form field {name!r} is itself multipart; send it as text")
        try:
            fields[name] = part.get_payload(decode=True).decode(part.get_content_charset() or "utf-8")
        except (UnicodeError, LookupError) as e:  # not text in its charset, or no text codec by that name
            raise HTTPError(400, f"the form field {name!r} is not valid text: {e}") from None
    return fields


def build_app(service: Service, settings: ServeSettings, metrics: Metrics, console: Console):
    """The Starlette application: routes, JSON errors, metrics and one log line per request."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import HTMLResponse, Response
    from starlette.routing import Route

    def answer(payload, status: int = 200, headers: dict | None = None) -> Response:
        return Response(json_bytes(payload), status, headers, media_type="application/json")

    def post(handler, is_async: bool = True):
        async def endpoint(request):
            """The one place where a request's errors become the client's: whatever reading, parsing,
            validating or encoding it raises is a JSON 400, until the handler accepts it
            (nmt.serve.settings.accept) and hands it to the model."""
            ACCEPTED.set(False)
            try:
                body = await parse_body(request, settings)
                result = await handler(body) if is_async else handler(body)
            except HTTPError:
                raise
            except Exception as e:
                if ACCEPTED.get():
                    raise  # the server's own fault: a 500, and its traceback in the log
                detail = f"{type(e).__name__}: {str(e)[:200]}"
                raise HTTPError(400, f"the request cannot be handled: {detail}") from None
            return answer(result)

        return endpoint

    def get(handler):
        async def endpoint(request):
            return answer(handler())

        return endpoint

    async def page(request):
        pairs = [(p.source, p.target) for p in service.pairs.all]
        return HTMLResponse(page_html(service.settings_shown(), pairs))

    async def prometheus(request):
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

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
        Route("/detect", post(service.detect), methods=["POST"]),
        Route("/translator/translate", post(service.opennmt), methods=["POST"]),
        Route("/languages", get(service.languages), methods=["GET"]),
        Route("/frontend/settings", get(service.frontend_settings), methods=["GET"]),
        Route("/health", get(service.health), methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=cors(settings, answer),
        exception_handlers={HTTPException: http_error, HTTPError: our_error, Exception: server_error},
    )

    async def observed(scope, receive, send):
        """Metrics and the log line around every request, whatever answered it."""
        if scope["type"] != "http":
            return await app(scope, receive, send)
        scope = {**scope, "path": route_path(scope["path"])}
        start, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        metrics.in_flight.inc()
        try:
            await app(scope, receive, sending)
        finally:
            metrics.in_flight.dec()
            seconds = time.perf_counter() - start
            metrics.observe_request(scope["method"], scope["path"], status[0], seconds)
            if scope["path"] not in ("/metrics", "/health"):
                console.print(
                    f"{scope['method'][:20]} {scope['path'][:100]} {status[0]} {seconds * 1000:.0f} ms",
                    highlight=False,
                    soft_wrap=True,
                )

    return observed


def shutdown_times(timeout: float) -> tuple[float, float]:
    """After a SIGTERM, when (seconds) the model worker stops and answers 503 to what still waits for it,
    and when uvicorn cancels what is still unanswered: each a margin before the next, the worker's end
    (its batch) by `timeout` itself."""
    margin = min(2.0, timeout / 3)
    return timeout - 2 * margin, timeout - margin


def cors(settings: ServeSettings, answer) -> list:
    """Cross-origin calls as LibreTranslate allows them (flask-cors: any origin by default, every method and
    header), by Starlette's CORSMiddleware: a page on another origin can call the API. A refused
    preflight is answered in JSON like every other error."""
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    if not settings.origins:
        return []

    class CORS(CORSMiddleware):
        def preflight_response(self, request_headers):
            response = super().preflight_response(request_headers)
            if response.status_code < 400:
                return response
            refused = response.body.decode()  # "Disallowed CORS origin, method"
            headers = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
            message = f"{refused} (see nmt serve --cors-origins)"
            return answer({"error": message}, response.status_code, headers)

    methods = ["GET", "HEAD", "POST", "OPTIONS", "PUT", "PATCH", "DELETE"]
    return [Middleware(CORS, allow_origins=settings.origins, allow_methods=methods, allow_headers=["*"])]


def server_class():
    """uvicorn's Server, told to stop by SIGTERM/SIGINT and then to return (exit 0), not to re-raise it;
    requests the model cannot finish within the shutdown timeout get a 503 in time."""
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config, console: Console, stop_work, shutdown_timeout: float):
            super().__init__(config)
            self.console, self.stop_work, self.shutdown_timeout = console, stop_work, shutdown_timeout
            self.signalled = None

        async def shutdown(self, sockets=None) -> None:
            stop_worker, _ = shutdown_times(self.shutdown_timeout)
            start = self.signalled or time.monotonic()
            delay = max(0.0, start + stop_worker - time.monotonic())
            timer = asyncio.get_running_loop().call_later(delay, self.stop_work)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            def stop(signum, frame):
                name = signal.Signals(signum).name
                self.console.print(
                    f"{name}: answering the requests in flight, then stopping", highlight=False
                )
                if self.signalled is None:
                    self.signalled = time.monotonic()
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
    model_paths: Path | str | Sequence[Path | str],
    settings: ServeSettings,
    overrides: DecodeOverrides,
    device: str,
    dtype: Precision | str,
    console: Console,
    engine: Engine | str = Engine.TORCH,
    glossary: Path | None = None,
) -> None:
    """Load the models, serve on `settings.host`:`settings.port` until SIGTERM/SIGINT, then answer the
    requests in flight and return. `glossary`: a TSV file of terms every request obeys
    (nmt.translate.terminology); one pair's terms, so for a server of one pair.

    Each model is built as `nmt translate` builds it (nmt.translate.build_translator), on either engine:
    with several, `--engine ctranslate2` decodes the folders by CTranslate2 and a checkpoint file beside
    them by torch. The batch budget (--max-tokens) is among `overrides`, as decode.batch_tokens. Every pair
    of every model is answered (nmt.serve.pairs), each model by a worker of its own.
    """
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise NmtError(f"nmt serve needs its extra ({e}): pip install 'nmt[serve]'") from None

    settings.check()
    paths = [Path(model_paths)] if isinstance(model_paths, str | Path) else [Path(p) for p in model_paths]
    twice = next((p for k, p in enumerate(paths) if p.resolve() in map(Path.resolve, paths[:k])), None)
    if twice is not None:
        raise NmtError(f"-m {twice}: given twice; each model is loaded once and serves all its pairs")
    from nmt.translate.terminology import server_terminology

    engine = Engine.parse(engine, "--engine")
    metrics = Metrics(ROUTES)
    models, built = [], []
    try:
        for k, path in enumerate(paths):
            # A checkpoint file among several models runs on torch: only folders are CTranslate2's.
            mixed = engine is Engine.CTRANSLATE2 and len(paths) > 1 and path.is_file()
            # Each checkpoint is read once; the server's translator prints no warnings: answers say what
            # was cut.
            b = build_translator_for(
                path, overrides, device, dtype, Engine.TORCH if mixed else engine, glossary
            )
            built.append(b)
            batcher = Batcher(b.translator, settings, metrics, console, name=f"nmt-batcher-{k}")
            name = str(path).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]  # no server path shown
            terms = server_terminology(b.translator)
            models.append(Model(name, batcher, b.sources, b.targets, aligner(b.translator), terms))
        pairs = Pairs(models)
        if glossary is not None and len(pairs) > 1:
            raise NmtError(
                f"--glossary: a glossary holds one pair's terms; this server answers {pairs.named()}"
            )
        sock = listen(settings.host, settings.port)
    except BaseException:  # a model that does not load, or pairs that clash: no worker outlives it
        for m in models:
            m.batcher.close(1.0)
        raise
    service = Service(pairs, settings)
    _ = service.detector.identifier  # loaded now (about a second), not in the first request's deadline
    app = build_app(service, settings, metrics, console)
    config = uvicorn.Config(
        app,
        http=protocol_class(settings),
        lifespan="off",
        ws="none",  # no websocket routes: an upgrade request is answered as plain HTTP
        log_level="warning",
        access_log=False,
        timeout_keep_alive=int(max(1, settings.keep_alive)),
        # What the model cannot finish in time is answered 503 before this (Server.shutdown).
        timeout_graceful_shutdown=shutdown_times(settings.shutdown_timeout)[1],
        server_header=False,
    )

    def stop_work() -> None:  # the model workers, and the requests being prepared in threads: 503 now
        for m in models:
            m.batcher.stop()
        service.stop()

    server = server_class()(config, console, stop_work, settings.shutdown_timeout)
    address = f"http://{settings.host}:{sock.getsockname()[1]}"
    for k, (path, b, m) in enumerate(zip(paths, built, models, strict=True)):
        decode = b.decode
        languages = f"{', '.join(m.sources)} -> {', '.join(m.targets)}"
        # one line for one model, as it always was; several: a line each, the address on the first
        where = f"on {address} " if k == 0 else "and "
        about = b.describe()
        if b.engine is Engine.TORCH and b.device.type == "cpu":
            about += f", {serving_words(torch.get_num_threads())}"
        console.print(
            f"serving {path} ({languages}) {where}"
            f"{about}, beam {decode.beam}, batches of up to {decode.batch_tokens} subwords x beam "
            f"within {settings.batch_wait_ms:g} ms"
            + (", ALL CAPS and Title Case recased (--no-recase: as typed)" if decode.recase else ""),
            highlight=False,
            soft_wrap=True,
        )
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
        for m in models:
            m.batcher.stop()
        left = settings.shutdown_timeout
        if server.signalled is not None:
            left -= time.monotonic() - server.signalled
        end = time.monotonic() + max(0.1, left)
        stopped = all([m.batcher.close(timeout=max(0.1, end - time.monotonic())) for m in models])
    if not stopped:
        # A batch longer than the shutdown time: the interpreter must not tear down under a thread that
        # is inside a torch (or CTranslate2) operation (std::terminate, SIGABRT). Every request has its
        # answer; leave without the teardown.
        which = "the model worker" if len(models) == 1 else "a model worker"
        console.print(f"stopped ({which} was still in a batch)", highlight=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    console.print("stopped", highlight=False)


def build_translator_for(path: Path, overrides, device, dtype, engine: Engine, glossary: Path | None):
    """One model of the server, built as nmt translate builds it."""
    from nmt.translate import build_translator

    return build_translator(path, overrides, device, dtype, engine, None, "nmt serve", glossary=glossary)
