"""Token-budget batching: sentences bucketed by length, batches filled up to a budget, order seeded.

An epoch's batches are a pure function of (lengths, budget, seed, epoch), so a resumed run can rebuild
them and skip to where it stopped, and every rank of a distributed run can take its own shard.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmt.model import PAD_ID
from nmt.subword import BOS, EOS


def pack_batches(order: Tensor, src_lens: Tensor, tgt_lens: Tensor, batch_tokens: int) -> list[Tensor]:
    """Cut `order` (indices sorted by length) into batches of at most `batch_tokens` padded tokens.

    A batch of n pairs costs n * max(longest source + EOS, longest target + BOS), i.e. the padded size of
    its larger side. A single pair over the budget still forms a batch of its own.
    """
    cost = torch.maximum(src_lens[order], tgt_lens[order]) + 1  # (N,) one special token per side
    batches, start, longest = [], 0, 0
    cost_list = cost.tolist()
    for i, c in enumerate(cost_list):
        longest_if_added = max(longest, c)
        if i > start and longest_if_added * (i - start + 1) > batch_tokens:
            batches.append(order[start:i])
            start, longest_if_added = i, c
        longest = longest_if_added
    if start < len(cost_list):
        batches.append(order[start:])
    return batches


def epoch_batches(
    src_lens: Tensor, tgt_lens: Tensor, batch_tokens: int, seed: int, epoch: int, world_size: int = 1
) -> list[Tensor]:
    """One epoch's batches in training order.

    Pairs are shuffled, then stably sorted by (target, source) length so that equal-length pairs land in
    different batches each epoch; the batches are shuffled too. The count is cut to a multiple of
    `world_size` so that every rank takes the same number of steps.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(src_lens), generator=g)
    key = tgt_lens[order] * (int(src_lens.max()) + 1) + src_lens[order] if len(order) else order
    order = order[torch.sort(key, stable=True).indices]
    batches = pack_batches(order, src_lens, tgt_lens, batch_tokens)
    batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
    return batches[: len(batches) - len(batches) % world_size]


def collate(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (src + EOS, BOS + tgt, tgt + EOS) id tensors, each (B, T)."""
    n = len(pairs)
    s = max(len(src) for src, _ in pairs) + 1
    t = max(len(tgt) for _, tgt in pairs) + 1
    src = torch.full((n, s), PAD_ID, dtype=torch.long)
    tgt_in = torch.full((n, t), PAD_ID, dtype=torch.long)
    tgt_out = torch.full((n, t), PAD_ID, dtype=torch.long)
    for i, (x, y) in enumerate(pairs):
        src[i, : len(x)] = x
        src[i, len(x)] = EOS
        tgt_in[i, 0] = BOS
        tgt_in[i, 1 : len(y) + 1] = y
        tgt_out[i, : len(y)] = y
        tgt_out[i, len(y)] = EOS
    return src, tgt_in, tgt_out
