"""The line front end: the contract of `nmt translate` (and `nmt serve`) for any line, over either engine.

Every line gets exactly one translation (n with nbest), in order. A line is cleaned (control characters
become spaces), cut before SentencePiece sees it where it is too long to be worth encoding, encoded,
truncated to the model's positions with a warning, batched with lines of its length under a budget of
decoder work (`batch_cost`), searched by the engine, detokenized, and kept on one line: any
line-breaking character in a translation becomes a space. Blank lines give empty lines without reaching
the model. Reading and writing files is nmt.translate.stream's; warnings go to the console, if any.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from rich.console import Console

from nmt.config import DecodeConfig
from nmt.errors import NmtError
from nmt.languages import short
from nmt.translate.casing import Typed, as_typed, sentence_case, typed
from nmt.translate.constraints import Constraint, beam_needed
from nmt.translate.torch_engine import TorchEngine, padded_width

# Every character str.splitlines() breaks on: none may survive inside one output line.
LINE_BREAKS = str.maketrans(dict.fromkeys("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " "))


# SentencePiece's default max_sentencepiece_length, which nmt.subword keeps: the most characters
# one subword covers.
MAX_PIECE_CHARS = 16
# C0 and C1 control characters but the tab: none is text; \n never reaches here, \r only at a line's end.
CONTROLS = "".join(map(chr, [*range(0x00, 0x09), *range(0x0A, 0x20), *range(0x7F, 0xA0)]))
CONTROL = re.compile(f"[{re.escape(CONTROLS)}]")
CONTROL_TO_SPACE = str.maketrans(dict.fromkeys(CONTROLS, " "))


def line_number(first_line: int | list[int], i: int) -> int:
    """The number warnings give lines[i]: first_line + i, or first_line[i] where each has its own."""
    return first_line[i] if isinstance(first_line, list) else first_line + i


def cut_line(line: str, max_chars: int) -> str:
    """The first `max_chars` characters, ending at a space where there is one in the last quarter, so the
    last word kept is whole and encodes as it would in the full line."""
    head = line[:max_chars]
    space = head.rfind(" ", max_chars * 3 // 4)
    return head[:space] if space > 0 else head


def one_line(text: str) -> str:
    return text.translate(LINE_BREAKS)


def rows_per_sentence(decode: DecodeConfig, nbest: int | None = None) -> int:
    """Decoder rows one sentence takes: its beam, or with sampling one per draw (`nbest`, by default the
    decode settings' own)."""
    return (decode.nbest if nbest is None else nbest) if decode.sampling else decode.beam


def batch_cost(sentences: int, longest: int, rows: int, decode: DecodeConfig, max_output: int) -> int:
    """What a batch costs against its budget (`--max-tokens`, `--max-batch-tokens`): sentences x rows
    per sentence x the positions each row may take, its longest source (EOS included) or the output its
    search may write (decode.max_len_a * |x| + max_len_b tokens, at most `max_output`, and the EOS),
    whichever is more. The output counts because each step of the search runs the decoder over every row
    until the longest is done: a one-word line may still take max_len_b steps, and a batch costed by its
    sources alone would hold a thousand of them."""
    output = min(math.floor(decode.max_len_a * (longest - 1) + decode.max_len_b), max_output) + 1
    return sentences * rows * max(longest, output)


def token_batches(
    lengths: list[int], max_tokens: int, rows_per_sentence: int, decode: DecodeConfig, max_output: int
) -> list[list[int]]:
    """Indices of `lengths` (subwords with the EOS) sorted by length, cut into batches costing at most
    `max_tokens` (`batch_cost`), and wherever the padded width (torch_engine.padded_width) changes, so
    that every sentence is padded as it would be alone and translates the same in any batch. A sentence
    alone over budget gets its own batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        # Ascending order: the sentence being added is the batch's longest.
        size = len(batches[-1]) + 1 if batches else 1
        same_width = batches and padded_width(lengths[batches[-1][0]]) == padded_width(lengths[i])
        if same_width and batch_cost(size, lengths[i], rows_per_sentence, decode, max_output) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclass
class Encoded:
    """Lines as the engine takes them: the subword ids of each line with any (truncated, non-empty),
    by line index; blank lines, and lines of characters the subword model drops, are absent."""

    sources: dict[int, list[int]] = field(default_factory=dict)
    truncated: set[int] = field(default_factory=set)  # indices of the lines that were cut


class LineTranslator:
    """The engine-independent front end: clean, cut, encode, batch by cost, search, detokenize, in order.

    The engine (torch_engine.TorchEngine, ctranslate2_engine.CT2Engine) takes subword ids and returns
    hypotheses; it knows nothing of lines or files: `engine.search(ids, prefixes, nbest, constraints) ->
    list[list[Hypothesis]]`, the n best of each source (ids without EOS), best first, under a batch's
    terms where given (nmt.translate.constraints.Terms); `engine.decode`, the decode settings (held there
    alone); `engine.max_positions`; and `engine.reseed(seed)`, sampling's stream from here on (one per
    chunk of nmt.translate.chunks).

    `terminology` (nmt.translate.terminology.Terminology): the glossary and avoid list every line obeys,
    and to which a server's requests add theirs; None where the engine cannot obey one. `workers`
    (nmt.translate.workers.WorkerPlan): who searches the batches while `workers.run(translator)` is open;
    None: this process.
    """

    def __init__(
        self, engine, subword, console: Console | None = None, terminology=None, workers=None, target=None
    ):
        self.engine, self.subword, self.console = engine, subword, console
        self.terminology, self.workers = terminology, workers
        self.recase_noted = False  # the first recased line is said once (typed)
        # The target tag (nmt.languages.target_tag) lines are translated with where a call names none:
        # a model of several targets needs one, from here, the call, or the line's own leading tag.
        self.target: str | None = target
        self.max_source = engine.max_positions - 1  # subwords before the EOS
        # A line is cut to this many characters before SentencePiece sees it (a 50 MB line would cost
        # minutes and gigabytes to encode whole): no subword is longer than MAX_PIECE_CHARS, so the cut
        # keeps every character the model's max_source subwords can hold.
        self.max_chars = self.max_source * MAX_PIECE_CHARS

    @property
    def decode(self) -> DecodeConfig:
        return self.engine.decode

    def target_names(self) -> list[str]:
        """The model's target languages by the codes people use (`fr`), for messages; [] for one."""
        return [short(lang) for lang in self.subword.targets]

    def translate(
        self, lines: list[str], prefixes: list[str] | None = None, target: str | None = None
    ) -> list[str]:
        """One translation per line, in order; blank lines give empty strings."""
        return [nbest[0][0] for nbest in self.translate_nbest(lines, prefixes=prefixes, target=target)]

    def translate_nbest(
        self,
        lines: list[str],
        first_line: int | list[int] = 1,
        prefixes: list[str] | None = None,
        on_batch: Callable[[int], None] | None = None,
        target: str | None = None,
    ) -> list[list[tuple[str, float]]]:
        """Up to decode.nbest (text, score) pairs per line, best first; a blank line gives [("", 0.0)].

        `first_line` numbers the lines in warnings (a stream passes the line number of lines[0]; a list
        gives each its own, as sentences split from lines get their line's).
        `prefixes`, one per line ("" for none), are target text each translation must begin with.
        `on_batch(n)` is told after each batch how many lines it translated (a progress display).
        `target`: the target tag of a model of several targets, over the translator's own.
        """
        cases = self.typed(lines, prefixes)
        if cases is not None:
            lines = [sentence_case(line) if how is not Typed.AS_WRITTEN else line for line, how in cases]
        sources = self.encode(lines, first_line, target).sources
        forced: dict[int, list[int]] = {}
        if prefixes is not None:
            keys = [i for i in sources if prefixes[i].strip()]
            for i, ids in zip(keys, self.subword.encode_target([prefixes[i] for i in keys]), strict=True):
                forced[i] = ids[: self.max_source]
        terms = None
        if self.terminology is not None and self.terminology.active:
            terms = self.terminology.apply({i: lines[i] for i in sources}, sources=sources)
        results = self.search_sources(len(lines), sources, forced, constraints=terms, on_batch=on_batch)
        return results if cases is None else self.cased_back(results, [how for _, how in cases])

    def typed(self, lines: list[str], prefixes: list[str] | None = None) -> list[tuple[str, Typed]] | None:
        """Each line with how it is cased (nmt.translate.casing), where decode.recase is on (None where
        it is off); a line with a prefix of its own (the prefix is cased as the user wants) as written.
        The first recased line is said once."""
        if not self.decode.recase:
            return None
        cases = [
            (line, Typed.AS_WRITTEN if prefixes is not None and prefixes[i].strip() else typed(line))
            for i, line in enumerate(lines)
        ]
        first = next((how for _, how in cases if how is not Typed.AS_WRITTEN), None)
        if first is not None and not self.recase_noted and self.console is not None:
            self.recase_noted = True
            self.console.print(
                f"recase: lines typed in {first.value} are translated as a sentence is written"
                + (", then upper-cased" if first is Typed.ALL_CAPS else "")
                + " (decode.recase; --no-recase translates them as typed)",
                highlight=False,
                soft_wrap=True,
            )
        return cases

    @staticmethod
    def cased_back(results: list[list[tuple[str, float]]], cases: list[Typed]) -> list:
        """Each line's n-best cased as its source was typed (nmt.translate.casing.as_typed)."""
        return [
            [(as_typed(text, how), score) for text, score in nbest]
            for nbest, how in zip(results, cases, strict=True)
        ]

    def encode(self, lines: list[str], first_line: int | list[int] = 1, target: str | None = None) -> Encoded:
        """The lines cleaned, cut, encoded and truncated, each cut line with a warning (`first_line`
        numbers them); each after its target tag where the model has several targets (`target`, the
        translator's own, or the line's leading tag: nmt.subword.Subword.encode)."""
        cut = {i for i, line in enumerate(lines) if len(line) > self.max_chars}
        lines = [cut_line(line, self.max_chars) if i in cut else line for i, line in enumerate(lines)]
        lines = self.clean(lines, first_line)
        todo = [i for i, line in enumerate(lines) if line.strip()]
        encoded = Encoded()
        tag = target or self.target
        texts = [lines[i] for i in todo]
        all_ids = self.subword.encode(texts, tag=tag) if tag else self.subword.encode(texts)
        if self.subword.targets and tag not in self.subword.tags:
            tags = set(self.subword.tags.values())
            untagged = next(
                (i for i, ids in zip(todo, all_ids, strict=True) if ids[:1] and ids[0] not in tags), None
            )
            if untagged is not None:
                raise NmtError(
                    f"line {line_number(first_line, untagged)}: this model translates into "
                    f"{', '.join(self.target_names())}: choose one (--target, or a leading >>xxx<< tag)"
                )
        for i, ids in zip(todo, all_ids, strict=True):
            if i in cut or len(ids) > self.max_source:
                size = f"over {self.max_chars:,} characters" if i in cut else f"{len(ids)} subwords"
                limit = f"the model's {self.max_source} subwords"
                self.warn(f"line {line_number(first_line, i)}: {size}, truncated to {limit}")
                encoded.truncated.add(i)
                ids = ids[: self.max_source]
            if ids:  # a line of characters the subword model drops entirely translates to nothing
                encoded.sources[i] = ids
        return encoded

    def search_sources(
        self,
        count: int,
        sources: dict[int, list[int]],
        forced: dict[int, list[int]] | None = None,
        nbest: int | None = None,
        constraints: dict | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> list[list[tuple[str, float]]]:
        """The n-best of `count` lines whose subword ids (as `encode` gives them) are `sources[i]`.

        Lines missing from `sources` (blank ones) give [("", 0.0)]. `nbest`: hypotheses per line, by
        default decode.nbest. The server encodes in its request handlers and calls this from its model
        worker. `constraints`: the terms of the lines that have any (Terminology.apply); those lines are
        batched among themselves and searched under them, the others as without.
        """
        results: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in range(count)]
        constraints = constraints or {}
        free = [i for i in sources if i not in constraints]
        bound = [i for i in sources if i in constraints]
        # Both kinds in one call: the workers take the lines with terms as they take the others, so a
        # glossary costs its searches, not the idle cores of a search done here meanwhile.
        batches = self.batches(free, sources, nbest) + self.batches(bound, sources, nbest)
        work = [
            (
                [sources[i] for i in lines],
                [forced.get(i, []) for i in lines] if forced else None,
                [constraints[i] for i in lines] if lines[0] in constraints else None,
            )
            for lines in batches
        ]
        if bound:
            self.note_beam(max(beam_needed(terms) for _, _, terms in work if terms is not None))
        for b, hyps in self.search_many(work, nbest):
            for i, line in zip(batches[b], hyps, strict=True):
                results[i] = line
            if on_batch is not None:
                on_batch(len(batches[b]))
        return results

    def batches(self, keys: list[int], sources: dict[int, list[int]], nbest: int | None) -> list[list[int]]:
        """The lines `keys` in batches by cost (token_batches), as lists of their indices."""
        d = self.decode
        lengths = [len(sources[i]) + 1 for i in keys]
        rows = rows_per_sentence(d, nbest)
        return [
            [keys[j] for j in batch]
            for batch in token_batches(lengths, d.batch_tokens, rows, d, self.max_source)
        ]

    def search_many(self, work: list[tuple], nbest: int | None = None) -> Iterator[tuple[int, list]]:
        """(index, n-best of each line) of each batch of `work` (its sources' ids, forced prefixes and
        constraints: search_batch's arguments), in any order: one after another here, or by the workers
        (nmt.translate.workers) while they run (`nmt translate` reading a file with --workers)."""
        if self.workers is not None and self.workers.running is not None:
            return self.workers.running.search_many(work, nbest)
        return ((b, self.search_batch(*batch, nbest)) for b, batch in enumerate(work))

    def search_batch(
        self,
        ids: list[list[int]],
        wanted: list[list[int]] | None,
        constraints: list[list[Constraint]] | None = None,
        nbest: int | None = None,
    ) -> list[list[tuple[str, float]]]:
        """One batch searched by the engine: the n-best (text, score) of each source, best first, each
        under its `constraints` (the terms Terminology.apply found in its line) where given."""
        if constraints is None:  # the CTranslate2 engine takes no terms (nmt.translate.terminology.refusal)
            return self.texts(self.engine.search(ids, wanted, nbest))
        return self.texts(self.engine.search(ids, wanted, nbest, self.terminology.batch(constraints)))

    def texts(self, found: list) -> list[list[tuple[str, float]]]:
        """Each source's hypotheses (nmt.translate.search.Hypothesis) as (text on one line, score)."""
        out = []
        for hyps in found:
            texts = self.subword.decode([h.tokens for h in hyps])
            out.append([(one_line(text), h.score) for text, h in zip(texts, hyps, strict=True)])
        return out

    def clean(self, lines: list[str], first_line: int | list[int]) -> list[str]:
        """Control characters (NUL, ESC, BEL, ...) become spaces, with one warning naming the lines, so a
        line of nothing else is blank, as a blank line, rather than a sentence of unknown tokens."""
        bad = [i for i, line in enumerate(lines) if CONTROL.search(line)]
        if not bad:
            return lines
        lines = list(lines)
        for i in bad:
            lines[i] = lines[i].translate(CONTROL_TO_SPACE)
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        shown = ", ".join(str(n) for n in dict.fromkeys(line_number(first_line, i) for i in bad[:10])) + more
        self.warn(f"control characters replaced by spaces on line {shown}")
        return lines

    def note_beam(self, width: int) -> None:
        """Said once: lines with terms search at a wider beam than asked (TorchEngine.constrained)."""
        if width > self.decode.beam and not getattr(self, "beam_noted", False) and self.console is not None:
            self.beam_noted = True
            self.console.print(
                f"glossary: a line with terms searches at a beam of its terms + 1 at least "
                f"({width} here), not {self.decode.beam}: dynamic beam allocation needs a row for each",
                highlight=False,
                soft_wrap=True,
            )

    def warn(self, message: str) -> None:
        if self.console is not None:
            self.console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


class Translator(LineTranslator):
    """Lines through the PyTorch engine: a model (or an Ensemble) and its subwords."""

    def __init__(
        self,
        model,
        subword,
        decode: DecodeConfig,
        device: torch.device,
        console: Console | None = None,
        shortlist=None,
        terminology=None,
        workers=None,
        target=None,
    ):
        engine = TorchEngine(model, decode, device, shortlist)
        super().__init__(engine, subword, console, terminology, workers, target)
        self.model = model
