"""Reading aligned text, and the cleaning of training pairs: Moses' clean-corpus-n.perl and beyond.

Words are whitespace-separated tokens, as clean-corpus-n counts them (fairseq runs it with
`-ratio 1.5 ... 1 250` before BPE). A pair is dropped, for the first reason that applies, when a side is
empty, shorter than data.min_words, longer than data.max_words, or when one side has more than
data.max_ratio times the words of the other. Then, as a web-crawled corpus needs:

    copy            the target is the source unchanged: an untranslated line (data.drop_copies)
    wrong_language  py3langid names a side, confidently, as another language than the pair's (the
                    corpus's `langid: true`, data.langid_threshold); a short line is never judged
    duplicate       the same pair was kept before, in this or an earlier corpus (data.dedup)
    near_duplicate  a pair kept before differs only in case, punctuation or spaces (data.dedup)

Duplicates are found by 8-byte hashes of the pairs kept so far, in one pass: memory grows by about 160
bytes a kept pair (two sets of ints; 0.65 GiB for WMT14's 4.5M), not with the text. On 200k
newstest-like synthetic pairs the duplicate and copy checks cost 7-9 us of CPU a pair (AMD EPYC, 2 cores
shared with other jobs): 30-40 s at WMT14's size.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path

from nmt.config import DataConfig
from nmt.errors import DataError

LENGTH_REASONS = ("empty", "too_short", "too_long", "ratio")
REASONS = (*LENGTH_REASONS, "copy", "wrong_language", "duplicate", "near_duplicate")
MIN_LETTERS = 12  # "Hello", "OK": too little text for the language identifier to be trusted

# str.splitlines() breaks on these too; a reader that does must not see one pair as two lines.
_LINE_BREAKS = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def open_text(path: Path, mode: str = "r"):
    # newline="\n": Common Crawl has stray carriage returns, which universal newlines would split on,
    # shifting one side against the other. Undecodable bytes must not abort an hour-long run.
    return open(path, mode, encoding="utf-8", errors="replace", newline="\n")


def one_line(text: str) -> str:
    """The line without its newline and with any other line-breaking character made a space."""
    return _LINE_BREAKS.sub(" ", text.rstrip("\n"))


def read_pairs(src: Path, tgt: Path) -> Iterator[tuple[str, str]]:
    """Aligned lines of two files (newlines removed); DataError if their line counts differ.

    The check happens when the shorter file ends, so a caller writing output must not commit it before
    the iteration has finished.
    """
    with open_text(src) as fs, open_text(tgt) as ft:
        n = 0
        for s, t in zip_longest(fs, ft):
            if s is None or t is None:
                n_src = n + (s is not None) + sum(1 for _ in fs)
                n_tgt = n + (t is not None) + sum(1 for _ in ft)
                raise DataError(
                    f"{src} has {n_src} lines but {tgt} has {n_tgt}: the two sides of a corpus must align"
                )
            n += 1
            yield one_line(s), one_line(t)


def drop_reason(src_words: int, tgt_words: int, data: DataConfig) -> str | None:
    """Why clean-corpus-n would drop a pair with these word counts, or None to keep it."""
    shorter, longer = min(src_words, tgt_words), max(src_words, tgt_words)
    if shorter == 0:
        return "empty"
    if shorter < data.min_words:
        return "too_short"
    if longer > data.max_words:
        return "too_long"
    if longer / shorter > data.max_ratio:
        return "ratio"
    return None


def clean_pairs(
    pairs: Iterator[tuple[str, str]],
    data: DataConfig,
    dropped: dict[str, int],
    seen: Seen | None = None,
    langid: bool = False,
    direction: tuple[str, str] | None = None,
) -> Iterator[tuple[str, str]]:
    """The kept pairs, whitespace collapsed; counts each dropped pair under its reason in `dropped`.

    `seen` holds the pairs kept before (pass one Seen to every corpus of a recipe, so a pair in two
    corpora is kept once); None with data.dedup gives this call its own. `langid`: the corpus asks for
    the language check; `direction`, its (source, target) languages where not the recipe's.
    """
    if seen is None and data.dedup:
        seen = Seen()
    src_lang, tgt_lang = direction or (data.src_lang, data.tgt_lang)
    identify = LanguageCheck(src_lang, tgt_lang, data.langid_threshold) if langid else None
    for s, t in pairs:
        sw, tw = s.split(), t.split()
        reason = drop_reason(len(sw), len(tw), data)
        s, t = " ".join(sw), " ".join(tw)
        keys = None
        if reason is None and data.drop_copies and s == t:
            reason = "copy"
        if reason is None and data.dedup:
            reason, keys = seen.check(s, t)  # before the language check, which is 50 times dearer
        if reason is None and identify is not None and not identify.both(s, t):
            reason = "wrong_language"
        if reason is None:
            if keys is not None:
                seen.add(keys)
            yield s, t
        else:
            dropped[reason] = dropped.get(reason, 0) + 1


_ASCII_UNWORDS = (string.punctuation + string.whitespace).encode()
# Punctuation, symbols' kin and spaces beyond ASCII (quotes „“«», dashes, no-break spaces, CJK
# punctuation): removed by a regex only from lines that have non-ASCII characters, 4 times dearer.
_OTHER_UNWORDS = re.compile(r"[^\w\x00-\x7f]+")


def _near_key(text: str) -> bytes:
    """The line lower-cased without punctuation or spaces: what two near-duplicates share."""
    text = text.casefold()
    if not text.isascii():
        text = _OTHER_UNWORDS.sub("", text)
    return text.encode("utf-8", "surrogatepass").translate(None, _ASCII_UNWORDS)


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Seen:
    """8-byte hashes of the pairs kept so far: of the pair, and of the pair lower-cased without
    punctuation or spaces. A hash collision (one chance in 2^64 per two pairs; about one in two
    million over all of WMT14's 4.5M) would drop one good pair."""

    def __init__(self):
        self.exact: set[int] = set()
        self.near: set[int] = set()

    def check(self, src: str, tgt: str) -> tuple[str | None, tuple[int, int]]:
        """(why the pair is a duplicate or None, its keys for `add`)."""
        exact = _hash((src + "\t" + tgt).encode("utf-8", "surrogatepass"))
        near = _hash(_near_key(src) + b"\t" + _near_key(tgt))
        if exact in self.exact:
            return "duplicate", (exact, near)
        if near in self.near:
            return "near_duplicate", (exact, near)
        return None, (exact, near)

    def add(self, keys: tuple[int, int]) -> None:
        self.exact.add(keys[0])
        self.near.add(keys[1])


class LanguageCheck:
    """py3langid over both sides of a pair (0.08 ms a line). It is in the `serve` extra, and only
    recipes that ask for the check need it, so it is imported here, when one does."""

    def __init__(self, src_lang: str, tgt_lang: str, threshold: float):
        try:
            import py3langid.langid as langid
        except ImportError:
            raise DataError(
                "a training corpus has langid: true, which needs py3langid: pip install 'nmt[serve]'"
            ) from None
        self.identifier = langid.LanguageIdentifier.from_model_file(langid.MODEL_FILE, norm_probs=True)
        self.langs, self.threshold = (src_lang, tgt_lang), threshold

    def is_other(self, text: str, lang: str) -> bool:
        """Whether `text` is confidently in another language than `lang`."""
        if sum(c.isalpha() for c in text) < MIN_LETTERS:
            return False
        found, probability = self.identifier.classify(text)
        return found != lang and probability >= self.threshold

    def both(self, src: str, tgt: str) -> bool:
        """Whether neither side is confidently in another language than its own."""
        return not (self.is_other(src, self.langs[0]) or self.is_other(tgt, self.langs[1]))
