"""Reading aligned text, and the filter of Moses' clean-corpus-n.perl on training pairs.

Words are whitespace-separated tokens, as clean-corpus-n counts them (fairseq runs it with
`-ratio 1.5 ... 1 250` before BPE). A pair is dropped, for the first reason that applies, when a side is
empty, shorter than data.min_words, longer than data.max_words, or when one side has more than
data.max_ratio times the words of the other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path

from nmt.config import DataConfig
from nmt.errors import DataError

REASONS = ("empty", "too_short", "too_long", "ratio")

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
    pairs: Iterator[tuple[str, str]], data: DataConfig, dropped: dict[str, int]
) -> Iterator[tuple[str, str]]:
    """The kept pairs, whitespace collapsed; counts each dropped pair under its reason in `dropped`."""
    for s, t in pairs:
        sw, tw = s.split(), t.split()
        reason = drop_reason(len(sw), len(tw), data)
        if reason is None:
            yield " ".join(sw), " ".join(tw)
        else:
            dropped[reason] = dropped.get(reason, 0) + 1
