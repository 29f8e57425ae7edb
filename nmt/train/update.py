"""One update of the paper's recipe (section 5.3): set the rate, forward/backward over the update's
micro-batches with the label-smoothed loss, clip, and step Adam, or skip an update that is not finite.

`train_step` is what `nmt train` runs each update and what the throughput benchmark times, so the two
cannot drift apart.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from nmt.config import TrainConfig
from nmt.data.loader import Update
from nmt.tokens import PAD
from nmt.train.loss import projected_label_smoothed_nll
from nmt.train.runtime import Runtime


@dataclass(frozen=True)
class Learner:
    """What every update works on, built once by the loop (and by the throughput benchmark)."""

    net: torch.nn.Module  # what runs forward: the model, or its DDP and/or compiled wrapper
    model: torch.nn.Module  # the parameters themselves (the Transformer)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None  # fp16 only
    train: TrainConfig  # label smoothing, clipping
    rt: Runtime


def train_step(learner: Learner, update: Update, lr: float) -> tuple[Tensor | None, Tensor]:
    """Run one update at rate `lr`; returns (the gradient norm, or None when it was not finite and the
    update was skipped; the summed (loss, nll) of its target tokens, on the device)."""
    net, model, optimizer, scaler, rt = (
        learner.net,
        learner.model,
        learner.optimizer,
        learner.scaler,
        learner.rt,
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
    # The loss is normalised by the target tokens of the whole update on all ranks, so the gradients
    # equal those of one big batch; DDP averages over ranks, which the world size undoes.
    total = update.target_tokens
    if rt.world_size > 1:
        total = total.clone()
        dist.all_reduce(total)
    norm = rt.world_size / total
    smoothing = learner.train.label_smoothing
    sums = forward_backward(
        net, model.output_weight, update.batches, norm, smoothing, rt, scaler, model.output_bias
    )
    return optimizer_step(model, optimizer, scaler, learner.train.clip_norm), sums


def forward_backward(
    net,
    output_weight: Tensor,
    batches,
    norm: Tensor,
    label_smoothing: float,
    rt: Runtime,
    scaler,
    output_bias: Tensor | None = None,
) -> Tensor:
    """Accumulate the gradients of one update's micro-batches; returns the summed (loss, nll).

    `norm` scales each micro-batch's summed loss. Under DDP only the last micro-batch all-reduces. The
    network stops before its output projection, which the loss does chunk by chunk with the shared
    embedding matrix (`output_weight`); the projection's gradient reaches that matrix within the same
    backward pass, before DDP's hook on it runs.
    """
    sums = torch.zeros(2, device=rt.device)
    last = len(batches) - 1
    for i, (src, tgt_in, tgt_out) in enumerate(batches):
        sync = i == last or rt.world_size == 1
        with contextlib.nullcontext() if sync else net.no_sync(), rt.autocast():
            states = net(src, tgt_in, project=False)  # (B, T, D)
            loss, nll = projected_label_smoothed_nll(
                states, output_weight, tgt_out, label_smoothing, PAD, bias=output_bias
            )
        (scaler.scale(loss * norm) if scaler else loss * norm).backward()
        sums += torch.stack([loss.detach(), nll.detach()])
    return sums


def optimizer_step(model, optimizer, scaler, clip_norm: float) -> Tensor | None:
    """Clip (when asked) and step; returns the gradient norm, or None when it was not finite (skipped)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm or math.inf)
    finite = bool(torch.isfinite(grad_norm))  # the one host-device sync of an update
    if scaler is not None:
        scaler.step(optimizer)  # skips by itself on inf/NaN
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm if finite else None
