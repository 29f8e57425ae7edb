"""Token-budget batching: sentences bucketed by length, batches filled up to a budget, order seeded.

An epoch's batches are a pure function of (lengths, budget, seed, epoch), so a resumed run can rebuild
them and skip to where it stopped, and every rank of a distributed run can take its own shard.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmt.data.binarized import ParallelData
from nmt.tokens import BOS, EOS, PAD


def pack_batches(order: Tensor, src_lens: Tensor, tgt_lens: Tensor, batch_tokens: int) -> list[Tensor]:
    """Cut `order` (indices sorted by length) into batches of at most `batch_tokens` padded tokens.

    A batch of n pairs costs n * max(longest source + EOS, longest target + BOS), i.e. the padded size of
    its larger side. Greedy: each batch takes pairs in order while its cost stays within the budget; a
    single pair over the budget still forms a batch of its own. The loop runs once a batch, not once a
    pair (a WMT epoch is 4.5M pairs but about 11k batches): a batch's pairs are found with a running
    maximum over the next budget / cost-of-its-first-pair candidates, since no batch can hold more.
    """
    cost = torch.maximum(src_lens[order], tgt_lens[order]) + 1  # (N,) one special token per side
    batches, start, n = [], 0, len(cost)
    counts = torch.arange(1, max(1, batch_tokens) + 1)  # (budget,) pairs in a batch
    while start < n:
        window = cost[start : start + max(1, batch_tokens // int(cost[start]))]  # (W,) candidates
        padded = window.cummax(0).values * counts[: len(window)]  # (W,) cost with 1..W pairs
        size = max(1, int((padded <= batch_tokens).sum()))  # padded is increasing: the fits are a prefix
        batches.append(order[start : start + size])
        start += size
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


def collate(data: ParallelData, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (src + EOS, BOS + tgt, tgt + EOS) id tensors, each (B, T), of the pairs `idx` of a
    split, gathered straight from its memory-mapped ids: a few tensor ops a batch, none a pair."""
    src_lens, tgt_lens = data.src_lens[idx], data.tgt_lens[idx]  # (B,)
    src = padded_rows(data.src_ids, data.src_offsets[idx], src_lens, int(src_lens.max()) + 1, shift=0)
    src.scatter_(1, src_lens[:, None], EOS)  # (B, S)
    width = int(tgt_lens.max()) + 1
    tgt_out = padded_rows(data.tgt_ids, data.tgt_offsets[idx], tgt_lens, width, shift=0)
    tgt_out.scatter_(1, tgt_lens[:, None], EOS)  # (B, T)
    tgt_in = padded_rows(data.tgt_ids, data.tgt_offsets[idx], tgt_lens, width, shift=1)
    tgt_in[:, 0] = BOS  # (B, T)
    return src, tgt_in, tgt_out


def padded_rows(ids: Tensor, starts: Tensor, lens: Tensor, width: int, shift: int) -> Tensor:
    """(B, width) int64: row b holds ids[starts[b] : starts[b] + lens[b]] from column `shift` on, PAD
    elsewhere (the special tokens' columns are written by the caller)."""
    cols = torch.arange(width) - shift  # (W,)
    inside = (cols >= 0) & (cols < lens[:, None])  # (B, W)
    positions = torch.where(inside, starts[:, None] + cols, 0)  # (B, W) any valid index outside
    return ids[positions].to(torch.int64).masked_fill_(~inside, PAD)
