"""Ensemble decoding: several models searched as one, through the decoder contract of search
(nmt.translate.search.Decoder), which the ensemble itself fulfils.

At every step each model scores the next token with its own decoder state, and the ensemble's
distribution is the average of theirs: log p(w) = logsumexp_m(log p_m(w)) - log M, as fairseq's
EnsembleModel. Search sees one model: `step` returns these log-probabilities (already normalized, so
the log-softmax search applies leaves them unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nmt.translate.search import Decoder


@dataclass
class EnsembleMemory:
    """Each model's encoder output; `dtype` is what search scores in."""

    parts: list[Tensor]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype


class Ensemble(nn.Module):
    """Models with one vocabulary, decoded as their averaged distribution."""

    def __init__(self, models: list[Decoder]):
        super().__init__()
        if len({m.vocab_size for m in models}) != 1:
            raise ValueError("ensemble members must share one vocabulary")
        self.models = list(models)  # a plain list: any object with the decoder contract may take part
        self.vocab_size = models[0].vocab_size
        self.max_positions = min(m.max_positions for m in models)

    @property
    def members(self) -> list[Decoder]:
        """The models decoded as one."""
        return self.models

    def train(self, mode: bool = True) -> Ensemble:
        super().train(mode)
        for m in self.members:
            if isinstance(m, nn.Module):
                m.train(mode)
        return self

    def encode(self, src: Tensor) -> tuple[EnsembleMemory, list[Tensor]]:
        encoded = [m.encode(src) for m in self.members]
        return EnsembleMemory([mem for mem, _ in encoded]), [keep for _, keep in encoded]

    def init_state(
        self, memory: EnsembleMemory, src_keep: list[Tensor], max_len: int, beam: int = 1, output=None
    ) -> list:
        """Each member's state; `output` (a restricted output, nmt.translate.shortlist) is handed to each,
        which builds its own over its own weights."""
        given = {"output": output} if output is not None else {}  # members without one keep the contract
        return [
            m.init_state(mem, keep, max_len, beam, **given)
            for m, mem, keep in zip(self.members, memory.parts, src_keep, strict=True)
        ]

    def step(self, tokens: Tensor, states: list) -> tuple[Tensor, list]:
        lprobs = []
        for i, m in enumerate(self.members):
            logits, states[i] = m.step(tokens, states[i])
            lprobs.append(torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1))
        return torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs)), states  # (N, V)

    def reorder_beams(self, states: list, rows: Tensor) -> list:
        return [m.reorder_beams(s, rows) for m, s in zip(self.members, states, strict=True)]

    def select_rows(self, states: list, rows: Tensor) -> list:
        return [m.select_rows(s, rows) for m, s in zip(self.members, states, strict=True)]

    def expand_beams(self, states: list, beam: int) -> list:
        return [m.expand_beams(s, beam) for m, s in zip(self.members, states, strict=True)]
