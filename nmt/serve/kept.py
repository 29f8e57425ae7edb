"""HTML that must not be translated: elements with translate="no" or class="notranslate" (HTML's and
Google's conventions), whose text a translation copies as it is (copy constraints of
nmt.translate.terminology)."""

from __future__ import annotations

from html.parser import HTMLParser

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def is_kept(attrs: list[tuple[str, str | None]]) -> bool:
    """translate="no", or "notranslate" among the classes."""
    for name, value in attrs:
        if name == "translate" and (value or "").strip().lower() == "no":
            return True
        if name == "class" and "notranslate" in (value or "").split():
            return True
    return False


class KeptSpans(HTMLParser):
    """The text of each outermost kept element, whitespace collapsed, in document order."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[bool] = []  # per open element: inside a kept one
        self.spans: list[str] = []
        self.current: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in VOID:
            return
        inside = bool(self.stack and self.stack[-1])
        self.stack.append(inside or is_kept(attrs))

    def handle_endtag(self, tag):
        if tag in VOID or not self.stack:
            return
        was = self.stack.pop()
        if was and not (self.stack and self.stack[-1]):  # an outermost kept element ends
            text = " ".join("".join(self.current).split())
            if text:
                self.spans.append(text)
            self.current = []

    def handle_data(self, data):
        if self.stack and self.stack[-1]:
            self.current.append(data)


def kept_spans(fragment: str) -> list[str]:
    """The texts of `fragment` that stay as they are: those of its translate="no" and notranslate
    elements."""
    parser = KeptSpans()
    parser.feed(fragment)
    parser.close()
    return parser.spans


def spans_in(line: str, spans: list[str]) -> list[str]:
    """The kept spans a line to translate holds (a text node, or a sentence of several), each as often as
    it occurs: they become the line's copy constraints (Terminology.copies)."""
    text = " ".join(line.split())
    out = []
    for span in dict.fromkeys(spans):
        out += [span] * text.count(span)
    return out
