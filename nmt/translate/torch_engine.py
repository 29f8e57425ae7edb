"""The PyTorch engine: subword ids in, n-best hypotheses out, through nmt.translate.search; no files or lines.

It picks the search from the decode settings: greedy for beam 1 (the same result as beam 1, less work),
beam search otherwise, and drawing with a sampler when `decode.sampling` is on (`nbest` samples each).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmt.config import DecodeConfig, Engine
from nmt.tokens import EOS, PAD
from nmt.translate.search import Hypothesis, Sampler, beam_search, greedy_search


def padded_sources(ids: list[list[int]], device: torch.device) -> Tensor:
    """Source ids + EOS, right-padded: (B, S)."""
    src = torch.full((len(ids), max(map(len, ids)) + 1), PAD, dtype=torch.long)
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
        self.generator = None
        if decode.sampling:  # one stream for the whole run: the same seed gives the same output
            self.generator = torch.Generator(self.device).manual_seed(decode.seed)

    def search(
        self, ids: list[list[int]], prefixes: list[list[int]] | None = None, nbest: int | None = None
    ) -> list[list[Hypothesis]]:
        """The `nbest` (by default decode.nbest) best of each source, best first; eval mode during the
        search, then restored."""
        d, model = self.decode, self.model
        n = d.nbest if nbest is None else nbest
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                src, prefix = padded_sources(ids, self.device), padded_prefixes(prefixes, self.device)
                if d.sampling:
                    return self.sample(src, prefix, n)
                if d.beam == 1:
                    return [[h] for h in self.greedy(src, prefix)]
                decoder, prefix, restore = self.decoder(src, prefix)
                return restore(beam_search(
                    decoder, src, d.beam, d.lenpen, d.max_len_a, d.max_len_b, n,
                    min_len=d.min_len, no_repeat_ngram=d.no_repeat_ngram_size, prefix=prefix,
                ))  # fmt: skip
        finally:
            model.train(was_training)

    def greedy(self, src: Tensor, prefix: Tensor | None, sampler: Sampler | None = None) -> list[Hypothesis]:
        d = self.decode
        decoder, prefix, restore = self.decoder(src, prefix)
        return restore(greedy_search(
            decoder, src, d.max_len_a, d.max_len_b, d.lenpen,
            min_len=d.min_len, no_repeat_ngram=d.no_repeat_ngram_size, prefix=prefix, sampler=sampler,
        ))  # fmt: skip

    def decoder(self, src: Tensor, prefix: Tensor | None):
        """What the search decodes with: the model, its prefix, and what turns the hypotheses into
        vocabulary ids. With a shortlist, each sentence decodes over its own set (which holds its prefix),
        the search in the numbering of the batch's union (nmt.shortlist.ShortlistDecoder)."""
        if self.shortlist is None:
            return self.model, prefix, lambda found: found
        from nmt.shortlist import ShortlistDecoder

        decoder = ShortlistDecoder(self.model, self.shortlist, src, prefix)
        return decoder, decoder.to_union(prefix), decoder.from_union

    def sample(self, src: Tensor, prefix: Tensor | None, n: int) -> list[list[Hypothesis]]:
        """`n` drawn translations of each source, best score first."""
        d = self.decode
        sampler = Sampler(d.sampling_topk, d.sampling_topp, d.temperature, self.generator)
        rows = src.repeat_interleave(n, dim=0)  # (B*n, S): sentence i's samples are rows i*n .. i*n+n-1
        prefix = prefix.repeat_interleave(n, dim=0) if prefix is not None else None
        drawn = self.greedy(rows, prefix, sampler)
        return [sorted(drawn[i : i + n], key=lambda h: -h.score) for i in range(0, len(drawn), n)]
