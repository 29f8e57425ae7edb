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

Duplicates are found by 8-byte hashes of the pairs kept so far, in one pass: memory grows by 16 bytes a
kept pair (two keys in sorted int64 runs: 70 MB for WMT14 EN-DE's 4.5M, 0.55 GB for EN-FR's 36M; Python
sets of ints took 160 bytes a pair), not with the text. On 200k
newstest-like synthetic pairs the duplicate and copy checks cost 7-9 us of CPU a pair (AMD EPYC, 2 cores
shared with other jobs): 30-40 s at WMT14's size.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Iterator
from itertools import islice, zip_longest
from pathlib import Path

import torch

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
    the language check; `direction`, its (source, target) languages where not the recipe's. Pairs are
    taken BLOCK at a time, so that the keys of a block are looked up among the older ones in one call
    (Seen.stored); each pair is still judged in order, against every pair kept before it.
    """
    if seen is None and data.dedup:
        seen = Seen()
    src_lang, tgt_lang = direction or (data.src_lang, data.tgt_lang)
    identify = LanguageCheck(src_lang, tgt_lang, data.langid_threshold) if langid else None
    pairs = iter(pairs)
    while block := list(islice(pairs, BLOCK)):
        staged = []  # (source, target, reason so far, dedup keys or None)
        for s, t in block:
            sw, tw = s.split(), t.split()
            reason = drop_reason(len(sw), len(tw), data)
            s, t = " ".join(sw), " ".join(tw)
            if reason is None and data.drop_copies and s == t:
                reason = "copy"
            keys = Seen.keys(s, t) if reason is None and data.dedup else None
            staged.append((s, t, reason, keys))
        older = iter(seen.stored([k for *_, k in staged if k is not None])) if data.dedup else None
        for s, t, reason, keys in staged:
            if keys is not None:
                reason = seen.verdict(keys, next(older))  # before the language check, 50 times dearer
            if reason is None and identify is not None and not identify.both(s, t):
                reason = "wrong_language"
            if reason is None:
                if keys is not None:
                    seen.add(keys)
                yield s, t
            else:
                dropped[reason] = dropped.get(reason, 0) + 1
        if seen is not None:
            seen.settle()


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
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


BLOCK = 4096  # pairs clean_pairs judges between two lookups of their keys among the older ones


class _Keys:
    """A set of 8-byte keys that costs 8 bytes a key: the latest in a Python set (about 100 bytes a key,
    at most FLUSH of them), the older in sorted int64 runs, merged while the newest is at least half the
    one before it, so there are about log2(keys / FLUSH) of them."""

    FLUSH = 1 << 18

    def __init__(self):
        self.recent: set[int] = set()
        self.runs: list[torch.Tensor] = []

    def stored(self, keys: torch.Tensor) -> torch.Tensor:
        """(n,) int64 -> (n,) bool: which are in the runs (the recent set is asked per key)."""
        found = torch.zeros(keys.shape, dtype=torch.bool)
        for run in self.runs:
            at = torch.searchsorted(run, keys).clamp_(max=len(run) - 1)
            found |= run[at] == keys
        return found

    def settle(self) -> None:
        """The recent keys into a run once there are FLUSH of them (between blocks, never inside one:
        a block's lookups saw the runs as they were when it began)."""
        if len(self.recent) < self.FLUSH:
            return
        self.runs.append(torch.tensor(list(self.recent), dtype=torch.int64).sort().values)
        self.recent = set()
        while len(self.runs) > 1 and 2 * len(self.runs[-1]) >= len(self.runs[-2]):
            newer, older = self.runs.pop(), self.runs.pop()
            self.runs.append(torch.cat([older, newer]).sort().values)


class Seen:
    """8-byte hashes of the pairs kept so far: of the pair, and of the pair lower-cased without
    punctuation or spaces. A hash collision (one chance in 2^64 per two pairs; about one in two
    million over all of WMT14's 4.5M) would drop one good pair."""

    def __init__(self):
        self.exact, self.near = _Keys(), _Keys()

    @staticmethod
    def keys(src: str, tgt: str) -> tuple[int, int]:
        """The pair's keys: (exact, near)."""
        exact = _hash((src + "\t" + tgt).encode("utf-8", "surrogatepass"))
        return exact, _hash(_near_key(src) + b"\t" + _near_key(tgt))

    def stored(self, keys: list[tuple[int, int]]) -> list[tuple[bool, bool]]:
        """For each pair's keys, whether its exact and its near key are among the older ones (the runs), in
        one lookup for them all; `verdict` adds the recent ones."""
        if not keys or not self.exact.runs:
            return [(False, False)] * len(keys)
        exact, near = torch.tensor(keys, dtype=torch.int64).t().contiguous()  # each (n,)
        return list(zip(self.exact.stored(exact).tolist(), self.near.stored(near).tolist(), strict=True))

    def verdict(self, keys: tuple[int, int], stored: tuple[bool, bool]) -> str | None:
        """Why the pair of `keys` is a duplicate of one kept before, or None; `stored` from `stored`."""
        if stored[0] or keys[0] in self.exact.recent:
            return "duplicate"
        if stored[1] or keys[1] in self.near.recent:
            return "near_duplicate"
        return None

    def check(self, src: str, tgt: str) -> tuple[str | None, tuple[int, int]]:
        """(why the pair is a duplicate or None, its keys for `add`): one pair's `verdict`."""
        keys = self.keys(src, tgt)
        return self.verdict(keys, self.stored([keys])[0]), keys

    def add(self, keys: tuple[int, int]) -> None:
        self.exact.recent.add(keys[0])
        self.near.recent.add(keys[1])

    def settle(self) -> None:
        self.exact.settle()
        self.near.settle()


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
