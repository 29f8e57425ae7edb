"""Input typed in ALL CAPS or Title Case, translated as a sentence is written and cased back
(`decode.recase`, `--recase`).

A model trained on text as it is written translates a shouted line or a heading badly: it has seen few
subwords in upper case (the demo model read "A MAN RIDES A BIKE." as garbage before data.augment; with it,
ALL CAPS still scored half its normal BLEU). Where a line is all upper case, or every word of it
capitalised, the front end translates it in sentence case (first letter upper, the rest lower) and writes
an ALL-CAPS line's translation in upper case; a Title-Case line's translation stays as the model writes
it. Only where decode.recase is on: a recipe turns it on for the models it trains, `--recase` or
`--no-recase` choose per command, and nmt translate says once when it recased a line.
"""

from __future__ import annotations

from enum import Enum


class Typed(Enum):
    AS_WRITTEN = "as written"
    ALL_CAPS = "ALL CAPS"
    TITLE_CASE = "Title Case"


def typed(line: str) -> Typed:
    """How a line is cased: ALL CAPS (no lower-case letter, and a word of two upper-case letters or more,
    so "A B" or "I" stay as written), Title Case (three words or more that have letters, each beginning
    with an upper-case letter and the rest of its letters lower case), or as written."""
    letters = [c for c in line if c.isalpha() and c.upper() != c.lower()]  # cased letters only
    if not letters:
        return Typed.AS_WRITTEN
    if all(c.isupper() for c in letters):
        if any(sum(c.isupper() for c in word) >= 2 for word in line.split()):
            return Typed.ALL_CAPS
        return Typed.AS_WRITTEN
    words = [w for w in line.split() if any(c.isalpha() and c.upper() != c.lower() for c in w)]
    if len(words) >= 3 and all(capitalised(w) for w in words):
        return Typed.TITLE_CASE
    return Typed.AS_WRITTEN


def capitalised(word: str) -> bool:
    cased = [c for c in word if c.isalpha() and c.upper() != c.lower()]
    return cased[0].isupper() and not any(c.isupper() for c in cased[1:])


def sentence_case(line: str) -> str:
    """The line in lower case with its first cased letter in upper case."""
    lower = line.lower()
    for i, c in enumerate(lower):
        if c.upper() != c:
            return lower[:i] + c.upper() + lower[i + 1 :]
    return lower


def as_typed(translation: str, how: Typed) -> str:
    """A translation cased as its source was typed: upper case for ALL CAPS, as it is otherwise."""
    return translation.upper() if how is Typed.ALL_CAPS else translation
