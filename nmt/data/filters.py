"""What to drop from a model's output before another model learns from it: a teacher's translations
(`nmt distill`), a reverse model's synthetic sources (`nmt backtranslate`).

Model output has its own failure modes: an empty line, a translation far longer or shorter than its
source (hallucination, or a sentence cut short), the same words looping, and a tail of sentences it got
badly wrong. Each filter is a predicate on one pair (`hyp` the side the model wrote); `filter_pairs`
applies them in order and counts what each removed, then drops the worst `worst_percent` of what is
left by score.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

REASONS = ("empty", "length_ratio", "repeating", "worst_score")


@dataclass(frozen=True)
class FilterSettings:
    max_ratio: float = 3.0  # longer side over shorter side, in whitespace words
    max_repeat: int = 4  # an n-gram (n = 1..4) repeated this many times in a row is a loop
    worst_percent: float = 5.0  # of the pairs left, the lowest-scoring share dropped


def is_empty(src: str, hyp: str) -> bool:
    return not hyp.strip() or not src.strip()


def bad_ratio(src: str, hyp: str, max_ratio: float) -> bool:
    """Word counts further apart than `max_ratio` (a short pair, up to 3 words a side, always passes:
    captions of two words translate to four)."""
    a, b = len(src.split()), len(hyp.split())
    if max(a, b) <= 3:
        return False
    return max(a, b) > max_ratio * max(min(a, b), 1)


def repeats(hyp: str, max_repeat: int) -> bool:
    """True when some n-gram (n = 1..4) occurs `max_repeat` times back to back: the decoder looping."""
    words = hyp.split()
    for n in range(1, 5):
        run_for = n * max_repeat
        for start in range(len(words) - run_for + 1):
            gram = words[start : start + n]
            if all(words[start + k * n : start + (k + 1) * n] == gram for k in range(1, max_repeat)):
                return True
    return False


def filter_pairs(
    srcs: Sequence[str], hyps: Sequence[str], scores: Sequence[float], settings: FilterSettings
) -> tuple[list[int], dict[str, int]]:
    """Indices of the pairs kept, in order, and how many each filter removed (by REASONS).

    The score filter drops the lowest `worst_percent` of the pairs the other filters kept (rounded down,
    ties broken by position so the result does not depend on sorting's stability)."""
    removed = dict.fromkeys(REASONS, 0)
    kept = []
    for i, (src, hyp) in enumerate(zip(srcs, hyps, strict=True)):
        if is_empty(src, hyp):
            removed["empty"] += 1
        elif bad_ratio(src, hyp, settings.max_ratio):
            removed["length_ratio"] += 1
        elif repeats(hyp, settings.max_repeat):
            removed["repeating"] += 1
        else:
            kept.append(i)
    worst = math.floor(len(kept) * settings.worst_percent / 100)
    if worst:
        dropped = set(sorted(kept, key=lambda i: (scores[i], i))[:worst])
        kept = [i for i in kept if i not in dropped]
    removed["worst_score"] = worst
    return kept, removed
