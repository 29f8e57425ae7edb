"""What the routes do, apart from HTTP: LibreTranslate's and OpenNMT-py's request formats, validated
completely and encoded into subwords before anything reaches the model worker.

Everything a request costs in proportion to its text (detection, sentence splitting, markup, encoding,
glossary matching, placing the markup again) runs in a thread, never on the event loop that serves every
client, and under the request's Deadline (--timeout from its arrival): each step is linear in the text
and checks the deadline between its pieces, so a late or abandoned request (its client gone, the server
shutting down) stops at the next piece instead of running on."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from dataclasses import dataclass

from nmt.errors import NmtError
from nmt.languages import same
from nmt.serve.batcher import QueueFull
from nmt.serve.detect import Detector
from nmt.serve.documents import document, readable
from nmt.serve.pairs import Pair, Pairs, language_name
from nmt.serve.settings import HTTPError, ServeSettings, accept
from nmt.translate.casing import Typed, sentence_case

JSON_TYPES = ("application/json", "text/json", "")  # LibreTranslate's clients often send no type at all
FORM_TYPE = "application/x-www-form-urlencoded"  # what LibreTranslate's Python client sends
MULTIPART_TYPE = "multipart/form-data"  # what LibreTranslate's own web page sends (a FormData)


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


def nth(lines: list[list[tuple[str, float]]], k: int) -> list[str]:
    """The k-th best translation of each line (a blank line's only one where it has fewer)."""
    return [hyps[min(k, len(hyps) - 1)][0] for hyps in lines]


class Deadline:
    """A request's time limit and its cancellation, checked by its steps between their pieces. Made and
    stopped on the event loop; checked from the request's thread."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.stopped: str | None = None  # why it was called off, if it was
        self.called_off = asyncio.get_running_loop().create_future()  # done when stopped

    def left(self) -> float:
        return self.at - time.monotonic()

    def stop(self, why: str) -> None:
        if self.stopped is None:
            self.stopped = why
            if not self.called_off.done():
                self.called_off.set_result(None)

    def check(self) -> None:
        """Raise the request's answer if it is called off (503) or out of time (504)."""
        if self.stopped is not None:
            raise HTTPError(503, self.stopped, {"Retry-After": "1"})
        if self.left() <= 0:
            raise HTTPError(504, f"no translation within {self.seconds:g} s; try a smaller request")


@dataclass
class Text:
    """One text of a request: its lines to translate, and how to put the translations together."""

    lines: list[str]
    kept: list[str] | None = None  # the texts of its translate="no" elements, copied as they are

    def join(self, translations: list[str]) -> str:
        return "\n".join(translations)


class Service:
    """What the routes do, apart from HTTP: validate, route to a pair's model, encode, queue, assemble."""

    def __init__(self, pairs: Pairs, settings: ServeSettings):
        self.pairs = pairs
        self.settings = settings
        self.detector = Detector(pairs.sources)
        self.running: set[Deadline] = set()  # the requests with work in a thread

    @property
    def model_name(self) -> str:
        return ", ".join(m.name for m in self.pairs.models)

    def deadline(self) -> Deadline:
        return Deadline(self.settings.timeout)

    async def off_loop(self, deadline: Deadline, work, *args):
        """`work(*args)` in a thread, within the deadline. The request is answered as soon as the deadline
        passes or it is called off (504, 503), whatever the thread is doing; the thread is told to stop
        and does so at its next check."""
        deadline.check()
        self.running.add(deadline)
        task = asyncio.ensure_future(asyncio.to_thread(work, *args))
        try:
            await asyncio.wait(
                [task, deadline.called_off],
                timeout=max(0.0, deadline.left()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if task.done():
                return task.result()
            deadline.check()  # called off: 503
            raise HTTPError(504, f"no translation within {self.settings.timeout:g} s; try a smaller request")
        finally:
            self.running.discard(deadline)
            if not task.done():  # late, called off, or the request given up (its task cancelled)
                deadline.stop("given up")
                task.cancel()

    def stop(self) -> None:
        """The server is shutting down: every request still being prepared or put together answers 503."""
        for deadline in list(self.running):
            deadline.stop("the server is shutting down")

    def encode(
        self, texts: list[Text], lines: list[str], pair: Pair
    ) -> tuple[dict[int, list[int]], int, list[list[int]]]:
        """Subword ids of every non-blank line (`lines`: the texts' lines as the model reads them,
        lines_of), the line count, and each text's truncated line numbers: the front end's encoding
        (nmt.translate.LineTranslator.encode), nmt translate's line contract; after the pair's target tag
        where the model has several targets."""
        encoded = pair.model.translator.encode(lines, target=pair.tag)
        truncated, start = [], 0
        for t in texts:
            cut = encoded.truncated
            truncated.append([i - start + 1 for i in range(start, start + len(t.lines)) if i in cut])
            start += len(t.lines)
        return encoded.sources, len(lines), truncated

    def constraints(
        self, lines: list[str], sources: dict[int, list[int]], glossary, pair: Pair
    ) -> dict | None:
        """The terms of each line that has any: the server's glossary and the request's (`glossary`, a list
        of {"source", "target"}); an entry that cannot be obeyed is a 422."""
        terminology = pair.model.terminology
        if terminology is None:
            if glossary is not None:
                raise HTTPError(422, '"glossary": this server takes none (it needs --engine torch)')
            return None
        if glossary is None and not terminology.active:
            return None
        from nmt.translate.terminology import glossary_of

        try:
            extra = glossary_of(glossary) if glossary is not None else None
            return terminology.apply({i: lines[i] for i in sources}, extra, sources=sources)
        except NmtError as e:
            raise HTTPError(422, str(e)) from None

    @staticmethod
    def lines_of(texts: list[Text], pair: Pair) -> tuple[list[str], list | None]:
        """The lines of the texts as the model reads them, and how each was typed where the model recases
        (nmt.translate.casing: decode.recase, `nmt serve --recase`); None where it does not."""
        lines = [line for t in texts for line in t.lines]
        cases = pair.model.translator.typed(lines)
        if cases is None:
            return lines, None
        return [sentence_case(line) if how is not Typed.AS_WRITTEN else line for line, how in cases], cases

    def prepare(
        self, texts: list[Text], glossary, pair: Pair
    ) -> tuple[dict, int, list[list[int]], dict | None, list | None]:
        """Encode, and find each line's terms, in the request's thread: the ids, the line count, the
        truncated line numbers, the terms, and how each line was typed (lines_of)."""
        lines, cases = self.lines_of(texts, pair)
        sources, count, truncated = self.encode(texts, lines, pair)
        return sources, count, truncated, self.constraints(lines, sources, glossary, pair), cases

    async def translate(
        self,
        texts: list[Text],
        nbest: int,
        glossary=None,
        deadline: Deadline | None = None,
        pair: Pair | None = None,
    ) -> tuple[list[list], list[list[int]]]:
        """For each text, its lines' n-best lists of (translation, score) by `pair`'s model (None: the
        server's first pair); and its truncated line numbers. `glossary`: the request's own terms, if any."""
        deadline = deadline or self.deadline()
        pair = pair or self.pairs.default
        size = sum(len(line) for t in texts for line in t.lines)
        if size > self.settings.max_chars:
            raise HTTPError(
                413, f"{size} characters of text; this server takes at most {self.settings.max_chars}"
            )
        prepared = await self.off_loop(deadline, self.prepare, texts, glossary, pair)
        sources, count, truncated, terms, cases = prepared
        accept()  # read, validated and encoded: what goes wrong from here on is the server's
        try:
            job = pair.model.batcher.submit(sources, count, nbest, deadline.at, constraints=terms)
        except QueueFull as e:
            raise HTTPError(503, f"busy: {e}; try again shortly", {"Retry-After": "1"}) from None
        try:
            results = await asyncio.wait_for(asyncio.wrap_future(job.future), max(0.0, deadline.left()))
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
        if cases is not None:  # an ALL-CAPS line's translations in upper case
            results = pair.model.translator.cased_back(results, [how for _, how in cases])
        out, start = [], 0
        for t in texts:
            out.append(results[start : start + len(t.lines)])
            start += len(t.lines)
        return out, truncated

    def fields(self, body, need_target: bool = True) -> tuple[list[str], bool, str, str | None]:
        """LibreTranslate's q, source and target, validated: the texts, whether q was one string, the
        source ("auto" or a served one) and the target, by the codes /languages lists. A pair
        nobody serves is the client's error, naming those that are served. The target may be left out
        where every pair has the same one; with `need_target` False (detection) it need not be known."""
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
        targets = self.pairs.targets
        source = body.get("source", "auto")
        target = body["target"] if "target" in body else targets[0] if len(targets) == 1 else None
        if "target" not in body and target is None:
            if need_target:
                raise HTTPError(422, f'missing "target": this server translates into {", ".join(targets)}')
            return texts, single, source, None
        for name, value in (("source", source), ("target", target)):
            check_text(value, f'"{name}"')
        if source == "auto":
            into = self.pairs.sources_into(target)
            if not into:
                raise self.pairs.unserved(source, target)
            return texts, single, source, target
        pair = self.pairs.find(source, target)
        if pair is None:
            raise self.pairs.unserved(source, target)
        return texts, single, pair.source, pair.target

    async def libretranslate(self, body) -> dict:
        texts, single, source, target = self.fields(body)
        fmt = body.get("format", "text")
        if fmt not in ("text", "html"):
            raise HTTPError(422, f'"format" must be "text" or "html", not {fmt!r}')
        alternatives = body.get("alternatives", 0)
        if isinstance(alternatives, str) and alternatives.strip().isdigit():  # form fields are strings
            alternatives = int(alternatives)
        if not isinstance(alternatives, int) or isinstance(alternatives, bool) or alternatives < 0:
            raise HTTPError(422, f'"alternatives" must be a whole number 0 or more, got {alternatives!r}')
        # "api_key" and any other field LibreTranslate's clients send are accepted and ignored.
        split = body.get("split_sentences", True)  # nmt's own field: false sends each line whole
        if not isinstance(split, bool):
            raise HTTPError(422, f'"split_sentences" must be true or false, got {split!r}')
        deadline = self.deadline()
        detections, items, pair = await self.off_loop(
            deadline, self.documents, texts, fmt, split, source, target, deadline
        )
        alternatives = min(alternatives, pair.model.max_alternatives)
        nbest = 1 + alternatives
        results, truncated = await self.translate(items, nbest, body.get("glossary"), deadline, pair)
        answers = [[nth(r, k) for k in range(nbest)] for r in results]
        # the markup placed by the model's attention (a forward pass per sentence), sentences joined
        joined = await self.off_loop(deadline, self.join_all, items, answers, deadline, pair)
        answer: dict = {"translatedText": joined[0][0] if single else [j[0] for j in joined]}
        if detections is not None:
            detected = [d.answer() for d in detections]
            answer["detectedLanguage"] = detected[0] if single else detected
        if alternatives:
            alts = [j[1:] for j in joined]
            answer["alternatives"] = alts[0] if single else alts
        if any(truncated):
            answer["truncated"] = truncated[0] if single else truncated
        return answer

    def documents(
        self, texts: list[str], fmt: str, split: bool, source: str, target: str, deadline: Deadline
    ):
        """Each text's detected language (source "auto"; else None), its sentences, and the pair that
        translates them: in a thread."""
        detections = None
        if source == "auto":
            detections = []
            for t in texts:
                deadline.check()
                detections.append(self.detected(readable(t, fmt, deadline.check), target))
            found = list(dict.fromkeys(d.language for d in detections))
            if len(found) > 1:  # one request goes to one model
                raise HTTPError(
                    400, f"the texts are in {' and '.join(found)}: send each language in a request of its own"
                )
            source = found[0]
        pair = self.pairs.find(source, target)
        items, size = [], 0

        def limit(chars: int) -> None:  # a lower bound of the text's size, known before it is split
            nonlocal size
            size += chars
            if size > self.settings.max_chars:
                raise HTTPError(
                    413,
                    f"{size} characters of text or more; this server takes at most {self.settings.max_chars}",
                )

        for t in texts:
            deadline.check()
            tags = pair.model.translator.subword.tags
            items.append(document(t, fmt, pair.source, split, deadline.check, limit, tags))
        return detections, items, pair

    def join_all(
        self, items, answers: list[list[list[str]]], deadline: Deadline, pair: Pair
    ) -> list[list[str]]:
        """Each text's translation and alternatives put together (markup placed, sentences joined)."""
        aligner = pair.model.aligner
        align = functools.partial(aligner.align, tag=pair.tag) if aligner is not None else None
        out = []
        for item, ans in zip(items, answers, strict=True):
            deadline.check()
            out.append([item.join(a, align) for a in ans])
        return out

    def detected(self, text: str, target: str):
        """The language of a text sent with source "auto", among the sources translated into `target`;
        400 when it is surely none of them."""
        among = self.pairs.sources_into(target)
        d = self.detector.detect(text, among)
        served = next((s for s in among if same(s, d.language)), None)
        if served is None:
            if len(self.pairs) == 1:
                pair = f"{self.pairs.default.source} to {self.pairs.default.target}"
            else:
                pair = f"into {target} from {', '.join(among)} only"
            raise HTTPError(
                400,
                f"the text is in {d.language} ({d.confidence:.1f}% sure), but this server translates {pair}",
            )
        return dataclasses.replace(d, language=served)

    async def detect(self, body) -> list:
        texts, _, _, _ = self.fields({**body, "source": "auto"} if isinstance(body, dict) else body, False)
        d = await self.off_loop(self.deadline(), self.detector.detect, "\n".join(texts))
        return [{"confidence": round(d.confidence, 1), "language": d.detected}]

    async def opennmt(self, body) -> list:
        """OpenNMT-py's format names no language: the server's first pair (a line's own leading target
        tag, >>fra<<, chooses another target of a model of several)."""
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
        return self.pairs.languages()

    def frontend_settings(self) -> dict:
        """What LibreTranslate's web UI reads before it starts: the first pair is its default."""
        first = self.pairs.default
        return {
            "charLimit": self.settings.max_chars,
            "frontendTimeout": 500,
            "apiKeys": False,
            "keyRequired": False,
            "suggestions": False,
            "filesTranslation": False,
            "supportedFilesFormat": [],
            "language": {
                "source": {"code": first.source, "name": language_name(first.source)},
                "target": {"code": first.target, "name": language_name(first.target)},
            },
        }

    def health(self) -> dict:
        first = self.pairs.default
        out = {"status": "ok", "model": self.model_name, "source": first.source, "target": first.target}
        if len(self.pairs) > 1:
            out["pairs"] = [f"{p.source}-{p.target}" for p in self.pairs.all]
        return out

    def settings_shown(self) -> dict:
        """What the page shows: the first model's decode settings, and every pair where there are several."""
        first = self.pairs.default
        d = first.model.batcher.decode
        shown = {
            "model": self.model_name,
            "source": first.source,
            "target": first.target,
            "beam": d.beam,
            "lenpen": d.lenpen,
            "max_chars": self.settings.max_chars,
            "max_alternatives": max(m.max_alternatives for m in self.pairs.models),
        }
        if len(self.pairs) > 1:
            shown["pairs"] = self.pairs.named()
        return shown
