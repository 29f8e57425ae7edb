"""The server's limits, validated once; the error a request is answered with, and where a request's
errors stop being the client's."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, fields

from nmt.errors import NmtError
from nmt.limits import QUANTITIES, check


@dataclass(frozen=True)
class ServeSettings:
    """Where the server listens and its limits; the CLI's options (and their defaults), validated here so
    each message names its option. The batch budget is a decode setting (--max-batch-tokens:
    decode.batch_tokens, as nmt translate --max-tokens)."""

    host: str = "127.0.0.1"  # the address to listen on; 0.0.0.0 for every interface
    port: int = 5000  # 0: a free one, which the server prints
    batch_wait_ms: float = 10.0  # how long the first request of a batch waits for others (Batcher.take)
    max_chars: int = 20000  # characters of text in one request
    max_queue: int = 100000  # source lines waiting for the model; more: 503
    timeout: float = 60.0  # seconds a request may wait for its translation; then 504
    read_timeout: float = 10.0  # seconds to receive a request's headers, and again its body
    keep_alive: float = 5.0  # seconds an idle connection stays open
    max_connections: int = 1000  # open connections (and requests) at once; more are refused
    shutdown_timeout: float = 30.0  # after SIGTERM, seconds to answer what is in flight
    cors_origins: str = "*"  # origins whose pages may call the server, comma-separated; "" for none

    def check(self) -> ServeSettings:
        for f in fields(self):  # each number against its bound in nmt.limits, named as its option
            if f.name in QUANTITIES:
                check("--" + f.name.replace("_", "-"), getattr(self, f.name))
        for origin in self.origins:
            if origin != "*" and not (origin.startswith(("http://", "https://")) and origin.count("/") == 2):
                raise NmtError(
                    f"--cors-origins: {origin!r} is not an origin (scheme://host[:port], or * for any)"
                )
        return self

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @property
    def max_body(self) -> int:
        """Bytes of body: JSON escapes a character in at most 6 bytes (\\uXXXX), plus room for the fields."""
        return 6 * self.max_chars + 65536


class HTTPError(Exception):
    """A request the server answers with this status and {"error": message}."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


# Whether the request being handled (this task's) has been accepted: read, validated and encoded. Until
# then any exception is the client's (a JSON 400, made so in one place: nmt.serve.http's endpoint); after
# it, an exception that is not an HTTPError is the server's own fault (500).
ACCEPTED: ContextVar[bool] = ContextVar("accepted", default=False)


def accept() -> None:
    """Mark the request being handled as valid: from here on its errors are the server's."""
    ACCEPTED.set(True)
