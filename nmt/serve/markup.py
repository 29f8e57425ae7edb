"""format: "html": a fragment translated sentence by sentence, its inline markup carried through them.

The fragment is cut into tokens by a small tokenizer of our own (`tokens`), not html.parser: every character
of the input belongs to exactly one token and comes back from it unless it is translated text, so markup can
neither be lost nor turned into text. Malformed markup (an unclosed comment, a trailing `<b`, an
unterminated attribute) runs to the end of the fragment as markup, which is what a browser would do with it.

Block-level tags (p, div, li, td, br, ... anything not in INLINE) separate blocks; a block's text is split
into sentences, each translated whole, and the inline elements inside it (b, i, a, span, ...) are put back
around the target words aligned to the source words they wrapped (nmt.translate.align; without a model's
attention, by relative position). Elements kept byte for byte: VERBATIM ones (script, style, pre,
textarea, ...), and any with translate="no" or class="notranslate" (quoted or not: `attributes` reads a
tag as a browser does); their text never reaches the model, so nothing else in a sentence is held to it.

Every step is linear in the fragment (or n log n): the tokenizer reads each character once, the open
inline tags are counted by name, and a block with more than ALIGNED_TAGS inline tags and markers has them
placed by relative position (a monotone map, which keeps their tree a tree without comparing each tag
with the others) rather than one by one through the alignment.
"""

from __future__ import annotations

import html
import re
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from nmt.sentences import sentence_spans

INLINE = {
    "a", "abbr", "b", "bdi", "bdo", "big", "cite", "code", "data", "del", "dfn", "em", "font", "i", "ins",
    "kbd", "label", "mark", "q", "s", "samp", "small", "span", "strike", "strong", "sub", "sup", "time",
    "tt", "u", "var",
}  # fmt: skip
INLINE_VOID = {"img", "wbr"}  # inside a sentence, at a place, wrapping nothing
VERBATIM = {"script", "style", "pre", "textarea", "template", "svg", "math", "noscript"}
RAW_TEXT = {"script", "style", "textarea", "title", "xmp", "noscript"}  # content up to </name> is not markup
VOID = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track",
    "wbr",
}  # fmt: skip
ALIGNED_TAGS = 64  # inline tags and markers of a block placed one by one through the alignment; more:
# by relative position (placing each against the others already placed is quadratic in their number)
ATTRIBUTE = re.compile(r"""([^\s/>"'=]+)(?:\s*=\s*("[^"]*"?|'[^']*'?|[^\s>]*))?""")
TAG_NAME = re.compile(r"</?([A-Za-z][^\s/>]*)")
WORD = re.compile(r"\S+")
SPACING = re.compile(r"\s+")


@dataclass
class Token:
    """A stretch of the fragment: kind text, start, end, self (a tag that closes itself), or other markup
    (comment, cdata, decl, pi, malformed); `name` is a tag's name in lower case."""

    kind: str
    raw: str
    name: str = ""

    @property
    def kept(self) -> bool:
        """A start or self-closing tag with translate="no", or "notranslate" among its classes."""
        return self.kind in ("start", "self") and is_kept(attributes(self.raw))


def attributes(raw: str) -> dict[str, str]:
    """A tag's attributes as a browser reads them: names in lower case, values quoted with " or ' or not
    quoted at all, entities decoded; the first of a repeated name wins."""
    name = TAG_NAME.match(raw)
    body = raw[name.end() if name else 0 :].removesuffix(">")
    out: dict[str, str] = {}
    for m in ATTRIBUTE.finditer(body):
        value = m.group(2) or ""
        if value[:1] in ("'", '"'):
            value = value[1:].removesuffix(value[0])
        out.setdefault(m.group(1).lower(), html.unescape(value))
    return out


def is_kept(attrs: dict[str, str]) -> bool:
    """translate="no" (HTML's), or "notranslate" among the classes (Google's)."""
    if attrs.get("translate", "").strip().lower() == "no":
        return True
    return "notranslate" in attrs.get("class", "").split()


def tag_end(text: str, at: int) -> int:
    """The index after the `>` closing the tag that starts at `at`, quotes respected; -1 when unclosed."""
    quote = None
    for i in range(at + 1, len(text)):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'" and text[i - 1] in "= \t\n":
            quote = c
        elif c == ">":
            return i + 1
    return -1


def tokens(text: str, check: Callable[[], None] | None = None) -> list[Token]:
    """The fragment as tokens whose raw strings, joined, are the fragment itself. `check` is called every
    1024 tokens (a request's deadline: it raises to stop)."""
    out: list[Token] = []
    i, n, plain = 0, len(text), 0

    def flush(upto: int) -> None:
        if upto > plain:
            out.append(Token("text", text[plain:upto]))

    while i < n:
        j = text.find("<", i)
        if j < 0:
            break
        nxt = text[j + 1 : j + 2]
        if text.startswith("<!--", j):
            end, kind = text.find("-->", j + 4), "comment"
            end = n if end < 0 else end + 3
        elif text.startswith("<![CDATA[", j):
            end, kind = text.find("]]>", j + 9), "cdata"
            end = n if end < 0 else end + 3
        elif nxt in ("!", "?"):
            end, kind = text.find(">", j + 2), "decl"
            end = n if end < 0 else end + 1
        elif nxt.isascii() and nxt.isalpha() or (nxt == "/" and text[j + 2 : j + 3].isascii() and
                                                text[j + 2 : j + 3].isalpha()):  # fmt: skip
            end = tag_end(text, j)
            kind = "malformed" if end < 0 else ("end" if nxt == "/" else "start")
            end = n if end < 0 else end
        else:  # a `<` that starts no markup is text ("a < b")
            i = j + 1
            continue
        flush(j)
        if check is not None and len(out) % 1024 < 2:
            check()
        raw = text[j:end]
        name = ""
        if kind in ("start", "end"):
            name = TAG_NAME.match(raw).group(1).lower()
            if kind == "start" and (raw.endswith("/>") or name in VOID):
                kind = "self"
        out.append(Token(kind, raw, name))
        i = plain = end
        if kind == "start" and name in RAW_TEXT:  # its content is text to no parser: up to </name
            close = re.compile(rf"</{re.escape(name)}(?:[\s/>]|$)", re.IGNORECASE).search(text, end)
            stop = close.start() if close else n
            if stop > end:
                out.append(Token("rawtext", text[end:stop]))
            i = plain = stop
    flush(n)
    return out


def visible_text(fragment: str, check: Callable[[], None] | None = None) -> str:
    """The text a reader sees in a fragment: its text tokens, entities decoded (no tags, attributes,
    scripts or styles), each token apart from the next: what language detection reads."""
    return " ".join(html.unescape(t.raw) for t in tokens(fragment, check) if t.kind == "text")


@dataclass
class Span:
    """An inline element of a block: its tags and the characters of the block's text it wraps."""

    open: str
    close: str
    start: int
    end: int
    depth: int
    order: int


@dataclass
class Block:
    """A run of text and inline markup between block boundaries."""

    text: str = ""  # the decoded text (set from `parts` when the block ends)
    parts: list[str] = field(default_factory=list)  # the decoded text as it was read
    size: int = 0  # characters read so far
    spans: list[Span] = field(default_factory=list)
    markers: list[tuple[int, str]] = field(default_factory=list)  # markup at a place, wrapping nothing
    sentences: list[tuple[int, int]] = field(default_factory=list)  # set by Document.__init__
    raw: list[str] = field(default_factory=list)  # the block's markup and text as they came

    @property
    def translatable(self) -> bool:
        return any(c.isalnum() for c in self.text)


def spacing(text: str) -> int:
    """How many whitespace characters `text` holds."""
    return sum(map(len, SPACING.findall(text)))


def sentence_line(text: str) -> str:
    """A sentence as the model gets it: its whitespace (newlines included) collapsed."""
    return " ".join(text.split())


class Document:
    """A fragment as verbatim markup (str) and blocks (Block), in order."""

    def __init__(
        self,
        text: str,
        language: str = "en",
        split: bool = True,
        check: Callable[[], None] | None = None,
        limit: Callable[[int], None] | None = None,
    ):
        """`check` is called between steps (a request's deadline: it raises to stop); `limit`, before the
        sentences are split, with the number of characters other than spacing there is to translate (a
        server's --max-chars: it raises to refuse)."""
        self.parts: list[str | Block] = []
        self.kept: list[str] = []  # the verbatim elements, each whole (translate="no" and the like)
        self.check = check or (lambda: None)
        self.build(tokens(text, self.check))
        if limit is not None:
            limit(sum(len(b.text) - spacing(b.text) for b in self.blocks if b.translatable))
        for block in self.blocks:
            self.check()
            if not block.translatable:
                continue
            if split:
                block.sentences = sentence_spans(block.text, language, self.check)
            else:
                stripped = block.text.strip()
                start = block.text.find(stripped)
                block.sentences = [(start, start + len(stripped))]

    @property
    def blocks(self) -> list[Block]:
        return [p for p in self.parts if isinstance(p, Block)]

    def build(self, toks: list[Token]) -> None:
        block: Block | None = None
        stack: list[tuple[str, int, int]] = []  # open inline tags of this block: (name, token index, start)
        open_names: Counter[str] = Counter()  # how many of each name the stack holds

        def end_block() -> None:
            nonlocal block
            if block is not None:
                for _, index, start in stack:  # never closed in the block: a marker where it was
                    block.markers.append((start, toks[index].raw))
                block.text = "".join(block.parts)
                self.parts.append(block)
            block, stack[:] = None, []
            open_names.clear()

        def current() -> Block:
            nonlocal block
            if block is None:
                block = Block()
            return block

        i = 0
        while i < len(toks):
            if i % 1024 == 0:
                self.check()
            t = toks[i]
            if t.kind == "start" and (t.name in VERBATIM or t.kept):
                j, depth = i + 1, 1  # the whole element, kept as it is
                while j < len(toks) and depth:
                    u = toks[j]
                    depth += (u.kind == "start" and u.name == t.name) - (u.kind == "end" and u.name == t.name)
                    j += 1
                raw = "".join(u.raw for u in toks[i:j])
                self.kept.append(raw)
                if t.name in INLINE and block is not None:
                    block.markers.append((block.size, raw))
                    block.raw.append(raw)
                else:
                    end_block()
                    self.parts.append(raw)
                i = j
                continue
            if t.kind == "self" and t.kept:
                self.kept.append(t.raw)
            if t.kind in ("text", "rawtext"):
                b = current()
                decoded = html.unescape(t.raw)
                b.parts.append(decoded)
                b.size += len(decoded)
                b.raw.append(t.raw)
            elif t.kind == "start" and t.name in INLINE:
                b = current()
                stack.append((t.name, i, b.size))
                open_names[t.name] += 1
                b.raw.append(t.raw)
            elif t.kind == "end" and t.name in INLINE and open_names[t.name]:
                b = current()
                b.raw.append(t.raw)
                while stack:
                    name, index, start = stack.pop()
                    open_names[name] -= 1
                    if name == t.name:
                        b.spans.append(Span(toks[index].raw, t.raw, start, b.size, len(stack), index))
                        break
                    b.markers.append((start, toks[index].raw))  # an inner tag never closed
            elif t.kind in ("self", "comment", "cdata", "decl", "end") and (
                t.kind in ("comment", "cdata", "decl") or t.name in INLINE_VOID or t.name in INLINE
            ):
                if block is None:
                    self.parts.append(t.raw)
                else:
                    block.markers.append((block.size, t.raw))
                    block.raw.append(t.raw)
            else:  # a block boundary (any other tag), or markup outside a block
                end_block()
                self.parts.append(t.raw)
            i += 1
        end_block()

    def lines(self) -> list[str]:
        """The sentences to translate, in order, one line each."""
        return [sentence_line(b.text[s:e]) for b in self.blocks for s, e in b.sentences]

    def join(self, translations: list[str], align: Callable[[str, str], list | None] | None = None) -> str:
        """The fragment with its sentences replaced by `translations` (in the order of `lines`), the
        inline markup placed by `align(source, translation)` (see nmt.translate.align.Aligner.align)."""
        it = iter(translations)
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            elif not part.sentences:  # nothing to translate (spacing, punctuation): as it came
                out.append("".join(part.raw))
            else:
                self.check()
                out.append(place(part, [next(it) for _ in part.sentences], align))
        return "".join(out)


def word_ranges(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    return [m.span() for m in WORD.finditer(text, start, len(text) if end is None else end)]


def place(block: Block, translations: list[str], align) -> str:
    """A block's translation with its spans and markers put where their source words went."""
    src = block.text
    # The target: the translations between the block's own spacing (text before, between, after them).
    pieces, at, spans_t = [], 0, []
    for (s, e), tr in zip(block.sentences, translations, strict=True):
        pieces.append(src[at:s])
        start = sum(map(len, pieces))
        pieces.append(tr)
        spans_t.append((start, start + len(tr)))
        at = e
    pieces.append(src[at:])
    tgt = "".join(pieces)
    if len(block.spans) + len(block.markers) > ALIGNED_TAGS:
        return render(tgt, by_position(block, tgt, spans_t))
    # Source word -> target words, sentence by sentence, in block offsets.
    src_words: list[tuple[int, int]] = []
    aligned: list[list[tuple[int, int]]] = []  # per source word: target word ranges
    for (s, e), (ts, te), tr in zip(block.sentences, spans_t, translations, strict=True):
        sw, tw = word_ranges(src, s, e), word_ranges(tgt, ts, te)
        links = align(sentence_line(src[s:e]), tr) if align is not None and tr.strip() else None
        if links is None or len(links) != len(tw):
            links = proportional(len(sw), len(tw))
        mine: list[list[tuple[int, int]]] = [[] for _ in sw]
        for j, i in enumerate(links):
            if i is not None and 0 <= i < len(sw):
                mine[i].append(tw[j])
        src_words += sw
        aligned += mine

    def where(pos: int) -> int:
        """A place in the source text -> a place in the target: spacing maps to the same spacing, a
        sentence's edges to its translation's, a place inside a sentence to before the target words
        aligned to the source word that follows."""
        for (s, e), (ts, te) in zip(block.sentences, spans_t, strict=True):
            if pos < s:
                return ts - (s - pos)  # in the spacing before this sentence: the same spacing
            if pos == s:
                return ts
            if pos < e:
                for (ws, _), targets in zip(src_words, aligned, strict=True):
                    if ws >= pos and ws < e and targets:
                        return min(t for t, _ in targets)
                return te
            if pos == e:
                return te
        return len(tgt) - (len(src) - pos)

    inserts: list[tuple[int, int, int, str]] = []  # (position, group, order, markup)
    placed: list[tuple[Span, int, int]] = []
    for span in sorted(block.spans, key=lambda sp: (sp.start, -sp.end, sp.order)):
        covered = [k for k, (ws, we) in enumerate(src_words) if ws < span.end and we > span.start]
        targets = [t for k in covered for t in aligned[k]]
        whole = [
            (ts, te)
            for (s, e), (ts, te) in zip(block.sentences, spans_t, strict=True)
            if span.start <= s and e <= span.end
        ]
        ranges = targets + whole
        if ranges:
            ts, te = min(r[0] for r in ranges), max(r[1] for r in ranges)
            ts, te = trim(src, src_words, span, tgt, ts, te)
        else:
            ts = te = where(span.start)
        for other, os_, oe in placed:  # keep the tree a tree: inside its ancestors, across no other
            if other.start <= span.start and span.end <= other.end and other.depth < span.depth:
                ts, te = min(max(ts, os_), oe), max(min(te, oe), os_)
            elif os_ < ts < oe < te:  # starts inside an earlier one and ends after it
                ts = oe
            elif ts < os_ < te < oe:  # starts before an earlier one and ends inside it
                te = os_
            elif os_ <= ts and te <= oe and (os_, oe) != (ts, te) and ts != te:
                ts = te = oe  # inside an earlier one that is no ancestor: after it, wrapping nothing
            te = max(te, ts)
        placed.append((span, ts, te))
        if ts == te:
            inserts.append((ts, 1, span.order, span.open + span.close))
        else:
            inserts.append((ts, 2, span.order, span.open))
            inserts.append((te, 0, -(span.depth * 1_000_000 + span.order), span.close))  # last opened first
    for k, (pos, raw) in enumerate(block.markers):
        inserts.append((where(pos), 1, -1_000_000 + k, raw))
    return render(tgt, inserts)


def by_position(block: Block, tgt: str, spans_t: list[tuple[int, int]]) -> list[tuple[int, int, int, str]]:
    """A block's markup placed by relative position: a place in a sentence before its i-th of n words goes
    before the translation's round(i*m/n)-th of m words, spacing maps to the same spacing. The map is
    monotone, so spans nested or apart in the source are nested or apart in the target: each is placed in
    O(log n) without looking at the others."""
    src = block.text
    starts = [s for s, _ in block.sentences]
    words = [[ws for ws, _ in word_ranges(src, s, e)] for s, e in block.sentences]
    targets = [[ws for ws, _ in word_ranges(tgt, ts, te)] for ts, te in spans_t]

    def at(pos: int) -> int:
        k = bisect_right(starts, pos) - 1
        if k < 0:
            return pos  # the spacing before the first sentence is the same
        e, te = block.sentences[k][1], spans_t[k][1]
        if pos >= e:
            return te + (pos - e)  # the spacing after a sentence is the same
        i, n, m = bisect_left(words[k], pos), len(words[k]), len(targets[k])
        j = (i * m + n // 2) // max(n, 1)
        return targets[k][j] if j < m else te

    inserts: list[tuple[int, int, int, str]] = []  # (position, group, order, markup): as in `place`
    for span in block.spans:
        ts, te = at(span.start), at(span.end)
        if ts == te:
            inserts.append((ts, 1, span.order, span.open + span.close))
        else:
            inserts.append((ts, 2, span.order, span.open))
            inserts.append((te, 0, -(span.depth * 1_000_000 + span.order), span.close))
    for k, (pos, raw) in enumerate(block.markers):
        inserts.append((at(pos), 1, -1_000_000 + k, raw))
    return inserts


def trim(src: str, words: list[tuple[int, int]], span: Span, tgt: str, ts: int, te: int) -> tuple[int, int]:
    """A span that wrapped a word but not the punctuation stuck to it ("<b>runs</b>.") leaves the same
    punctuation out of the target word it is placed on."""
    for ws, we in words:
        if ws < span.end < we:
            rest = src[span.end : we]
            if (
                not any(c.isalnum() for c in rest)
                and tgt[te - len(rest) : te] == rest
                and te - len(rest) > ts
            ):
                te -= len(rest)
        if ws < span.start < we:
            lead = src[ws : span.start]
            if (
                not any(c.isalnum() for c in lead)
                and tgt[ts : ts + len(lead)] == lead
                and ts + len(lead) < te
            ):
                ts += len(lead)
    return ts, te


def render(tgt: str, inserts: list[tuple[int, int, int, str]]) -> str:
    """The target text, escaped, with markup inserted at its places: closing tags first (inner ones
    first), then markup that wraps nothing, then opening tags (outer ones first)."""
    out, at = [], 0
    for pos, _, _, raw in sorted(inserts, key=lambda x: x[:3]):
        pos = min(max(pos, at), len(tgt))
        out += [html.escape(tgt[at:pos], quote=False), raw]
        at = pos
    out.append(html.escape(tgt[at:], quote=False))
    return "".join(out)


def proportional(sources: int, targets: int) -> list[int | None]:
    """Without attention: target word j aligned to the source word at the same relative place."""
    if not sources:
        return [None] * targets
    return [min(sources - 1, (2 * j + 1) * sources // (2 * max(targets, 1))) for j in range(targets)]
