"""Which training pairs an epoch holds when corpora are weighted: fairseq's temperature sampling.

Corpus i of n_i pairs (of N in all) gets the share p_i ∝ weight_i * (n_i / N)^(1 / T) of each epoch's
N pairs (Arivazhagan et al., 2019; fairseq's `--sampling-temperature`). With every weight 1 and T = 1
that is n_i: the epoch is the corpora concatenated, every pair once, exactly as without sampling. A
corpus drawn more often than its size is repeated whole and topped up with a random part of it; one
drawn less often gives a random part. The draw is a pure function of (seed, epoch), like the batches
(nmt.data.batching), so a resumed run trains on the same pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

SAMPLING_SALT = 7_919  # keeps the draw's random numbers apart from the batching's for the same (seed, epoch)


@dataclass(frozen=True)
class Group:
    """A corpus's pairs in a binarized split: a contiguous run of `pairs` pairs, drawn by `weight`."""

    name: str
    pairs: int
    weight: float = 1.0


def shares(groups: Sequence[Group], temperature: float) -> list[float]:
    """Each group's probability p_i ∝ weight_i * (n_i / N)^(1 / T); 0 for an empty group."""
    total = sum(g.pairs for g in groups)
    raw = [g.weight * (g.pairs / total) ** (1 / temperature) if g.pairs else 0.0 for g in groups]
    return [r / sum(raw) for r in raw]


def epoch_counts(groups: Sequence[Group], temperature: float) -> list[int]:
    """Pairs each group gives an epoch of N pairs: its share of N, rounded, at least 1 if non-empty."""
    total = sum(g.pairs for g in groups)
    return [
        max(1, round(p * total)) if g.pairs else 0
        for g, p in zip(groups, shares(groups, temperature), strict=True)
    ]


def is_concatenation(groups: Sequence[Group], temperature: float) -> bool:
    """Whether every epoch is simply every pair once (no weights, T = 1, or a single corpus)."""
    nonempty = [g for g in groups if g.pairs]
    return len(nonempty) <= 1 or (temperature == 1.0 and all(g.weight == 1.0 for g in nonempty))


def epoch_pairs(groups: Sequence[Group], temperature: float, seed: int, epoch: int) -> Tensor | None:
    """(M,) int64 indices into the split of the pairs epoch `epoch` trains on, each group's run
    repeated or cut to its count; None where that is every pair once (is_concatenation)."""
    if is_concatenation(groups, temperature):
        return None
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch + SAMPLING_SALT)
    parts, start = [], 0
    for group, count in zip(groups, epoch_counts(groups, temperature), strict=True):
        whole, rest = divmod(count, group.pairs) if group.pairs else (0, 0)
        run = torch.arange(start, start + group.pairs)
        parts += [run] * whole
        if rest:
            parts.append(run[torch.randperm(group.pairs, generator=g)[:rest]])
        start += group.pairs
    return torch.cat(parts)
