"""The PyTorch engine: subword ids in, n-best hypotheses out, through nmt.translate.search; no files or lines.

It picks the search from the decode settings: greedy for beam 1 (the same result as beam 1, less work),
beam search otherwise, and drawing with a sampler when `decode.sampling` is on (`nbest` samples each).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from nmt.config import DecodeConfig, Engine
from nmt.model import evaluating
from nmt.tokens import EOS, PAD
from nmt.translate.align import cross_attention
from nmt.translate.constraints import (
    Constraint,
    Terms,
    beam_needed,
    constrained_beam_search,
    constraint_tokens,
    renumbered,
)
from nmt.translate.displace import own_words, with_bans, written
from nmt.translate.prepacked import keeps_bits_on
from nmt.translate.search import Hypothesis, Sampler, beam_search, greedy_search
from nmt.translate.threads import SearchThreads

# Sources are padded to a multiple of this many positions (padded_width).
PAD_MULTIPLE = 8


def padded_width(length: int, max_positions: int | None = None) -> int:
    """The width a source of `length` positions (EOS included) is padded to: its length rounded up to a
    multiple of PAD_MULTIPLE, at most `max_positions`; a function of its own length alone.

    Why: a sentence padded wider (a longer companion in its batch) gets its attention's softmax and
    products over more, masked, positions, whose vectorized reductions group its real terms differently,
    so its activations differ in the last bits from the same sentence alone. int8's per-row quantization
    (round(x / a)) turns a last-bit difference near a rounding boundary into a whole step, and a near-tie
    into another word; fp32 moves in the last bits. Padded to its own bucket, and batched only with
    sentences of the same bucket (frontend.token_batches), a sentence sees the same width alone and in any
    batch: its translation and score do not depend on its companions."""
    width = -(-length // PAD_MULTIPLE) * PAD_MULTIPLE
    return width if max_positions is None else max(length, min(width, max_positions))


def padded_sources(ids: list[list[int]], device: torch.device, max_positions: int | None = None) -> Tensor:
    """Source ids + EOS, right-padded to the padded_width of the longest: (B, S). One batch holds sources
    of one padded width (frontend.token_batches), so each is padded as it would be alone."""
    width = padded_width(max(map(len, ids)) + 1, max_positions)
    src = torch.full((len(ids), width), PAD, dtype=torch.long)
    for row, seq in enumerate(ids):
        src[row, : len(seq) + 1] = torch.tensor([*seq, EOS])
    return src.to(device, non_blocking=True)


def padded_prefixes(prefixes: list[list[int]] | None, device: torch.device) -> Tensor | None:
    """Forced first target tokens, PAD-filled: (B, P); None when no row has any."""
    if prefixes is None or not any(prefixes):
        return None
    out = torch.full((len(prefixes), max(map(len, prefixes))), PAD, dtype=torch.long)
    for row, seq in enumerate(prefixes):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out.to(device, non_blocking=True)


class TorchEngine:
    """A model (or an nmt.translate.ensemble.Ensemble): an nn.Module with search's decoder contract
    (nmt.translate.search.Decoder), searched on one device."""

    name = Engine.TORCH

    def __init__(self, model, decode: DecodeConfig, device: torch.device, shortlist=None):
        self.model, self.decode, self.device = model, decode, torch.device(device)
        self.shortlist = shortlist  # nmt.shortlist.Shortlist: each sentence decodes over its own set
        self.max_positions = model.max_positions
        # on the CPU, each batch's search on as many threads as pay (nmt.translate.threads)
        # (and on one where its prepacked products would give a row other bits on more)
        agrees = functools.partial(keeps_bits_on, model)
        self.threads = SearchThreads(agrees=agrees) if self.device.type == "cpu" else None
        self.generator = None
        if decode.sampling:  # one stream for the whole run: the same seed gives the same output
            self.generator = torch.Generator(self.device).manual_seed(decode.seed)

    def reseed(self, seed: int) -> None:
        """Sampling from here on draws from the stream of `seed` (nmt.translate.chunks: one per chunk)."""
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def search(
        self,
        ids: list[list[int]],
        prefixes: list[list[int]] | None = None,
        nbest: int | None = None,
        constraints: Terms | None = None,
    ) -> list[list[Hypothesis]]:
        """The `nbest` (by default decode.nbest) best of each source, best first; with `constraints`, the
        best that obey them (`constrained`)."""
        d = self.decode
        n = d.nbest if nbest is None else nbest
        if constraints is not None:
            return self.constrained(ids, prefixes, n, constraints)
        if d.sampling:
            return self.sample(ids, prefixes, n)
        if d.beam == 1:
            return [[h] for h in self.run(self.greedy, ids, prefixes)]

        def beam(decoder, src: Tensor, prefix: Tensor | None, numbering: Tensor | None):
            return beam_search(
                decoder, src, d.beam, d.lenpen, d.max_len_a, d.max_len_b, n,
                min_len=d.min_len, no_repeat_ngram=d.no_repeat_ngram_size, prefix=prefix,
            )  # fmt: skip

        return self.run(beam, ids, prefixes, width=d.beam)

    def constrained(
        self, ids: list[list[int]], prefixes: list[list[int]] | None, n: int, terms: Terms
    ) -> list[list[Hypothesis]]:
        """Beam search under `terms` (nmt.translate.constraints), with the decode settings and the
        shortlist (each sentence's set holding every token of its terms). Sentences no hypothesis could
        place every term in are searched again without them (they get their best translation, not none).
        The beam is at least beam_needed (the terms' tokens + 1), whatever decode.beam says: at beam 1 the
        search could only keep the hypothesis furthest along its terms."""
        d = self.decode
        width = max(d.beam, beam_needed(terms.sentences))

        def search(decoder, src: Tensor, prefix: Tensor | None, numbering: Tensor | None, sentences):
            constraints, avoid = sentences, terms.avoid
            masks = [terms.glue, terms.ends, terms.word_ends]
            # the sources' sentence ends, counted in the whole vocabulary (a shortlist renumbers the output's)
            counts = terms.ends.to(src.device)[src].sum(1) if terms.ends is not None else None
            if numbering is not None:  # a shortlist's union: the terms in its numbering
                constraints, avoid, masks = renumbered(constraints, avoid, masks, numbering)
            glue, ends, word_ends = (m.to(src.device) if m is not None else None for m in masks)
            return constrained_beam_search(
                decoder, src, constraints, width, d.lenpen, d.max_len_a, d.max_len_b, n,
                min_len=d.min_len, no_repeat_ngram=d.no_repeat_ngram_size, prefix=prefix,
                avoid=avoid, glue=glue, ends=ends, source_ends=counts, word_ends=word_ends,
            )  # fmt: skip

        def searched(rows: list[int], sentences: list[list[Constraint]]) -> list[list[Hypothesis]]:
            return self.run(
                functools.partial(search, sentences=sentences),
                [ids[i] for i in rows],
                [prefixes[i] for i in rows] if prefixes else None,
                [constraint_tokens(c) for c in sentences],
                width=width,
            )

        everyone = list(range(len(ids)))
        sentences = terms.sentences
        replacing = d.terms_replace and prefixes is None and self.aligns(terms)
        if replacing:  # the model's own words for the terms' sources, in its translation without them
            rows = [i for i, cons in enumerate(sentences) if any(c.source for c in cons)]
            plain: list[Hypothesis | None] = [None] * len(ids)
            for i, hyp in zip(rows, self.run(self.greedy, [ids[i] for i in rows]), strict=True):
                plain[i] = hyp  # greedy is batch-invariant: the same as over the whole batch
            sentences = with_bans(sentences, self.own_words(ids, plain, terms))
        found = searched(everyone, sentences)
        missing = [i for i, hyps in enumerate(found) if not hyps]
        if replacing and missing:  # the bans may leave a term no room: those lines under their terms alone
            again = searched(missing, [terms.sentences[i] for i in missing])
            for i, hyps in zip(missing, again, strict=True):
                found[i] = hyps
            missing = [i for i, hyps in enumerate(found) if not hyps]
        if missing:
            again = self.search(
                [ids[i] for i in missing], [prefixes[i] for i in missing] if prefixes else None, n
            )
            for i, hyps in zip(missing, again, strict=True):
                found[i] = hyps
        return found

    def aligns(self, terms: Terms) -> bool:
        """Whether the model's own words for the terms' sources can be found (nmt.translate.displace):
        a single model (not an ensemble), a term with its source positions, and the token masks."""
        known = any(c.source for s in terms.sentences for c in s)
        masks = terms.glue is not None and terms.word_ends is not None
        return known and masks and hasattr(self.model, "decoder")

    def own_words(
        self, ids: list[list[int]], hyps: list[Hypothesis | None], terms: Terms
    ) -> list[list[tuple[int, ...]]]:
        """For the sources `ids`, with translations `hyps` without terms (None: not translated, no term
        with a source), the words that translate the terms' sources (nmt.translate.displace.own_words),
        by the model's cross-attention."""
        bans: list[list[tuple[int, ...]]] = []
        for src, hyp, cons in zip(ids, hyps, terms.sentences, strict=True):
            tokens = hyp.tokens if hyp is not None else []
            if not tokens or not any(c.source and not written(tokens, c) for c in cons):
                bans.append([])
                continue
            attention = cross_attention(self.model, src, tokens)
            lead = int(bool(src) and src[0] in terms.tags)  # a target tag links no word
            bans.append(own_words(attention, tokens, cons, terms.glue, terms.word_ends, lead))
        return bans

    def run(
        self,
        search: Callable[[Any, Tensor, Tensor | None, Tensor | None], list],
        ids: list[list[int]],
        prefixes: list[list[int]] | None = None,
        extra: list[list[int]] | None = None,
        width: int = 1,
    ) -> list:
        """`search(decoder, src, prefix, numbering)` over the sources `ids` and their forced `prefixes`,
        padded (padded_sources, padded_prefixes), in eval mode (then restored) and inference mode, on the
        CPU on the threads its rows (`width` a sentence: the beam) pay for (nmt.translate.threads); its
        hypotheses come back in vocabulary ids.

        Without a shortlist the decoder is the model, `numbering` None. With one, each sentence decodes
        over its own set, its prefix and its `extra` ids (the tokens its terms are written with) added,
        the search in the numbering of the batch's union (nmt.translate.shortlist.ShortlistDecoder):
        `prefix` is in it already, and `numbering` (U,) gives the vocabulary id of each of its tokens, for
        what else the search is given in vocabulary ids."""
        threads = self.threads.batch(len(ids) * width) if self.threads else contextlib.nullcontext()
        with threads, evaluating(self.model) as model, torch.inference_mode():
            src = padded_sources(ids, self.device, self.max_positions)
            prefix = padded_prefixes(prefixes, self.device)
            if self.shortlist is None:
                return search(model, src, prefix, None)
            from nmt.translate.shortlist import ShortlistDecoder

            added = [p for p in (prefix, padded_prefixes(extra, self.device)) if p is not None]
            decoder = ShortlistDecoder(model, self.shortlist, src, torch.cat(added, 1) if added else None)
            return decoder.from_union(search(decoder, src, decoder.to_union(prefix), decoder.ids))

    def greedy(
        self,
        decoder,
        src: Tensor,
        prefix: Tensor | None,
        numbering: Tensor | None,
        sampler: Sampler | None = None,
    ) -> list[Hypothesis]:
        d = self.decode
        return greedy_search(
            decoder, src, d.max_len_a, d.max_len_b, d.lenpen,
            min_len=d.min_len, no_repeat_ngram=d.no_repeat_ngram_size, prefix=prefix, sampler=sampler,
        )  # fmt: skip

    def sample(
        self, ids: list[list[int]], prefixes: list[list[int]] | None, n: int
    ) -> list[list[Hypothesis]]:
        """`n` drawn translations of each source, best score first."""
        d = self.decode
        sampler = Sampler(d.sampling_topk, d.sampling_topp, d.temperature, self.generator)
        # sentence i's samples are rows i*n .. i*n+n-1
        rows = [seq for seq in ids for _ in range(n)]
        row_prefixes = [seq for seq in prefixes for _ in range(n)] if prefixes is not None else None
        drawn = self.run(functools.partial(self.greedy, sampler=sampler), rows, row_prefixes)
        return [sorted(drawn[i : i + n], key=lambda h: -h.score) for i in range(0, len(drawn), n)]
