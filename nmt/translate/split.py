"""`nmt translate`'s sentence splitting (on by default, --no-split-sentences for one sentence a line): each
line cut into sentences, translated, joined with its own spacing, so one line in is still one line out; and
the check that a translation covers its source (`short_lines`), whichever way lines are translated."""

from __future__ import annotations

import re

from nmt.sentences import join_sentences, split_sentences

# A sentence end: terminal punctuation (closing quotes and brackets after it allowed), then space and a
# capital, digit or opening quote. Cheap and language-blind: it only has to count roughly, on every line.
SENTENCE_END = re.compile(
    r"[.!?\u2026\u3002\uff01\uff1f][\"'\u201d\u2019\u00bb)\]]*\s+(?=[\"'\u201c\u2018\u00ab(\dA-Z\u00c0-\u00de\u0391-\u03a9\u0410-\u042f])"
)
SHORT_RATIO = (
    0.6  # a translation below this share of its source's characters, with sentences missing, is short
)


def sentence_count(text: str) -> int:
    return len(SENTENCE_END.findall(text.strip())) + 1 if text.strip() else 0


def short_lines(lines: list[str], translations: list[str]) -> list[tuple[int, int, int]]:
    """(index, sentences out, sentences in) of each line whose translation covers much less than its
    source: fewer sentences than a source of several, and under SHORT_RATIO of its length. A model
    trained on one sentence a line stops after the first: this is what that looks like."""
    out = []
    for i, (src, hyp) in enumerate(zip(lines, translations, strict=True)):
        n_src = sentence_count(src)
        if n_src < 2:
            continue
        n_hyp = sentence_count(hyp)
        if n_hyp < n_src and len(hyp.strip()) < SHORT_RATIO * len(src.strip()):
            out.append((i, n_hyp, n_src))
    return out


class SentenceTranslator:
    """A line translator (nmt.translate.frontend.LineTranslator) that translates a line sentence by sentence.

    The k-th hypothesis of a line joins the k-th of each of its sentences (their scores summed)."""

    def __init__(self, translator, language: str):
        self.translator, self.language = translator, language

    def split(self, line: str) -> tuple[list[str], list[str]]:
        """The line's sentences and the spacing between them; a leading target tag goes before each."""
        return split_sentences(line, self.language, tags=self.translator.subword.tags)

    @property
    def max_chars(self) -> int:
        """The characters of a line the line translator keeps."""
        return self.translator.max_chars

    def translate_nbest(
        self, lines: list[str], first_line: int = 1, prefixes: list[str] | None = None, on_batch=None
    ) -> list[list[tuple[str, float]]]:
        split = [self.split(line) for line in lines]
        sentences = [s for sents, _ in split for s in sents]
        numbers = [first_line + k for k, (sents, _) in enumerate(split) for _ in sents]  # warnings name lines
        counted = None
        if on_batch is not None and sentences:  # on_batch counts lines: a sentence is a share of one
            share, told = len(lines) / len(sentences), [0.0, 0]

            def counted(n: int) -> None:
                told[0] += n * share
                if (whole := int(told[0]) - told[1]) > 0:
                    told[1] += whole
                    on_batch(whole)

        results = self.translator.translate_nbest(sentences, numbers, on_batch=counted) if sentences else []
        out, at = [], 0
        for sents, gaps in split:
            mine, at = results[at : at + len(sents)], at + len(sents)
            if not mine:
                out.append([(join_sentences(gaps, []).strip(), 0.0)])  # blank: blank, as without splitting
                continue
            n = max(len(hyps) for hyps in mine)
            out.append(
                [
                    (
                        join_sentences(gaps, [hyps[min(k, len(hyps) - 1)][0] for hyps in mine]).strip(),
                        sum(hyps[min(k, len(hyps) - 1)][1] for hyps in mine),
                    )
                    for k in range(n)
                ]
            )
        return out
