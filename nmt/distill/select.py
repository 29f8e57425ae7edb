"""Which of the teacher's n-best hypotheses a sentence keeps.

With a reference, the one closest to it by sentence-level chrF (sacrebleu's own), as Kim and Rush (2016)
keep the beam's hypothesis closest to the reference by smoothed BLEU: the student learns the teacher's
style without the teacher's worst mistakes. Without one (monolingual source), the teacher's best.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sacrebleu.metrics import CHRF


@dataclass(frozen=True)
class Selected:
    """The hypothesis kept for one sentence: its rank in the n-best list (0 is the teacher's best), and
    the score it was kept by (chrF against the reference, or the teacher's own score for top1)."""

    rank: int
    score: float


def select_chrf(nbest: Sequence[Sequence[str]], refs: Sequence[str]) -> list[Selected]:
    """Per sentence, the hypothesis with the highest sentence chrF against its reference; a tie goes
    to the higher-ranked (the teacher's preference)."""
    if len(nbest) != len(refs):
        raise ValueError(f"{len(nbest)} n-best lists for {len(refs)} references")
    chrf = CHRF()
    chosen = []
    for hyps, ref in zip(nbest, refs, strict=True):
        scores = [chrf.sentence_score(h, [ref]).score for h in hyps]
        best = max(range(len(hyps)), key=lambda i: (scores[i], -i))
        chosen.append(Selected(best, scores[best]))
    return chosen


def select_top1(scores: Sequence[Sequence[float]]) -> list[Selected]:
    """Per sentence, the teacher's best hypothesis, kept by the teacher's own score."""
    return [Selected(0, s[0]) for s in scores]
