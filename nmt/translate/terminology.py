"""Glossaries and avoid-lists: which terms a line's translation must contain, and which it must not.

A glossary is a list of entries `source term -> target term` (a TSV file for `nmt translate --glossary`,
a JSON list for the server); a target equal to its source means "do not translate": copy it. An avoid
list is target phrases never produced (`--avoid`). The search that obeys them is
nmt.translate.constraints; this module turns text into its constraints:

- Matching is on whole source words, case-insensitive, longest entry first, without overlaps: "New York
  City" wins over "New York" where both match, and "cat" never matches inside "category". Terms and text
  are read alike, as words (runs of \\w) and single other characters, each normalised once (NFC, then
  casefold), and matched through a trie of the entries' words: linear in the line, whatever the number of
  entries (a term holds at most MAX_TERM_WORDS of them). A line holds at most MAX_TERMS matches; more are
  refused in one line (each is a constraint the search must place, and the search slows with them).
- A matched entry's target becomes a Constraint placed as often as it matched, written any of several
  ways: its SentencePiece segmentation (with the word-start marker, as a word after a space), the same
  without the marker (a word after a hyphen or a quote), and, where the match is the line's first word,
  each of those capitalised (the target may begin the sentence).
- An avoided phrase is banned in all those ways.

Errors name the file and line, or the request's entry: a line without exactly one tab, an empty term, two
entries for one source with different targets, a target that contains an avoided phrase, a target the
model's vocabulary cannot write (it would come out as an unknown token) or that it writes as nothing, and
a line whose terms cannot fit the model's output positions.
"""

from __future__ import annotations

import gc
import re
import unicodedata
from collections.abc import Callable
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import torch

from nmt.config import Engine
from nmt.data.terms import inline_ids
from nmt.errors import NmtError
from nmt.languages import TERM_CLOSE, TERM_OPEN, tag_language
from nmt.subword import WORD_START, Subword
from nmt.tokens import UNK
from nmt.translate.align import word_starts
from nmt.translate.constraints import Constraint, Terms
from nmt.translate.frontend import CONTROL_TO_SPACE


class Entry(NamedTuple):  # a tuple: a frozen dataclass's __init__ took a tenth of reading 100,000 entries
    source: str
    target: str
    where: str  # for errors: "glossary.tsv line 3", 'glossary[2]'


MAX_TERM_WORDS = 50  # words (and other characters) of one source term: the depth of the trie
MAX_TERMS = 24  # glossary matches in one line: each a constraint for the search
TOKEN = re.compile(r"(\w+)|\S")
PLAIN = re.compile(r"\w+(?: \w+)*")  # a term of whole words apart: its key is its casefolded words


def words(text: str) -> list[tuple[str, bool, int, int, bool]]:
    """(normalised word, whether it follows the previous one without a space, start, end, whether it is a
    word) of each word (a run of \\w) or other character of `text`, which must already be NFC."""
    out, last = [], -1
    for m in TOKEN.finditer(text):
        out.append((m.group().casefold(), m.start() == last, m.start(), m.end(), m.group(1) is not None))
        last = m.end()
    return out


def term_key(source: str) -> tuple[str, ...]:
    """A source term's words, each after a space ("+w") or glued to the last ("=w"; the first has none)."""
    return tuple(
        ("=" if glued else "+") + w if k else w
        for k, (w, glued, _, _, _) in enumerate(words(unicodedata.normalize("NFC", source)))
    )


@contextmanager
def uncollected():
    """The cyclic garbage collector held off meanwhile: reading a large glossary allocates hundreds of
    thousands of entries, keys and trie nodes, none in a cycle, and each collection they set off walks all
    those made so far (half the time of reading 100,000 entries). It runs again after, as before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def term_keys(sources: list[str]) -> list[tuple[str, ...]]:
    """term_key of each source, normalised together: one NFC and one casefold over all of them, and the
    key of a plain term (words apart, as most are) split out of that, so that reading a large glossary
    does not tokenise each term in Python. A line break stops every composition, reordering and case
    mapping, so the joined text normalises as its parts do; the other terms go through term_key."""
    if not sources:
        return []
    joined = unicodedata.normalize("NFC", "\n".join(sources))
    nfc = joined.split("\n")
    folded = joined.casefold().replace(" ", " +").split("\n")
    if len(nfc) != len(sources) or len(folded) != len(sources):  # a term holding a line break
        return [term_key(s) for s in sources]
    plain = PLAIN.fullmatch
    return [
        tuple(f.split(" ")) if plain(n) else term_key(s) for s, n, f in zip(sources, nfc, folded, strict=True)
    ]


class Glossary:
    """Entries matched against lines: whole words, case-insensitive, longest first, through a trie of their
    words. `base`: a glossary whose entries this one's override (a request's over the server's)."""

    def __init__(self, entries: list[Entry], base: Glossary | None = None):
        with uncollected():
            self.own, self.by_key, self.trie = self.indexed(entries)
        self.base = base

    @staticmethod
    def indexed(entries: list[Entry]) -> tuple[list[Entry], dict[tuple[str, ...], Entry], dict]:
        """The entries without repeats, by key, and their trie; an error names an entry that contradicts an
        earlier one or has too many words."""
        seen: dict[tuple[str, ...], Entry] = {}
        trie: dict = {}  # word -> node; a node's None key holds the entry ending there
        for e, key in zip(entries, term_keys([e.source for e in entries]), strict=True):
            if key in seen:
                first = seen[key]
                if first.target != e.target:
                    raise NmtError(
                        f"{e.where}: {e.source!r} -> {e.target!r} contradicts {first.where}: "
                        f"{first.source!r} -> {first.target!r}"
                    )
                continue
            if len(key) > MAX_TERM_WORDS:
                raise NmtError(f"{e.where}: the source term has {len(key)} words; at most {MAX_TERM_WORDS}")
            seen[key] = e
            node = trie
            for w in key:
                node = node.setdefault(w, {})
            node[None] = e
        return list(seen.values()), seen, trie

    @cached_property
    def entries(self) -> list[Entry]:
        if self.base is None:
            return self.own
        return self.own + [e for k, e in self.base.by_key.items() if k not in self.by_key]

    def __len__(self) -> int:
        return len(self.entries)

    def merged(self, extra: Glossary | None) -> Glossary:
        """This glossary with `extra`'s entries, which win where both have one source: `extra` over this
        one, without copying this one's entries."""
        if extra is None or not len(extra):
            return self
        if not len(self):
            return extra
        return Glossary(extra.own, base=self)

    def longest(self, found: list, at: int) -> tuple[int, Entry] | None:
        """(words, entry) of the longest entry whose words start at `found[at]`, if any."""
        node, best = self.trie.get(found[at][0]), None
        k = at
        while node is not None:
            if None in node:
                best = (k - at + 1, node[None])
            k += 1
            if k == len(found):
                break
            node = node.get(("=" if found[k][1] else "+") + found[k][0])
        return best

    def matches(self, line: str) -> list[tuple[Entry, int]]:
        """(entry, character offset in `line` after NFC) of each match, left to right, none overlapping;
        more than MAX_TERMS is an error."""
        return [(e, start) for e, start, _ in self.spans(line)]

    def spans(self, line: str) -> list[tuple[Entry, int, int]]:
        """(entry, start, end) of each match in `line` after NFC, as `matches`."""
        if not len(self):
            return []
        text = unicodedata.normalize("NFC", line)
        found = words(text)
        out, at = [], 0
        while at < len(found):
            best = self.longest(found, at)
            if self.base is not None:
                under = self.base.longest(found, at)
                if under is not None and (best is None or under[0] > best[0]):
                    best = under
            # a term that begins or ends with a non-word character matches only apart from a word
            if best is not None and self.apart(found, at, best[0]):
                n, e = best
                out.append((e, found[at][2], found[at + n - 1][3]))
                at += n
            else:
                at += 1
        if len(out) > MAX_TERMS:
            raise NmtError(
                f"a line holds {len(out)} glossary terms; at most {MAX_TERMS} a line "
                f"(the line starting {line[:40]!r})"
            )
        return out

    @staticmethod
    def apart(found: list, at: int, n: int) -> bool:
        """Whether found[at:at+n] stands apart: a term that begins (ends) with a non-word character is not
        glued to a word before (after) it, as words themselves never are (a word is a whole run of \\w)."""
        before = found[at - 1] if at else None
        after = found[at + n] if at + n < len(found) else None
        if before is not None and found[at][1] and not found[at][4] and before[4]:
            return False
        return not (after is not None and after[1] and after[4] and not found[at + n - 1][4])


SENTENCE_ENDS = frozenset(".!?…。！？")


def sentence_end(piece: str) -> bool:
    """Whether a subword is sentence-final punctuation alone ("." "▁?" "!!"), as a translation ends."""
    text = piece.lstrip(WORD_START)
    return bool(text) and set(text) <= SENTENCE_ENDS


def writable(entries: list[Entry], subword: Subword) -> None:
    """Every target written by the vocabulary as it is given: one with a character the vocabulary lacks
    would come out as an unknown token (⁇), one that encodes to nothing could not be placed at all."""
    targets = list(dict.fromkeys(e.target for e in entries))  # each once, in one call
    with uncollected():
        encoded = subword.encode_target(targets) if targets else []
    bad = {t: ids for t, ids in zip(targets, encoded, strict=True) if not ids or UNK in ids}
    for e in entries if bad else ():  # the first entry in order that is refused
        if (ids := bad.get(e.target)) is None:
            continue
        if not ids:
            raise NmtError(f"{e.where}: the target {e.target!r} is nothing the model can write")
        if UNK in ids:
            lacking = [c for c in dict.fromkeys(e.target) if UNK in subword.encode_target([c])[0]]
            shown = ", ".join(repr(c) for c in lacking) or "a character"
            raise NmtError(
                f"{e.where}: the target {e.target!r} holds {shown}, which the model's vocabulary cannot write"
            )


def entry(source, target, where: str) -> Entry:
    """One entry, checked: two non-empty terms without tabs or line breaks."""
    for name, value in (("source", source), ("target", target)):
        if not isinstance(value, str):
            raise NmtError(f"{where}: the {name} term must be a string, got {type(value).__name__}")
        if not value.strip():
            raise NmtError(f"{where}: the {name} term is empty")
        if "\t" in value or "\n" in value or "\r" in value:
            raise NmtError(f"{where}: the {name} term holds a tab or a line break")
    return Entry(" ".join(source.split()), target.strip(), where)


def read_glossary(path: Path) -> Glossary:
    """A TSV file: `source term<TAB>target term` a line; blank lines and lines starting with # skipped."""
    with uncollected():
        return Glossary(glossary_entries(path))


def glossary_entries(path: Path) -> list[Entry]:
    """The entries of a glossary file, each checked (see read_glossary)."""
    entries, name = [], str(path)
    for number, line in enumerate(read_text(path, "glossary").split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        where = f"{name} line {number}"
        if len(fields) != 2:
            raise NmtError(f"{where}: expected `source term<TAB>target term`, found {len(fields) - 1} tabs")
        # entry() inline where it would accept the line (two terms, neither blank, no carriage return), as
        # it would write them: its checks took a fifth of reading 100,000 entries; it reports the others
        source, target = " ".join(fields[0].split()), fields[1].strip()
        if source and target and "\r" not in line:
            entries.append(Entry(source, target, where))
        else:
            entries.append(entry(*fields, where))
    return entries


def glossary_of(items, where: str = "glossary") -> Glossary:
    """A request's glossary: a list of {"source": ..., "target": ...}; errors name the entry."""
    if not isinstance(items, list):
        raise NmtError(f'"{where}" must be a list of {{"source": ..., "target": ...}}')
    entries = []
    for i, item in enumerate(items):
        name = f'"{where}"[{i}]'
        if not isinstance(item, dict) or set(item) != {"source", "target"}:
            raise NmtError(f'{name}: expected {{"source": ..., "target": ...}}')
        entries.append(entry(item["source"], item["target"], name))
    return Glossary(entries)


def read_avoid(path: Path) -> list[str]:
    """Target phrases never produced, one a line; blank lines skipped."""
    return [" ".join(line.split()) for line in read_text(path, "avoid list").split("\n") if line.strip()]


def read_text(path: Path, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise NmtError(f"{path}: cannot read the {what}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = Path(path).read_bytes()[: e.start].count(b"\n") + 1
        raise NmtError(f"{path} line {line}: not UTF-8") from None


class Terminology:
    """A glossary and an avoid list, encoded for one subword model: the constraints of each line."""

    def __init__(
        self, subword: Subword, max_positions: int, glossary: Glossary | None = None, avoid: list[str] = ()
    ):
        self.subword, self.glossary = subword, glossary or Glossary([])
        self.max_output = max_positions - 1  # the tokens a translation can have at most
        pieces = subword.pieces()
        self.piece_ids = {p: i for i, p in enumerate(pieces)}
        self.pieces = pieces
        self.cache: dict[tuple[str, bool], tuple[tuple[int, ...], ...]] = {}
        self.avoid_phrases = list(avoid)
        self.avoid = sorted({v for phrase in avoid for v in self.variants(phrase, True)})
        # pieces that continue a word (a letter or digit, no word-start marker): none may follow a term
        self.glue = torch.tensor([p[:1].isalnum() for p in pieces], dtype=torch.bool)
        # pieces that end a sentence: the last of them in a translation waits for its terms
        self.ends = torch.tensor([sentence_end(p) for p in pieces], dtype=torch.bool)
        # pieces that end in a letter or digit: a term's form without the word-start marker never follows one
        self.word_ends = torch.tensor([p[-1:].isalnum() for p in pieces], dtype=torch.bool)
        # a model trained with inline terms (nmt.data.terms) is told each line's terms in its source too
        tags = subword.tags
        self.inline = TERM_OPEN in tags and TERM_CLOSE in tags
        self.target_tags = {i for tag, i in tags.items() if tag_language(tag) is not None}
        self.check(self.glossary)

    def check(self, glossary: Glossary | None) -> None:
        """No entry may require what the avoid list forbids, or what the vocabulary cannot write: an error
        names the first that does."""
        for e in glossary.entries if glossary is not None and self.avoid_phrases else []:
            target = f" {' '.join(e.target.split()).casefold()} "
            for phrase in self.avoid_phrases:
                if f" {phrase.casefold()} " in target:
                    raise NmtError(
                        f"{e.where}: the target {e.target!r} contains the avoided phrase {phrase!r}"
                    )
        if glossary is not None:
            writable(glossary.own, self.subword)

    def variants(self, target: str, capitalise: bool) -> tuple[tuple[int, ...], ...]:
        """The ways a term is written in subwords: as a word after a space, the same without the
        word-start marker, and (`capitalise`) each capitalised."""
        key = (target, capitalise)
        if key not in self.cache:
            forms = [target]
            if capitalise and target[:1] != target[:1].upper():
                forms.append(target[:1].upper() + target[1:])
            out: list[tuple[int, ...]] = []
            for n, ids in enumerate(self.subword.encode_target(forms)):
                if n and UNK in ids:  # a capital the vocabulary lacks: the form would force an unknown token
                    continue
                for v in (ids, self.without_word_start(ids)):
                    if v and tuple(v) not in out:
                        out.append(tuple(v))
            self.cache[key] = tuple(out)
        return self.cache[key]

    def without_word_start(self, ids: list[int]) -> list[int] | None:
        """The segmentation with the first piece's word-start marker dropped, where the vocabulary has it."""
        if not ids:
            return None
        first = self.pieces[ids[0]]
        if first == WORD_START:
            return ids[1:]
        if first.startswith(WORD_START) and (bare := self.piece_ids.get(first[1:])) is not None:
            return [bare, *ids[1:]]
        return None

    def constraints(
        self,
        line: str,
        extra: Glossary | None = None,
        found: list[tuple[Entry, int, int]] | None = None,
        locate: Callable[[int, int], tuple[int, ...]] | None = None,
    ) -> list[Constraint]:
        """The constraints of one line: each matched entry (`found`, where matched already), as often as it
        matched; `locate` (source_locator) gives each the source positions of its matches."""
        if found is None:
            found = self.glossary.merged(extra).spans(line)
        start = len(line) - len(line.lstrip(" \"'([¿¡"))
        # one constraint per target, placed as often as it matched: two constraints sharing a way of writing
        # would both be placed by one occurrence
        counts: dict[str, tuple[int, bool, Entry, tuple[int, ...]]] = {}
        for e, offset, end in found:
            n, first, _, at = counts.get(e.target, (0, False, e, ()))
            at += locate(offset, end) if locate is not None else ()
            counts[e.target] = (n + 1, first or offset == start, e, at)
        return self.checked(
            [(Constraint(self.variants(t, first), n, at), e) for t, (n, first, e, at) in counts.items()]
        )

    def source_locator(
        self, line: str, masked: str, ids: list[int]
    ) -> Callable[[int, int], tuple[int, ...]] | None:
        """A function from a character span of `line` after NFC (as Glossary.spans gives it) to the
        positions in `ids` (the line as encoded) of the subwords of the words it covers; None where the
        subwords do not follow the line's whitespace words, or were cut (no position to trust). `masked`:
        the line with its kept spans blanked, which the spans were found in."""
        text = unicodedata.normalize("NFC", line.translate(CONTROL_TO_SPACE))
        if len(text) != len(unicodedata.normalize("NFC", masked)):
            return None
        lead = 1 if ids and ids[0] in self.target_tags else 0
        spans = [m.span() for m in re.finditer(r"\S+", text)]
        word_of = word_starts([self.pieces[i] for i in ids[lead:]])
        if not word_of or word_of[-1] + 1 != len(spans):
            return None

        def locate(start: int, end: int) -> tuple[int, ...]:
            covered = {k for k, (a, b) in enumerate(spans) if a < end and start < b}
            return tuple(lead + p for p, w in enumerate(word_of) if w in covered)

        return locate

    def copies(self, spans: list[str], where: str = "kept span") -> list[Constraint]:
        """Copy constraints: each span (text kept as it is, such as HTML translate="no") must appear
        verbatim in the translation, as often as it is given."""
        counts: dict[str, int] = {}
        for s in spans:
            if s.strip():
                counts[s] = counts.get(s, 0) + 1
        pairs = [
            (Constraint(self.variants(s, False), n), entry(s, s, f"{where} {s!r}")) for s, n in counts.items()
        ]
        return self.checked(pairs)

    def checked(self, pairs: list[tuple[Constraint, Entry]]) -> list[Constraint]:
        """The constraints, unless their terms cannot all fit the model's output: an error names the entry
        that does not fit."""
        used = 0
        for c, e in pairs:
            used += c.count * c.shortest
            if used > self.max_output:
                raise NmtError(
                    f"{e.where}: the term {e.target!r} does not fit: the line's terms take {used} subwords, "
                    f"the model's output at most {self.max_output}"
                )
        return [c for c, _ in pairs]

    def batch(self, sentences: list[list[Constraint]]) -> Terms:
        """What a batch's search obeys (TorchEngine.search's `constraints`): its sentences' constraints, the
        avoid list and the glue."""
        avoid = [list(p) for p in self.avoid]
        return Terms(sentences, avoid, self.glue, self.ends, self.word_ends, frozenset(self.target_tags))

    def apply(
        self,
        lines: dict[int, str],
        extra: Glossary | None = None,
        kept: dict[int, list[str]] | None = None,
        sources: dict[int, list[int]] | None = None,
    ) -> dict[int, list[Constraint]]:
        """The constraints of the lines that have any (every line where there is an avoid list: it applies to
        all of them), by line index. `extra`: a request's own glossary; `kept`: spans each line must copy.

        `sources`: the lines' subword ids as encoded. Where the model was trained with inline terms
        (nmt.data.terms: its vocabulary has <term>), each line with glossary matches has them rewritten
        with every term written after its source word, so the model places the term there; the
        constraints still guarantee it."""
        self.check(extra)
        glossary = self.glossary.merged(extra)
        out = {}
        for i, line in lines.items():
            spans = kept.get(i) if kept else None
            masked = line
            for span in spans or ():  # a kept span is copied, not matched against the glossary
                masked = masked.replace(span, " " * len(span))
            matched = glossary.spans(masked)
            ids = sources.get(i) if sources is not None and not self.inline else None
            locate = self.source_locator(line, masked, ids) if matched and ids else None
            found = self.constraints(masked, found=matched, locate=locate)
            if matched and self.inline and sources is not None and i in sources:
                sources[i] = self.inline_source(line, masked, sources[i], matched)
            if spans:
                found = found + self.copies(spans)
            if found or self.avoid:
                out[i] = found
        return out

    def inline_source(
        self, line: str, masked: str, ids: list[int], matched: list[tuple[Entry, int, int]]
    ) -> list[int]:
        """The line's ids (`ids`, as encoded) with its matched terms inline (nmt.data.terms.inline_ids),
        after the line's target tag where it has one, cut to the model's source length as `ids` were.
        `matched`: the spans found in `masked`, the line with its kept spans blanked."""
        text = unicodedata.normalize("NFC", line.translate(CONTROL_TO_SPACE))
        if len(text) != len(unicodedata.normalize("NFC", masked)):  # a kept span NFC shortened: no offsets
            return ids
        head = ids[:1] if ids and ids[0] in self.target_tags else []
        return (head + inline_ids(self.subword, text, [(end, e.target) for e, _, end in matched]))[
            : self.max_output
        ]

    @property
    def active(self) -> bool:
        """Whether every line must be looked at: a glossary or an avoid list is given."""
        return bool(len(self.glossary) or self.avoid)


def refusal(engine: Engine, decode) -> str | None:
    """Why an engine (its name) cannot obey glossaries and avoid lists (they need the PyTorch engine's beam
    search) with these decode settings; None where it can."""
    if engine is not Engine.TORCH:
        return "--engine ctranslate2 takes no glossary or avoid list; use --engine torch"
    if decode.sampling:
        return "a glossary or avoid list works with beam search, not with --sampling"
    return None


def check_engine(engine, decode) -> None:
    """One line saying why the engine cannot obey a glossary or avoid list, where it cannot."""
    if (why := refusal(getattr(engine, "name", None), decode)) is not None:
        raise NmtError(why)


def server_terminology(translator) -> Terminology | None:
    """What a server checks its requests against: the translator's own terminology (nmt serve
    --glossary, or an empty one to which requests add theirs); None on an engine that takes none."""
    return translator.terminology


def build_terminology(
    engine: Engine,
    decode,
    subword: Subword,
    max_positions: int,
    glossary: Path | None = None,
    avoid: Path | None = None,
) -> Terminology | None:
    """A front end's terminology: the glossary and avoid-list files to obey, the engine's capability checked
    once (an error where files are given to one that cannot obey them). Without files, an empty one where
    the engine could obey one (a server's requests add theirs), else None."""
    if (why := refusal(engine, decode)) is not None:
        if glossary is not None or avoid is not None:
            raise NmtError(why)
        return None
    return Terminology(
        subword,
        max_positions,
        read_glossary(glossary) if glossary is not None else None,
        read_avoid(avoid) if avoid is not None else [],
    )
