"""Word alignment of a translation to its source, from the model's own cross-attention.

After the search, one teacher-forced pass over the chosen translation (so the decoding loop is untouched)
gives decoder layer LAYER's attention over the source, averaged over its heads. A target subword is aligned
to the source subword it attends to most (the source EOS excluded), and a target word to the source word of
its first subword that is aligned. This is how Bergamot places markup (Marian's alignment from attention),
except that Bergamot's models train one head on guided alignments; ours learn none, so the heads are
averaged. The layer is the last: on 20 hand-made English sentences with one inline tag each, translated
by the Multi30k en-de demo model (3 decoder layers, 4 heads), the tag wrapped exactly the right German
word(s) 13/20 times from layer 1's attention, 13/20 from layer 2's and 15/20 from layer 3's (19/20 wrapped
the right word, some with a neighbour). Row j is the attention of the position that predicts tgt[j]: the
rows of the positions that read tgt[j] (one later) placed at most 2 of 20 right.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nmt.model import evaluating
from nmt.tokens import BOS, EOS

LAYER = -1  # the last decoder layer: the best aligned on the hand-made markup set (module docstring)
WORD_START = "\u2581"  # SentencePiece's mark of a piece that begins a word


def cross_attention(model, src: list[int], tgt: list[int], layer: int = LAYER) -> Tensor:
    """The attention (T, S) of each target subword over the source subwords + EOS, heads averaged: row j is
    the attention of the position that predicts tgt[j]. A model in training mode is read in eval mode
    (no dropout) and left in training mode."""
    with evaluating(model):
        return _cross_attention(model, src, tgt, layer)


def _cross_attention(model, src: list[int], tgt: list[int], layer: int) -> Tensor:
    layers = model.decoder
    index = layer if -len(layers) <= layer < len(layers) else -1
    index %= len(layers)
    with torch.inference_mode():
        device = model.embed.weight.device
        src_t = torch.tensor([[*src, EOS]], dtype=torch.long, device=device)  # (1, S)
        tgt_in = torch.tensor([[BOS, *tgt]], dtype=torch.long, device=device)  # (1, T+1)
        memory, src_keep = model.encode(src_t)
        y = model.embed_tokens(tgt_in)  # (1, T+1, D)
        for i, block in enumerate(layers):
            k, v = block.cross_attn.memory_kv(memory)  # each (1, H, S, K)
            if i == index:  # the first half of DecoderLayer.forward, to read the cross-attention queries
                h = block.res_self(y, lambda x, a=block.self_attn: a.self_attention(x, None, causal=True))
                h = block.res_cross.norm(h) if block.res_cross.pre_norm else h
                q = block.cross_attn.cross_queries(h, 1)  # (1, H, T+1, K)
                scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
                return torch.softmax(scores, dim=-1)[0].mean(0)[: len(tgt)]  # (T, S)
            y = block(y, k, v, src_keep)
    raise AssertionError("unreachable: the layer index is within the decoder")


def word_starts(pieces: list[str]) -> list[int]:
    """The word index of each subword: a new word at each piece that begins with the word mark."""
    out, word = [], -1
    for piece in pieces:
        if piece.startswith(WORD_START) or word < 0:
            word += 1
        out.append(word)
    return out


class Aligner:
    """Source word -> target word alignments of (source, translation) sentence pairs with one model."""

    def __init__(self, model, subword, layer: int = LAYER):
        self.model, self.subword, self.layer = model, subword, layer
        self.vocabulary = subword.pieces()

    def pieces(self, ids: list[int]) -> list[str]:
        return [self.vocabulary[i] if 0 <= i < len(self.vocabulary) else "" for i in ids]

    def align(self, source: str, translation: str, tag: str | None = None) -> list[int | None] | None:
        """For each whitespace word of `translation`, the index of the whitespace word of `source` it is
        aligned to (None: none); None when the subwords do not match the words (no alignment to trust).
        `tag`: the target tag the source was translated with (a model of several targets), read by the
        encoder as in translation and aligned to no word."""
        src_words, tgt_words = source.split(), translation.split()
        if not src_words or not tgt_words:
            return None
        src = self.subword.encode([source], tag=tag)[0][: self.model.max_positions - 1]
        tgt = self.subword.encode_target([translation])[0][: self.model.max_positions - 1]
        lead = 1 if src and src[0] in self.subword.tags.values() else 0  # the tag, before the first word
        src_word, tgt_word = word_starts(self.pieces(src[lead:])), word_starts(self.pieces(tgt))
        if (
            not src[lead:]
            or not tgt
            or src_word[-1] + 1 != len(src_words)
            or tgt_word[-1] + 1 != len(tgt_words)
        ):
            return None
        attention = cross_attention(self.model, src, tgt, self.layer)  # (T, S+1)
        best = attention[:, lead : len(src)].argmax(-1).tolist()  # the tag and the source EOS left out
        out: list[int | None] = [None] * len(tgt_words)
        for j, i in enumerate(best):
            if out[tgt_word[j]] is None:
                out[tgt_word[j]] = src_word[i]
        return out
