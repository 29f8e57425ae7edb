"""Decoding over lexical shortlists (`nmt translate --shortlist`): each sentence's log-softmax runs over its
own set of target subwords (nmt.shortlist.Shortlist, built by `nmt shortlist`), not the whole vocabulary.

Decoding. A sentence's set is the frequent pieces, the table rows of its source pieces, EOS and UNK, and
the ids the caller adds (prefix tokens, glossary tokens): `Shortlist.members`. A batch decodes over the
union of its sentences' sets, U ids, renumbered 0..U-1 (`ShortlistDecoder`), so that the output
projection, log-softmax and top-k of every step cover U columns, not V. The projection's rows (and the
output bias) of the union are gathered once per batch, (U, D): one shared matrix, not one per sentence,
which would read B times the weights at every step (slower than the whole vocabulary at greedy batches
of hundreds). The product runs in the model's own CPU kernel (int8, or fp32 prepacked for oneDNN:
nmt.translate.int8, nmt.translate.prepacked) built again over the gathered rows, which gives each column the
full projection's very numbers; the union is filled up with ids of no set to one of a few sizes
(`union_size`), so the kernels oneDNN builds per shape serve many batches. Each sentence's mask is -inf
on the union's ids outside its own set, so its log-softmax normalizes over its own set and its output
does not depend on the other sentences of its batch (CTranslate2 and Marian decode over the union
itself). Scores are log-probabilities over the shortlist.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt.errors import NmtError
from nmt.shortlist import Shortlist
from nmt.tokens import BOS, EOS, PAD, UNK


def union_size(members: int, vocab: int) -> int:
    """How many ids a batch's union of `members` ids is filled up to: one of a few sizes, at most 1/16
    (and 64) apart, so that a CPU kernel built for the union's product (oneDNN builds and caches one per
    shape) serves many batches; at most the vocabulary."""
    step = max(64, 1 << max(0, members.bit_length() - 4))
    return min(vocab, -(-members // step) * step)


def output_rows(model, ids: Tensor):
    """The model's output projection (and bias) on the rows `ids` (U,): (N, D) -> (N, U), column i the
    full projection's column ids[i]. A CPU kernel of the model's (`output_kernel`: int8, or fp32
    prepacked for oneDNN) is made over those rows, so that the union's product runs in it too: int8's
    integers and scales gathered, fp32's rows laid out again. Both quantize or lay out each output row on
    its own, so a gathered row gives the very numbers of the full map's row."""

    def floats() -> tuple[Tensor, Tensor | None]:
        # index_select, not weight[ids]: advanced indexing took 3x as long (75 against 23 us for 512 rows)
        weight = model.output_weight.index_select(0, ids)  # (U, D)
        return weight, model.output_bias.index_select(0, ids) if model.output_bias is not None else None

    kernel = model.output_kernel
    if kernel is not None:  # the floats only where the kernel needs them: int8's gathers its integers
        return kernel.over(ids, floats)
    weight, bias = floats()
    return lambda y: F.linear(y.to(weight.dtype), weight, bias)


@dataclass
class SentenceOutput:
    """The output projection restricted to the union of a batch's sets, each sentence masked to its own."""

    project: Callable[[Tensor], Tensor]  # (N, D) -> (N, U): output_rows of the union's ids
    mask: Tensor  # (B, 1, U) 0 on each sentence's own ids, -inf elsewhere

    @classmethod
    def gather(cls, sets: Tensor, ids: Tensor, model) -> SentenceOutput:
        """`sets` (B, V) from Shortlist.members, `ids` (U,) their union (and ids of no set, filling it up
        to union_size); `model` a Transformer."""
        dtype = model.output_weight.dtype
        mask = torch.zeros(sets.shape[0], 1, len(ids), dtype=dtype, device=ids.device)  # (B, 1, U)
        return cls(output_rows(model, ids), mask.masked_fill_(~sets[:, None, ids], -math.inf))

    def logits(self, y: Tensor, beam: int) -> Tensor:
        """Hidden states y (B*beam, D), sentence-major -> logits over the union (B*beam, U), -inf outside
        each sentence's set."""
        b, u = self.mask.shape[0], self.mask.shape[2]
        return self.project(y).view(b, beam, u).add_(self.mask).view(b * beam, u)  # (B*beam, U)

    def select(self, sentences: Tensor) -> SentenceOutput:
        """Only the sentences `sentences` (B',), in that order (finished ones leave the batch)."""
        return SentenceOutput(self.project, self.mask.index_select(0, sentences))


class ShortlistDecoder:
    """A model (or an Ensemble) decoding the sources `src` over their shortlists: search's decoder contract
    (nmt.translate.search.Decoder) in the union's own numbering, where token i is vocabulary id ids[i].

    The search then works on U columns, not V: the projection, log-softmax and top-k of every step. The
    reserved ids (PAD, UNK, BOS, EOS: the lowest) are always in the union, so they keep their numbers and
    the search's masks and EOS test hold as they are. `extra` (B, E), PAD-filled, adds ids to each source's
    set: the engine passes forced prefixes (`to_union` renumbers them) and glossary tokens would go the same
    way; `from_union` turns the search's hypotheses back into vocabulary ids.
    """

    def __init__(self, model, shortlist: Shortlist, src: Tensor, extra: Tensor | None = None):
        if shortlist.vocab_size != model.vocab_size:
            raise NmtError(
                f"the shortlist is for {shortlist.vocab_size} subwords, the model has {model.vocab_size}"
            )
        self.model, self.max_positions = model, model.max_positions
        self.sets = shortlist.members(src, extra)  # (B, V)
        union = self.sets.any(0)
        union[: max(PAD, UNK, BOS, EOS) + 1] = True
        members = int(union.sum())
        filler = (~union).nonzero().squeeze(1)  # ids of no set: never emitted, they fill the union up
        union[filler[: union_size(members, model.vocab_size) - members]] = True
        self.ids = union.nonzero().squeeze(1)  # (U,) ascending: ids[i] = i for the reserved ones
        self.vocab_size = len(self.ids)
        self.index = torch.zeros(model.vocab_size, dtype=torch.long, device=src.device)  # (V,) id -> i
        self.index[self.ids] = torch.arange(self.vocab_size, device=src.device)

    def to_union(self, tokens: Tensor | None) -> Tensor | None:
        return None if tokens is None else self.index[tokens]

    def from_union(self, found: list) -> list:
        """The search's hypotheses (a list, or a list of n-best lists) with vocabulary ids."""
        ids = self.ids.tolist()
        return [
            self.from_union(h)
            if isinstance(h, list)
            else dataclasses.replace(h, tokens=[ids[t] for t in h.tokens])
            for h in found
        ]

    def encode(self, src: Tensor):
        return self.model.encode(src)

    def init_state(self, memory, src_keep, max_len: int, beam: int = 1):
        return self.model.init_state(memory, src_keep, max_len, beam, output=self.output)

    def output(self, model) -> SentenceOutput:
        """The restricted output a Transformer decodes with (its `init_state`'s `output`, which an
        Ensemble hands to each member): its projection onto the union, each sentence masked to its set."""
        return SentenceOutput.gather(self.sets, self.ids, model)

    def step(self, tokens: Tensor, state):
        return self.model.step(self.ids[tokens], state)  # (N,) union numbers -> vocabulary ids

    def greedy_loop(self, state, max_lens: Tensor, min_len: int, lenpen: float, masks):
        loop = getattr(self.model, "greedy_loop", None)  # an Ensemble has none
        return loop(state, max_lens, min_len, lenpen, masks, self.ids) if loop is not None else None

    def beam_loop(self, state, beam: int, max_lens: Tensor, min_len: int, lenpen: float, nbest: int, masks):
        loop = getattr(self.model, "beam_loop", None)
        if loop is None:  # an Ensemble has none
            return None
        return loop(state, beam, max_lens, min_len, lenpen, nbest, masks, self.ids)

    def reorder_beams(self, state, rows: Tensor):
        return self.model.reorder_beams(state, rows)

    def select_rows(self, state, rows: Tensor):
        return self.model.select_rows(state, rows)

    def expand_beams(self, state, beam: int):
        return self.model.expand_beams(state, beam)  # the sentences' sets stay once per sentence
