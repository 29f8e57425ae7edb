"""`nmt translate --split-sentences`: each line cut into sentences, translated, joined with its own spacing,
so one line in is still one line out."""

from __future__ import annotations

from nmt.sentences import join_sentences, split_sentences


class SentenceTranslator:
    """A line translator (nmt.translate.frontend.LineTranslator) that translates a line sentence by sentence.

    The k-th hypothesis of a line joins the k-th of each of its sentences (their scores summed)."""

    def __init__(self, translator, language: str):
        self.translator, self.language = translator, language

    @property
    def max_chars(self) -> int:
        """The characters of a line the line translator keeps."""
        return self.translator.max_chars

    def translate_nbest(
        self, lines: list[str], first_line: int = 1, prefixes: list[str] | None = None, on_batch=None
    ) -> list[list[tuple[str, float]]]:
        # on_batch counts lines, and a batch here holds sentences: the caller counts the chunk when done
        split = [split_sentences(line, self.language) for line in lines]
        sentences = [s for sents, _ in split for s in sents]
        results = self.translator.translate_nbest(sentences, first_line) if sentences else []
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
