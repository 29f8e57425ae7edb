"""Reading a glossary in bulk (nmt.translate.terminology) against reading it entry by entry: the same
entries, the same first error, the same keys and the same matches, for hostile text (combining marks, case
foldings that change length or leave \\w, tabs, carriage returns, line breaks, odd spaces)."""

from __future__ import annotations

import unicodedata

import pytest

pytest.importorskip("hypothesis", reason="property tests: pip install hypothesis (the dev extra)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nmt.errors import NmtError  # noqa: E402
from nmt.translate.terminology import (  # noqa: E402
    MAX_TERM_WORDS,
    Glossary,
    entry,
    read_glossary,
    term_key,
    term_keys,
    words,
)

# words that NFC or casefold make one (é composed and not, ß and SS, ﬁ and fi, Hangul jamo and their
# syllable), foldings that leave \w (İ), characters that are not \w, and separators that str.split, NFC
# and the file format each treat their own way
PIECES = [
    "a",
    "A",
    "ab",
    "caf\u00e9",
    "cafe\u0301",
    "CAF\u00c9",
    "stra\u00dfe",
    "STRASSE",
    "\u0130",
    "i\u0307",
]
PIECES += ["\u0131", "\u03a3", "\u03c2", "\ufb01", "fi", "\u1100\u1161", "\uac00", "+", "=", "-", ".", "#"]
PIECES += ["\u0301", "\u200b", "\r", "\t", "\n"]
SPACES = ["", " ", " ", "  ", "\u00a0", "\u2000"]
TEXT = st.lists(st.tuples(st.sampled_from(SPACES), st.sampled_from(PIECES)), max_size=5).map(
    lambda parts: "".join(space + piece for space, piece in parts)
)
# terms drawn again and again, in forms that are one key or not, so that entries repeat and contradict
SOURCE = st.one_of(
    st.sampled_from(["a", "A", "a b", "A  b", "caf\u00e9", "CAFE\u0301", "\u00df", "SS", "\u0130"]), TEXT
)
TARGET = st.one_of(st.sampled_from(["x", "y"]), TEXT)
MANY = settings(max_examples=200)  # no model: hundreds of examples take seconds


@MANY
@given(st.lists(TEXT, max_size=12))
def test_keys_in_bulk_are_each_terms_key(sources):
    assert term_keys(sources) == [term_key(s) for s in sources]


def one_by_one(text: str, name: str) -> list | str:
    """What reading the file entry by entry gives: its entries without repeats, or the first error (every
    line is read before any entry is compared with another)."""
    try:
        entries = []
        for number, line in enumerate(text.split("\n"), 1):
            line = line.removesuffix("\r")
            if not line.strip() or line.startswith("#"):
                continue
            fields = line.split("\t")
            where = f"{name} line {number}"
            if len(fields) != 2:
                raise NmtError(
                    f"{where}: expected `source term<TAB>target term`, found {len(fields) - 1} tabs"
                )
            entries.append(entry(*fields, where))
        seen: dict = {}
        for e in entries:
            key = term_key(e.source)
            if len(key) > MAX_TERM_WORDS:
                raise NmtError(f"{e.where}: the source term has {len(key)} words; at most {MAX_TERM_WORDS}")
            if key in seen and seen[key].target != e.target:
                first = seen[key]
                raise NmtError(
                    f"{e.where}: {e.source!r} -> {e.target!r} contradicts {first.where}: "
                    f"{first.source!r} -> {first.target!r}"
                )
            seen.setdefault(key, e)
        return [tuple(e) for e in seen.values()]
    except NmtError as error:
        return str(error)


LINES = st.lists(st.tuples(SOURCE, st.sampled_from(["\t", "\t", "", "\t\t"]), TARGET), max_size=10).map(
    lambda rows: "\n".join(s + tab + t for s, tab, t in rows)
)


@MANY
@given(LINES)
def test_a_file_reads_as_it_does_entry_by_entry(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("g") / "terms.tsv"
    path.write_bytes(text.encode())
    try:
        got = [tuple(e) for e in read_glossary(path).entries]
    except NmtError as error:
        got = str(error)
    assert got == one_by_one(path.read_text(encoding="utf-8"), str(path))  # as the file reads: \r is \n


def naive_matches(glossary: Glossary, line: str) -> list[tuple[str, int]]:
    """Glossary.matches without the trie: at each word, every length tried against the entries' keys."""
    found = words(unicodedata.normalize("NFC", line))
    keys = {term_key(e.source): e for e in glossary.entries}
    out, at = [], 0
    while at < len(found):
        best = None
        for n in range(1, len(found) - at + 1):
            span = found[at : at + n]
            key = tuple(w if k == 0 else ("=" if glued else "+") + w for k, (w, glued, *_) in enumerate(span))
            if key in keys:
                best = (n, keys[key])
        if best is not None and Glossary.apart(found, at, best[0]):
            out.append((best[1].target, found[at][2]))
            at += best[0]
        else:
            at += 1
    return out


@MANY
@given(st.lists(st.tuples(SOURCE, TARGET), max_size=8), st.lists(TEXT, min_size=1, max_size=6).map(" ".join))
def test_matches_are_those_of_each_entry_tried_at_each_word(pairs, line):
    entries = []
    for i, (s, t) in enumerate(pairs):
        try:
            entries.append(entry(s, t, f"test[{i}]"))
        except NmtError:
            continue  # a blank or broken term: refused when read, not matched
    try:
        glossary = Glossary(entries)
    except NmtError:
        return  # contradicting entries: refused alike (test_a_file_reads_as_it_does_entry_by_entry)
    try:
        got = [(e.target, offset) for e, offset in glossary.matches(line)]
    except NmtError:
        return  # more than MAX_TERMS matches
    assert got == naive_matches(glossary, line)
