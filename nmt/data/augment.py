"""Training pairs made to look as people type: ALL CAPS, Title Case, typos, no final punctuation.

A model that has only seen clean captions falls apart on a shouted heading (issue 43: BLEU 0.01 in ALL
CAPS, 3.6 in Title Case). The modifiers follow OpusTrainer's (UpperCase, TitleCase, Typos,
RemoveEndPunct, with Mozilla's shares 0.07, 0.05, 0.05, 0.2 as the Multi30k recipes' default); each
`data.augment` share is the probability that a training pair gets that modifier:

    uppercase         both sides upper-cased (the target only where its script has case)
    titlecase         the first letter of every word capitalised, both sides alike
    typos             the source only: a few adjacent letters swapped, a letter dropped or repeated
    remove_end_punct  the final punctuation of both sides removed (only when both end in it)

Upper and title case exclude each other; the others combine with them. The draws of a pair are a pure
function of (seed, epoch, index), so whoever applies them gets the same pairs on every run and on a
resume. `nmt preprocess` applies them once, as epoch 0, to the cleaned text, replacing each chosen pair
by its modified version: the binarized split then costs the trainer nothing per step, and the subword
model is learned from the upper-cased text too, so capitals are not split into single letters.
"""

from __future__ import annotations

import hashlib
import random
import struct
import unicodedata

from nmt.config import AugmentConfig

MODIFIERS = ("uppercase", "titlecase", "typos", "remove_end_punct")
TYPO_EVERY = 20  # about one typo per this many characters of source, at least one


def is_on(augment: AugmentConfig) -> bool:
    return any(getattr(augment, m) > 0 for m in MODIFIERS)


def pair_draws(seed: int, epoch: int, index: int) -> tuple[float, float, float, int]:
    """Three uniform numbers in [0, 1) and a seed for the typos, of one pair: from a BLAKE2b hash of
    (seed, epoch, index), the same in every process and on every platform (unlike hash()), and a
    few times cheaper than seeding a random.Random for every pair."""
    digest = hashlib.blake2b(b"augment:%d:%d:%d" % (seed, epoch, index), digest_size=32).digest()
    a, b, c, typo_seed = struct.unpack("<4Q", digest)
    return (a >> 11) / 2**53, (b >> 11) / 2**53, (c >> 11) / 2**53, typo_seed  # 53 bits: exact, < 1


def augment_pair(
    src: str, tgt: str, augment: AugmentConfig, epoch: int, index: int
) -> tuple[str, str, tuple[str, ...]]:
    """The pair as modified for (augment.seed, epoch, index), and the modifiers applied (in order)."""
    # Every draw is made whatever the outcome, so one share's change leaves the others' choices alone.
    case, typo, punct, typo_seed = pair_draws(augment.seed, epoch, index)
    applied = []
    if punct < augment.remove_end_punct and _ends_in_punct(src) and _ends_in_punct(tgt):
        stripped = strip_end_punct(src), strip_end_punct(tgt)
        if all(stripped):  # "..." alone must not become an empty line
            src, tgt = stripped
            applied.append("remove_end_punct")
    if typo < augment.typos:
        src = typos(src, random.Random(typo_seed))
        applied.append("typos")
    if case < augment.uppercase:
        src, tgt = src.upper(), tgt.upper()
        applied.append("uppercase")
    elif case < augment.uppercase + augment.titlecase:
        src, tgt = title_case(src), title_case(tgt)
        applied.append("titlecase")
    return src, tgt, tuple(applied)


def title_case(text: str) -> str:
    """Each space-separated word's first letter capitalised, the rest left as written ("McDonald's"
    stays, where str.title() would give "Mcdonald'S"). Scripts without case come out unchanged."""
    return " ".join(w[:1].upper() + w[1:] for w in text.split(" "))


def typos(text: str, rng: random.Random) -> str:
    """`text` with a few letter typos: two adjacent letters swapped, a letter dropped, or one doubled."""
    chars = list(text)
    for _ in range(max(1, len(chars) // TYPO_EVERY)):
        letters = [i for i, c in enumerate(chars) if c.isalpha()]
        if len(letters) < 2:  # a typo in "a" or "5" would make another word, not a misspelt one
            break
        i = rng.choice(letters)
        kind = rng.randrange(3)
        if kind == 0 and i + 1 < len(chars) and chars[i + 1].isalpha():
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
        elif kind == 1:
            del chars[i]
        else:
            chars.insert(i, chars[i])
    return "".join(chars)


def _is_punct(c: str) -> bool:
    return unicodedata.category(c).startswith("P")


def _ends_in_punct(text: str) -> bool:
    return bool(text) and _is_punct(text[-1])


def strip_end_punct(text: str) -> str:
    end = len(text)
    while end and (_is_punct(text[end - 1]) or text[end - 1].isspace()):
        end -= 1
    return text[:end]
