"""What a LibreTranslate text becomes before the model sees it: its sentences (format "text": each line cut
into sentences, the spacing kept) or its HTML blocks' sentences (format "html", nmt.serve.markup), and how
the translations are put back together. `check` is a request's deadline, called between steps."""

from __future__ import annotations

from collections.abc import Callable, Collection

from nmt.sentences import join_sentences, split_sentences
from nmt.serve.markup import Document, spacing, visible_text


class PlainText:
    """A text's lines (nmt translate's line contract), each cut into sentences when `split`."""

    kept = None  # no markup: nothing marked to stay as it is

    def __init__(
        self,
        text: str,
        language: str,
        split: bool,
        check: Callable[[], None] | None = None,
        limit: Callable[[int], None] | None = None,
        tags: Collection[str] = (),
    ):
        self.pieces: list[tuple[list[str], list[str]]] = []  # per line: (sentences, spacing around them)
        if limit is not None:  # every character but spacing reaches the model
            limit(len(text) - spacing(text))
        for line in text.split("\n"):
            line = line.removesuffix("\r")
            if split:
                self.pieces.append(split_sentences(line, language, check, tags))
            else:
                self.pieces.append(([line], ["", ""]))
        self.lines = [s for sentences, _ in self.pieces for s in sentences]

    def join(self, translations: list[str], align=None) -> str:
        it = iter(translations)
        return "\n".join(join_sentences(gaps, [next(it) for _ in sents]) for sents, gaps in self.pieces)


class HtmlText:
    """An HTML fragment's sentences, its markup placed again by word alignment. Its translate="no"
    elements are copied by the markup itself and never reach the model: nothing else is held to them."""

    needs_alignment = True
    kept = None

    def __init__(
        self,
        text: str,
        language: str,
        split: bool,
        check: Callable[[], None] | None = None,
        limit: Callable[[int], None] | None = None,
    ):
        self.document = Document(text, language, split, check, limit)
        self.lines = self.document.lines()

    def join(self, translations: list[str], align=None) -> str:
        return self.document.join(translations, align)


def document(
    text: str,
    fmt: str,
    language: str,
    split: bool,
    check: Callable[[], None] | None = None,
    limit: Callable[[int], None] | None = None,
    tags: Collection[str] = (),
) -> PlainText | HtmlText:
    """A text's sentences. `check`: called between steps (a deadline); `limit`: called with the characters
    other than spacing to translate, before the costly step (sentence splitting), to refuse too many;
    `tags`: the model's target tags, a line's leading one going into each of its sentences."""
    if fmt == "html":
        return HtmlText(text, language, split, check, limit)
    return PlainText(text, language, split, check, limit, tags)


def readable(text: str, fmt: str, check: Callable[[], None] | None = None) -> str:
    """What language detection reads of a text: an HTML fragment's visible words, a plain text as it is."""
    return visible_text(text, check) if fmt == "html" else text


def aligner(translator):
    """The word aligner of a translator's model (nmt.translate.align), or None where the engine has no
    attention to read (CTranslate2, an ensemble): markup is then placed by relative position."""
    from nmt.model import Transformer
    from nmt.translate.align import Aligner

    model = getattr(translator, "model", None)
    if not isinstance(model, Transformer):
        return None
    return Aligner(model, translator.subword)
