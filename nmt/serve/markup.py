"""format: "html": a fragment's text nodes translated, its markup kept where it was."""

from __future__ import annotations

import html
from html.parser import HTMLParser


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
