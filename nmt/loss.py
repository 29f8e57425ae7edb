"""Label-smoothed cross-entropy (Szegedy et al., 2016; paper section 5.4) as a pure function."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def label_smoothed_nll(
    logits: Tensor, target: Tensor, epsilon: float, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and summed NLL over non-padding positions.

    The target distribution puts 1 - epsilon on the reference token and spreads epsilon uniformly over
    the whole vocabulary (fairseq's convention: the reference also receives epsilon / V):
        loss = (1 - eps) * -log p(y) + eps * mean_v(-log p(v))
    logits: (..., V), target: (...) -> (loss, nll), both scalar sums in float32.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (N, V)
    keep = target != ignore_index
    nll = -lprobs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.mean(dim=-1)
    nll = nll.masked_fill(~keep, 0.0).sum()
    smooth = smooth.masked_fill(~keep, 0.0).sum()
    return (1.0 - epsilon) * nll + epsilon * smooth, nll


def perplexity(nll_per_token: float) -> float:
    """exp of the mean NLL in nats, capped so a diverged run prints a number rather than inf."""
    return float(torch.tensor(min(nll_per_token, 100.0)).exp())
