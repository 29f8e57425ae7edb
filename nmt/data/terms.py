"""Inline terms: a glossary's target written into the source after its word, so the model places it there.

A glossary's constrained search (nmt.translate.constraints) guarantees that a term appears, not where:
a model that would write "Fahrrad" for "bike" writes "Ein Mann fährt Fahrrad Velo." when told
`bike -> Velo`. Dinu et al. (2019) teach the model to place terms itself: in a share of the training
pairs a source word is followed by its target word between two reserved control symbols,

    A man rides a bike <term> Fahrrad </term> .   ->   Ein Mann fährt ein Fahrrad .

and the model learns to copy what it finds there into the place of that word's translation (OpusTrainer's
terminology Tags and Eole's inlinetags do the same). A translation with a glossary then writes each
matched term into its line the same way, by id (never read out of text, so a user typing "<term>"
changes nothing), and the constrained search stays the guarantee.

Which words to annotate comes from a lexicon of the training data itself: word pairs that occur in the
same pairs far more often than apart (the Dice coefficient of their counts), so nothing beyond the corpus
is needed. With `data.augment.inline_terms_other` a share of the annotated words is given another
lexicon entry's target, on both sides, so the model learns to write the term it is given even where it
would have written another word: what a glossary asks of it ("bike -> Velo").

The draws are a pure function of (seed, index), as nmt.data.augment's, so a resumed preprocessing or a
second machine annotates the same pairs the same way.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

from nmt.config import AugmentConfig
from nmt.languages import TERM_CLOSE, TERM_OPEN

LEXICON_WORD = re.compile(r"\w{4,}")  # shorter words are mostly function words, ambiguous across pairs
LEXICON_PAIRS = 50_000  # pairs the lexicon is counted on: enough for the frequent words it keeps
MIN_COUNT, MIN_DICE = 20, 0.3  # a pair of words seen together at least this often, this exclusively
MAX_TERMS = 2  # annotated words in one training pair


def lexicon_words(line: str) -> set[str]:
    return set(LEXICON_WORD.findall(line.lower()))


def lexicon(pairs: Iterable[tuple[str, str]], min_count: int = MIN_COUNT, min_dice: float = MIN_DICE) -> dict:
    """source word -> target word as the target side most often writes it (German nouns capitalised),
    lower-cased source words, one target per source and one source per target, best Dice first. Counted
    on the first LEXICON_PAIRS pairs: a word frequent enough to be annotated is frequent there too."""
    cs, ct, both, surface = Counter(), Counter(), Counter(), Counter()
    for s, t in itertools.islice(pairs, LEXICON_PAIRS):
        ws, wt = lexicon_words(s), lexicon_words(t)
        cs.update(ws)
        ct.update(wt)
        both.update((a, b) for a in ws for b in wt)
        surface.update(LEXICON_WORD.findall(t.partition(" ")[2]))  # not the first word: capitalised anyway
    dice = {(a, b): 2 * n / (cs[a] + ct[b]) for (a, b), n in both.items() if n >= min_count}
    out: dict[str, str] = {}
    used: set[str] = set()
    for (a, b), d in sorted(dice.items(), key=lambda x: (-x[1], x[0])):
        if d >= min_dice and a not in out and b not in used:
            out[a] = b
            used.add(b)
    written: dict[str, str] = {}
    for w, _ in sorted(surface.items(), key=lambda x: (-x[1], x[0])):
        written.setdefault(w.lower(), w)
    return {a: written.get(b, b) for a, b in sorted(out.items())}


class Annotated(NamedTuple):
    src: str
    tgt: str
    terms: tuple[tuple[int, str], ...]  # (end of the source word in src, target term), left to right
    other: int  # how many of the terms were given another entry's target


def draws(seed: int, index: int) -> tuple[float, int]:
    """A uniform number in [0, 1) and a seed for the choices, of one pair (as nmt.data.augment's)."""
    digest = hashlib.blake2b(b"terms:%d:%d" % (seed, index), digest_size=16).digest()
    a, b = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")
    return (a >> 11) / 2**53, b


def _word(word: str) -> re.Pattern:
    return re.compile(rf"(?<!\w){re.escape(word)}(?!\w)", re.IGNORECASE)


def annotate(
    src: str, tgt: str, lex: dict[str, str], targets: list[str], augment: AugmentConfig, index: int
) -> Annotated | None:
    """The pair with up to MAX_TERMS of its lexicon words annotated, for (augment.seed, index); None where
    the pair is not drawn or has no word of the lexicon whose target its target side holds. `targets`:
    the lexicon's targets in a fixed order, from which another entry's target is drawn."""
    share, seed = draws(augment.seed, index)
    if share >= augment.inline_terms:
        return None
    tgt_words = lexicon_words(tgt)
    found = sorted(w for w in lexicon_words(src) if w in lex and lex[w].lower() in tgt_words)
    if not found:
        return None
    rng = random.Random(seed)
    chosen = rng.sample(found, min(MAX_TERMS, len(found)))
    # Each chosen word's target where the target side first writes it, all found in the target as given,
    # so a replacement is never taken for another word's target; the lexicon pairs distinct words with
    # distinct targets, so no two of these overlap.
    places = sorted(((_word(lex[w]).search(tgt), w) for w in chosen), key=lambda p: p[0].start())
    terms, other, out, at = [], 0, [], 0
    for found_at, w in places:
        term = found_at.group()  # as this target writes it
        if rng.random() < augment.inline_terms_other and len(targets) > 1:
            new = targets[rng.randrange(len(targets))]
            if new.lower() != term.lower():
                term = new[:1].upper() + new[1:] if term[:1].isupper() else new
                other += 1
        out += [tgt[at : found_at.start()], term]
        at = found_at.end()
        terms.append((_word(w).search(src).end(), term))
    tgt = "".join(out) + tgt[at:]
    return Annotated(src, tgt, tuple(sorted(terms)), other)


def inline_ids(subword, text: str, terms: Iterable[tuple[int, str]]) -> list[int]:
    """Subword ids of a source line with each (end, term) written after text[:end] between the reserved
    symbols, by id: the pieces of the text before, <term>, the term's target pieces, </term>, and so on.
    The text is read as text only (nothing in it becomes a tag), and what goes on without a space ("."
    after "bike") goes on without a word-start marker, as in the line encoded whole."""
    opening, closing = subword.tags[TERM_OPEN], subword.tags[TERM_CLOSE]
    ids: list[int] = []
    at = 0
    for end, term in terms:
        if text[at:end].strip():
            ids += subword.encode_text(text[at:end], glued=at > 0 and not text[at].isspace())
        ids += [opening, *subword.encode_target([term])[0], closing]
        at = end
    if text[at:].strip():
        ids += subword.encode_text(text[at:], glued=at > 0 and not text[at].isspace())
    return ids


class Annotator:
    """Inline terms for the training pairs of one direction, in the order binarizing reads them: called
    with each pair's text, it gives the subword ids of the annotated pair, or None to keep the pair as
    encoded. `first`: the index of this direction's first pair among all training pairs (the draws')."""

    def __init__(self, subword, lex: dict[str, str], augment: AugmentConfig, first: int = 0, limit: int = 0):
        self.subword, self.lex, self.augment = subword, lex, augment
        self.targets = sorted(set(lex.values()))
        self.index, self.seen = first, 0
        self.limit = limit  # the longest annotated source kept (data.max_subwords less its tags); 0: any
        self.pairs = self.terms = self.other = 0

    def __call__(self, src: str, tgt: str) -> tuple[list[int], list[int]] | None:
        index = self.index + self.seen
        self.seen += 1
        found = annotate(src, tgt, self.lex, self.targets, self.augment, index)
        if found is None:
            return None
        ids = inline_ids(self.subword, found.src, found.terms)
        if self.limit and len(ids) > self.limit:  # the pair as it was, rather than dropped for its length
            return None
        self.pairs += 1
        self.terms += len(found.terms)
        self.other += found.other
        return ids, self.subword.encode_target([found.tgt])[0]

    def stats(self) -> dict:
        return {"lexicon": len(self.lex), "pairs": self.pairs, "terms": self.terms, "other": self.other}
