"""A glossary term in the place of the model's own word for its source, not beside it.

The constrained search (nmt.translate.constraints) guarantees that a term is written; it does not say where.
A term the model would not choose ("bike -> Velo" for a model that says "Fahrrad") is most probably written
next to the model's own word: "Ein Mann fährt Fahrrad Velo.", or after the sentence. So, for each line with
terms, the model first translates it without them (greedy), that translation is aligned to the source by the
model's last-layer cross-attention (nmt.translate.align), and the word aligned to a term's source words both
ways (the target word whose subwords attend most to them, and which attends most to them: the intersection
of the two directions, which keeps links precise) is banned from the constrained search: a Constraint to be
placed 0 times. The search then has to find another way to say that part of the sentence, and the term,
which it must place anyway, is the likeliest: "Ein Mann fährt ein Velo."

Tried, not kept: looking again at the constrained translation, and banning the word linked to the term's
source there too where the term is not (a synonym: "mit ihrem Rad ... Velo" once "Fahrrad" is banned). On
the reversal model of the tests, the search had put the term first ("k l n o p" for "l c n o p"), the
word linked to the source was then a word of the line ("n"), and the second search lost it.

A word is not banned where the model wrote the term itself, where the word is one of the line's terms, part
of one or holds one (a term "Hunde" for the model's "Hund"), or where it has no letter or digit
(punctuation). A line whose search finds no translation under its bans is searched under its terms alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmt.translate.constraints import Constraint


def contains(seq: tuple[int, ...] | list[int], part: tuple[int, ...]) -> bool:
    """Whether `part` occurs in `seq` as a contiguous run."""
    n = len(part)
    return any(tuple(seq[i : i + n]) == part for i in range(len(seq) - n + 1))


def overlaps(word: tuple[int, ...], alternatives) -> bool:
    """Whether `word` is one of the token sequences `alternatives`, part of one, or holds one."""
    return any(contains(alt, word) or contains(word, alt) for alt in alternatives)


def written(tokens: list[int], constraint: Constraint) -> bool:
    """Whether `tokens` hold the constraint's term, any way it may be written."""
    return any(contains(tokens, alt) for alt in constraint.alternatives)


def own_words(
    attention: Tensor,
    tokens: list[int],
    constraints: list[Constraint],
    glue: Tensor,
    word_ends: Tensor,
    lead: int = 0,
) -> list[tuple[int, ...]]:
    """The words of `tokens` (a translation without terms, its subword ids) that translate the source words
    of `constraints`, as subword ids, to be banned. attention (T, S+1): row t is the attention over the
    source subwords (and EOS, last) of the position that predicts tokens[t] (align.cross_attention);
    Constraint.source gives each term's source subword positions. glue (V,) bool: the pieces that continue
    a word; word_ends (V,) bool: the pieces that end in a letter or digit. `lead`: 1 where the source
    begins with a target tag, which links no word."""
    if not tokens:
        return []
    begins = [t for t, token in enumerate(tokens) if t == 0 or not bool(glue[token])]
    word_of = torch.zeros(len(tokens), dtype=torch.long)
    word_of[begins[1:]] = 1
    word_of = word_of.cumsum(0).tolist()  # the word of each subword
    bounds = [*begins, len(tokens)]
    # (T,) the source subword each target subword reads most, the tag and EOS left out
    links = (attention[:, lead:-1].argmax(1) + lead).tolist()
    bans: list[tuple[int, ...]] = []
    words = [tuple(tokens[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    # every term of the line, any way it is written: a word that is one of them, or part of one, or holds
    # one, is never banned (a random model's translation may be "k k k" for two terms, one of them "k")
    every = [alt for c in constraints if c.count > 0 for alt in c.alternatives]
    for c in constraints:
        if not c.source or written(tokens, c):
            continue  # no source to align (a kept span's copy), or the model writes the term by itself
        source = set(c.source)

        def linked(w: int, source: set[int] = source) -> bool:  # a subword of w attends most to the source
            return any(links[t] in source for t in range(bounds[w], bounds[w + 1]))

        # the words of the subwords attending most to each of the term's source subwords; where one of
        # them holds a form of the term (or is part of one), linked both ways, it is in its place already
        chosen = {word_of[t] for t in attention[:, list(c.source)].argmax(0).tolist()}
        if any(overlaps(words[w], c.alternatives) and linked(w) for w in chosen):
            continue
        # the words that may be banned: not punctuation, and no term of the line
        free = [
            w
            for w, word in enumerate(words)
            if any(bool(word_ends[x]) for x in word) and not overlaps(word, every)
        ]
        if not free:
            continue
        rows = [t for w in free for t in range(bounds[w], bounds[w + 1])]
        for w in sorted({word_of[rows[r]] for r in attention[rows][:, list(c.source)].argmax(0).tolist()}):
            if linked(w) and words[w] not in bans:  # a link both ways
                bans.append(words[w])
    return bans


def with_bans(sentences: list[list[Constraint]], bans: list[list[tuple[int, ...]]]) -> list[list[Constraint]]:
    """Each sentence's constraints with its banned words added, each a Constraint placed 0 times."""
    return [
        cons + [Constraint((word,), 0) for word in words] for cons, words in zip(sentences, bans, strict=True)
    ]
