"""Sentence splitting: a paragraph cut into its sentences, the spacing between them kept to join them again.

The splitter is pysbd (the Golden Rules' rule-based segmenter): on hand-made EN/DE/FR paragraphs with
abbreviations, ordinals, decimals and quotes it split 11 of 12 sentences right, against 9 for syntok and 8
for sentence-splitter, which also rewrite the spacing. Languages pysbd lacks are split by its English rules.

pysbd is guarded on two sides, so that splitting is linear in the text whatever it holds:
- its numbered-reference rule (`text.[12 3]`) backtracks exponentially in the numbers inside brackets
  (pysbd issue #79: 47 bytes, `..[111 111 ... 111]`, take hours); it is replaced by the same rule with each
  number read atomically, which matches the same strings in linear time;
- no single pysbd call sees more than PIECE characters: a longer text is first cut after a sentence end
  (`. ` before a capital and the like) or at a space, and each piece is split alone, so whatever else
  in pysbd is super-linear is bounded by a constant.

A text of words, spaces and commas ending in at most one `.`, `!` or `?` (a heading, a link's text, a
short sentence: most HTML blocks) is one sentence without asking pysbd, which costs about a millisecond a
call whatever the length: 30,000 such blocks took a minute. pysbd agreed on each of 62,544 random texts of
that form.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from functools import lru_cache

import pysbd
from pysbd.lang.common.common import Common
from pysbd.languages import LANGUAGE_CODES

from nmt.languages import leading_tag

PIECE = 1000  # characters a single pysbd call sees at most

# pysbd 0.3.4's rule, and the same with each bracketed number atomic: `(\d{1,3},?\s?-?\s?)*` can read
# "111 111" as 1|11 1|11, ... and tries every way before failing; `(?>\d+...)` reads each number once.
SLOW_REFERENCE = r"(\d{1,3},?\s?-?\s?)*\b\d{1,3}\]"
if SLOW_REFERENCE in Common.NUMBERED_REFERENCE_REGEX:
    Common.NUMBERED_REFERENCE_REGEX = Common.NUMBERED_REFERENCE_REGEX.replace(
        SLOW_REFERENCE, r"((?>\d+,?\s?-?\s?))*\b\d{1,3}\]"
    )

# Where a long text may be cut before pysbd sees it: after a sentence's end and its spacing, before what
# starts one; else at a space.
SENTENCE_END = re.compile(r"[.!?\u3002]['\")\]]*\s+(?=[\"'(\[]?[A-Z\u00c0-\u00de\d])")
SPACE = re.compile(r"\s+")
ONE_SENTENCE = re.compile(r"[ \t]*(?:\w[\w ,'\u2019]*)?[.!?]?[ \t]*")


@lru_cache(maxsize=8)
def segmenter(language: str) -> pysbd.Segmenter:
    code = language if language in LANGUAGE_CODES else "en"
    return pysbd.Segmenter(language=code, clean=False)


def pieces(text: str, size: int = PIECE) -> list[tuple[int, int]]:
    """(start, end) of stretches of `text` of at most `size` characters that together make all of it, each
    cut after the last sentence end in its window, else at its last space, else at `size`."""
    out, at, n = [], 0, len(text)
    while n - at > size:
        window = text[at : at + size]
        cut = max((m.end() for m in SENTENCE_END.finditer(window)), default=0)
        if not cut:
            cut = max((m.end() for m in SPACE.finditer(window)), default=0)
        cut = cut or size
        out.append((at, at + cut))
        at += cut
    out.append((at, n))
    return out


def sentence_spans(
    text: str, language: str, check: Callable[[], None] | None = None
) -> list[tuple[int, int]]:
    """(start, end) of each sentence of `text`, its outer whitespace excluded, in order; none for blank text.
    `check` is called before each piece pysbd splits (a request's deadline: it raises to stop).

    pysbd returns pieces of the text itself (clean=False); each is found again from where the last ended,
    so the characters between sentences are exactly the original ones. A piece that is not found (pysbd
    never rewrites with clean=False, but a future version might) keeps the rest as one sentence.
    """
    spans = []
    for start, end in pieces(text):
        if check is not None:
            check()
        spans += [(start + s, start + e) for s, e in piece_spans(text[start:end], language)]
    return spans


def piece_spans(text: str, language: str) -> list[tuple[int, int]]:
    if not text.strip():
        return []
    if ONE_SENTENCE.fullmatch(text):
        lead = len(text) - len(text.lstrip())
        return [(lead, len(text.rstrip()))]
    spans, at = [], 0
    for piece in segmenter(language).segment(text):
        piece = piece.strip()
        if not piece:
            continue
        start = text.find(piece, at)
        if start < 0:
            break
        spans.append((start, start + len(piece)))
        at = start + len(piece)
    rest = text[at:]
    if rest.strip():  # whatever pysbd dropped or rewrote: one more sentence, never lost
        lead = len(rest) - len(rest.lstrip())
        spans.append((at + lead, len(text.rstrip())))
    return spans


def split_sentences(
    text: str, language: str, check: Callable[[], None] | None = None, tags: Collection[str] = ()
) -> tuple[list[str], list[str]]:
    """The sentences of `text` and the len+1 stretches around them (leading, between, trailing spacing),
    so that join_sentences(gaps, sentences) == text. A text that starts with one of `tags` (a
    multilingual model's target tags, `>>fra<< One. Two.`) has the tag before each of its sentences
    instead, so that all go into its language; the translations, which never hold a tag, are joined
    without it."""
    lead, rest = leading_tag(text) if tags else (None, text)
    if lead is not None and lead in tags:
        sentences, gaps = split_sentences(rest, language, check)
        return [f"{lead} {s}" for s in sentences], gaps
    spans = sentence_spans(text, language, check)
    gaps, at = [], 0
    for start, end in spans:
        gaps.append(text[at:start])
        at = end
    gaps.append(text[at:])
    return [text[s:e] for s, e in spans], gaps


def join_sentences(gaps: list[str], sentences: list[str]) -> str:
    """Sentences (or their translations) put back between the original spacing."""
    out = [gaps[0]]
    for sentence, gap in zip(sentences, gaps[1:], strict=True):
        out += [sentence, gap]
    return "".join(out)
