"""Inline terms (nmt.data.terms): the lexicon, which training pairs are annotated and how, and a
glossary's terms written into a translated line's source by id, never read out of its text."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nmt.config import AugmentConfig
from nmt.data.terms import Annotator, annotate, inline_ids, lexicon, lexicon_words
from nmt.languages import TERM_CLOSE, TERM_OPEN
from nmt.subword import train_sentencepiece
from nmt.tokens import UNK
from nmt.translate.terminology import Terminology, glossary_of

NOUNS = {"bike": "Fahrrad", "dog": "Hund", "house": "Haus", "tree": "Baum", "horse": "Pferd", "ball": "Ball"}
VERBS = {"sees": "sieht", "likes": "mag", "draws": "malt"}


def corpus(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """A man sees a bike. -> Ein Mann sieht ein Fahrrad."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        (a, b), (v, w) = rng.choice(sorted(NOUNS.items())), rng.choice(sorted(VERBS.items()))
        (c, d) = rng.choice(sorted(NOUNS.items()))
        out.append((f"The {a} {v} a {c}.", f"Der {b} {w} ein {d}."))
    return out


@pytest.fixture(scope="module")
def sub(tmp_path_factory):
    lines = [s for pair in corpus(300) for s in pair] + ["Velo Kuh Katze <term> >>fra<<"]
    prefix = tmp_path_factory.mktemp("spm") / "spm"
    return train_sentencepiece(
        lines,
        prefix,
        90,
        control_symbols=f"{TERM_OPEN},{TERM_CLOSE}",
        hard_vocab_limit=False,
        character_coverage=1.0,
    )


def test_the_lexicon_pairs_each_word_with_its_translation_as_the_target_writes_it():
    lex = lexicon(corpus(2000))
    for en, de in NOUNS.items():
        if len(en) >= 4:  # shorter words are left out: mostly function words in real text
            assert lex[en] == de
    assert lex["sees"] == "sieht" and "the" not in lex and "dog" not in lex


def test_the_lexicon_keeps_a_pair_seen_together_often_and_more_than_apart():
    pairs = [
        ("small puppy", "kleine Welpe"),
        ("small horse", "kleine Pferd"),
        ("black puppy", "schwarze Welpe"),
    ]
    # Dice 1 for each true pair, 2/3 or 1/2 for the others; targets as written after a line's first word
    assert lexicon(pairs * 25) == {"small": "kleine", "puppy": "Welpe", "horse": "Pferd", "black": "schwarze"}
    assert lexicon((pairs * 25)[:57]) == {"small": "kleine", "puppy": "Welpe"}  # 19 horses, 19 blacks


def test_the_annotated_pairs_are_the_drawn_share_each_term_after_its_word_and_in_its_target():
    lex = lexicon(corpus(2000))
    targets = sorted(set(lex.values()))
    augment = AugmentConfig(inline_terms=0.3, inline_terms_other=0.5)
    pairs = corpus(2000, seed=1)
    found = [annotate(s, t, lex, targets, augment, i) for i, (s, t) in enumerate(pairs)]
    assert found == [annotate(s, t, lex, targets, augment, i) for i, (s, t) in enumerate(pairs)]  # drawn
    done = [(pair, a) for pair, a in zip(pairs, found, strict=True) if a is not None]
    assert 0.25 < len(done) / len(pairs) < 0.35
    other = sum(a.other for _, a in done) / sum(len(a.terms) for _, a in done)
    assert 0.4 < other < 0.6
    for (src, tgt), a in done:
        assert a.src == src and 1 <= len(a.terms) <= 2
        for end, term in a.terms:
            assert src[:end].split()[-1].lower() in lex  # the term follows its source word
            assert term in a.tgt.split() or term + "." in a.tgt.split()  # and its target says it
        if not a.other:
            assert a.tgt == tgt
        else:  # another entry's target, in the place of the one it replaced
            assert a.tgt != tgt and len(a.tgt.split()) == len(tgt.split())
    none = AugmentConfig(inline_terms=0.0, inline_terms_other=1.0)
    assert all(annotate(s, t, lex, targets, none, i) is None for i, (s, t) in enumerate(pairs))


def test_a_term_goes_in_by_id_and_the_line_around_it_is_encoded_as_it_was(sub):
    opening, closing = sub.tags[TERM_OPEN], sub.tags[TERM_CLOSE]
    text = "The dog sees a bike."
    ids = inline_ids(sub, text, [(len("The dog sees a bike"), "Velo")])
    assert ids.count(opening) == 1 and ids.count(closing) == 1
    start, end = ids.index(opening), ids.index(closing)
    assert ids[start + 1 : end] == sub.encode_target(["Velo"])[0]
    assert ids[:start] + ids[end + 1 :] == sub.encode([text])[0]  # "." glued to "bike", as it was
    # typed into a line, the symbols are text: no id of theirs
    typed = sub.encode(["The dog <term> Velo </term> sees a bike."])[0]
    assert opening not in typed and closing not in typed


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.sampled_from("abdefghiknorstuvwyTD .,!?-'\"<>/é"), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=4),
    term=st.sampled_from(["Velo", "Hund", "ein Haus", "x"]),
)
def test_inline_terms_leave_the_rest_of_any_line_as_it_reads(sub, text, cuts, term):
    """Whatever the line and wherever the terms go (after a word, as a glossary match ends), its ids less
    the terms' decode to the line. Characters the vocabulary lacks are left out: SentencePiece makes a
    run of them one unknown piece, which a term between them splits in two."""
    assume(UNK not in sub.encode([text])[0])
    ends = sorted({e for c in cuts if 0 < (e := min(c, len(text))) and not word_inside(text, e)})
    ids = inline_ids(sub, text, [(e, term) for e in ends])
    opening, closing = sub.tags[TERM_OPEN], sub.tags[TERM_CLOSE]
    assert ids.count(opening) == ids.count(closing) == len(ends)
    rest, inside = [], False
    for i in ids:
        inside = (inside or i == opening) and i != closing
        if not inside and i != closing:
            rest.append(i)
    assert sub.decode([rest])[0] == sub.decode([sub.encode([text])[0]])[0]


def word_inside(text: str, at: int) -> bool:
    return at < len(text) and text[at - 1].isalnum() and text[at].isalnum()


def test_a_glossary_writes_its_terms_into_the_source_of_a_model_trained_for_them(sub, tmp_path):
    terminology = Terminology(sub, 64, glossary_of([{"source": "bike", "target": "Velo"}]))
    assert terminology.inline
    lines = {0: "The dog sees a bike.", 1: "The dog sees a horse.", 2: "A <term> bike </term>"}
    sources = {i: sub.encode([line])[0] for i, line in lines.items()}
    before = dict(sources)
    terms = terminology.apply(lines, sources=sources)
    assert sorted(terms) == [0, 2]  # the constraints are there as ever: the guarantee
    assert sources[1] == before[1]  # a line without a term is read as it was
    assert sources[0] == inline_ids(sub, lines[0], [(len("The dog sees a bike"), "Velo")])
    # the typed symbols stay text; only the glossary's term is inline, after the typed "bike"
    assert sources[2].count(sub.tags[TERM_OPEN]) == 1
    plain = train_sentencepiece(
        [s for pair in corpus(300) for s in pair] + ["Velo"],
        tmp_path / "plain",
        90,
        hard_vocab_limit=False,
        character_coverage=1.0,
    )
    untrained = Terminology(plain, 64, glossary_of([{"source": "bike", "target": "Velo"}]))
    sources = {0: plain.encode([lines[0]])[0]}
    was = list(sources[0])
    untrained.apply({0: lines[0]}, sources=sources)
    assert not untrained.inline and sources[0] == was  # a model without <term> is told nothing new


def test_the_annotator_counts_what_it_did_and_keeps_a_source_that_would_grow_too_long(sub):
    lex = lexicon(corpus(2000))
    augment = AugmentConfig(inline_terms=1.0)
    pairs = corpus(50, seed=3)
    every = Annotator(sub, lex, augment)
    done = [every(s, t) for s, t in pairs]
    assert all(d is not None for d in done) and every.stats()["pairs"] == 50
    assert every.stats()["terms"] >= 50 and every.stats()["lexicon"] == len(lex)
    short = Annotator(sub, lex, augment, limit=min(len(d[0]) for d in done) - 1)
    assert [short(s, t) for s, t in pairs].count(None) >= 1
    assert lexicon_words("The Bike's bike") == {"bike"}
