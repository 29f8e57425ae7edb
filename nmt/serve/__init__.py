"""`nmt serve`: an HTTP translation server with the LibreTranslate and OpenNMT-py request formats.

Routes: `POST /translate` (LibreTranslate: {"q": text or [texts], "source", "target", "format",
"alternatives"} -> {"translatedText": ...}), `POST /detect`, `GET /languages`, `GET /frontend/settings`,
`GET /health`, `GET /metrics` (Prometheus text), `GET /` (a page to try the model) and OpenNMT-py's
`POST /translator/translate` ([{"src", "id"}] -> [[{"src", "tgt", "n_best", "pred_score"}]]).

The HTTP layer is uvicorn (timeouts, connection limit, graceful shutdown) under Starlette (routing). A
request is validated completely and encoded into subwords in its handler, so nothing malformed reaches the
model. The model is built as `nmt translate` builds it (nmt.translate.build_translator, either engine),
and a request's lines are encoded by the same front end (nmt.translate.frontend: cleaning and cuts
included). One worker thread owns each model (models are not thread-safe): requests are cut into pieces
that fit the batch budget (`--max-batch-tokens`, costed as `nmt translate` costs its batches), and each
batch takes the next piece of every waiting request in turn, so a one-line request waits about one batch
however large the others are. A batch that fails is retried piece by piece, so only the faulty request
fails; the worker never dies. On the CPU in fp32 a sentence's translation does not depend on what else
shares its batch (tests/test_invariance.py), so batching changes speed, never answers. The line contract
is nmt translate's: a text's lines are translated one by one and joined again, blank lines stay blank.

Every error, of every route and method, is {"error": "..."} with its status; whatever reading, parsing or
validating a request raises is the client's (400), in one place (nmt.serve.http's POST endpoint). SIGTERM
or SIGINT: stop accepting, close idle connections, answer the requests in flight, answer 503 to what the
model cannot finish in time, stop the worker between batches and exit 0 within `shutdown_timeout`.

One server answers every pair of the models it is given (`-m` repeated), and every target of a model of
several (a request's "target" picks its tag): each model has a worker of its own, so a long request to
one pair never holds a request to another model's.

Modules: settings (where it listens, its limits), api (the request formats, validated and encoded), pairs
(which model answers which pair), batcher (the model worker), http (uvicorn, the routes' errors, shutdown;
`serve`), documents and markup (texts, HTML fragments and their tags), kept (translate="no" spans), detect
(source "auto"), metrics, page.
"""

from nmt.serve.settings import HTTPError, ServeSettings

__all__ = [
    "Batcher",
    "HTTPError",
    "Metrics",
    "ServeSettings",
    "Document",
    "serve",
    "tokens",
]


def __getattr__(name: str):
    """The server's parts, imported when first asked for: `nmt serve`'s options read ServeSettings from
    here, and the CLI must not import torch (the worker's) to show its help."""
    if name == "Batcher":
        from nmt.serve.batcher import Batcher as found
    elif name == "serve":
        from nmt.serve.http import serve as found
    elif name in ("Document", "tokens"):
        from nmt.serve import markup

        found = getattr(markup, name)
    elif name == "Metrics":
        from nmt.serve.metrics import Metrics as found
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = found
    return found
